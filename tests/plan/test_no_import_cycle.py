"""plan/ has no import circle (issue 17 item 2): the module graph of ``megatron_hsap/plan``, read
from the source with ``ast`` (every ``import`` / ``from ... import``, at module level or inside a
function — a lazy import is a dependency too), is acyclic. Imports under ``if TYPE_CHECKING:``
are left out: they never run, they only name a type for annotations.

Why it can fail: before the ``Plan`` type had its own module, ``plan/plan.py`` (type and search in
one) imported ``shared_layout.no_slower_than_full`` inside ``compile_plan`` and ``Plan.with_window``
imported ``shared_layout.compile_on_layout``, while ``shared_layout`` imported ``plan/plan.py``
inside its functions for ``_compile_on`` / ``_build``: the cycle plan.plan → shared_layout →
plan.plan, which this test reports. ``test_cycle_finder_reports_a_cycle`` shows the finder on
that very edge set.

Reference: the source text itself (no import machinery), and the brief's layering: the type
module ``plan_type`` imports neither the search (``plan.plan``) nor the modules above it."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_hsap.plan as plan_pkg

PLAN_DIR = Path(plan_pkg.__file__).resolve().parent
PKG = "megatron_hsap.plan"


def _module_name(path: Path) -> str:
    return PKG if path.name == "__init__.py" else f"{PKG}.{path.stem}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Modules of ``modules`` that ``tree`` imports outside ``if TYPE_CHECKING:`` blocks."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # ``from megatron_hsap.plan import plan`` names a submodule
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif node.module in modules:
                    out.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted(PLAN_DIR.glob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(ast.parse(f.read_text(), str(f)), modules) - {_module_name(f)} for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path ``[a, b, ..., a]``, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cyc := dfs(nxt)) is not None:
                return cyc
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cyc := dfs(node)) is not None:
            return cyc
    return None


def test_plan_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert f"{PKG}.plan_type" in graph and f"{PKG}.verify" in graph  # the scan found the modules
    assert f"{PKG}.plan_type" in graph[f"{PKG}.plan"]  # edges are read (the search imports the type)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in plan/: {' -> '.join(cycle)}"


def test_the_type_module_is_below_the_search_and_the_functions_over_it() -> None:
    graph = import_graph()
    below = set()  # everything plan_type reaches, lazily or not
    todo = [f"{PKG}.plan_type"]
    while todo:
        for nxt in graph[todo.pop()] - below:
            below.add(nxt)
            todo.append(nxt)
    assert not below & {f"{PKG}.plan", f"{PKG}.shared_layout", PKG}, sorted(below)
    for fn in ("verify", "dump", "stats", "fingerprint", "chunks"):  # they name Plan for type checking only
        assert f"{PKG}.plan_type" not in graph[f"{PKG}.{fn}"], fn


def test_cycle_finder_reports_a_cycle() -> None:
    old = {"plan": {"shared_layout", "codegen"}, "shared_layout": {"plan", "cache"}, "codegen": {"ir"}, "ir": set(), "cache": set()}
    assert find_cycle(old) == ["plan", "shared_layout", "plan"]
    assert find_cycle({k: v - {"plan"} for k, v in old.items()}) is None

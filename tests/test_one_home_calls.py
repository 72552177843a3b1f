"""One home per rule (issue 17 items 3 and 4), for the kernel-call grouping and its neighbours:

* which compute items form one kernel call: ``plan/calls.py``; the executor's prepared steps, the
  simulator and the head-chunk estimate import it and group nothing themselves;
* per-wire row shapes and element sizes: ``plan/costs.py`` (``HeadShape.row_shapes``,
  ``element_bytes``, ``fp32_wire``, ``FP32_WIRES``); the executor's slot views and the simulator's merge widths
  read them instead of tables of their own;
* the kv heads per intra rank: ``plan/options.kv_heads_per_rank``; Ulysses and the simulator
  import it;
* the executor dispatches on typed prepared instructions, never on string tags (``step[0]``).

Checked on the syntax trees of the package (imports, definitions, literals), so a copy that comes
back under another name but the same shape still fails."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_hsap

PKG = Path(megatron_hsap.__file__).resolve().parent
SOURCES = {p.relative_to(PKG).as_posix(): ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}


def _imports(path: str) -> set[tuple[str, str]]:
    """(module, name) of every ``from module import name`` of ``path`` (module level or local)."""
    return {(node.module or "", a.name) for node in ast.walk(SOURCES[path]) if isinstance(node, ast.ImportFrom)
            for a in node.names}  # fmt: skip


def _functions(name: str) -> list[str]:
    return [f"{path}:{node.name}" for path, tree in SOURCES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]  # fmt: skip


def _wire_members(node: ast.AST) -> set[str]:
    """``Wire.X`` attribute names directly in a literal (set, tuple, list, dict keys)."""
    elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return {e.attr for e in elts if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "Wire"}


_HEAD_SIZES = {"num_heads", "num_kv_heads", "head_dim", "head_dim_v", "dtype_bytes"}


def _sizes(value: ast.AST) -> bool:
    """Whether a table value is size arithmetic (``h * dv * b``, ``s.num_heads``), not a tensor."""
    for n in ast.walk(value):
        if isinstance(n, ast.BinOp) or isinstance(n, ast.Attribute) and n.attr in _HEAD_SIZES:
            return True
    return False


def test_kernel_call_grouping_has_one_home() -> None:
    for name in ("stage_calls", "program_calls", "call_counts", "all_local", "_fusable"):
        got = _functions(name)
        assert got == [f"plan/calls.py:{name}"], got
    assert ("megatron_hsap.plan.calls", "stage_calls") in _imports("runtime/prepared.py")
    assert ("megatron_hsap.plan.calls", "stage_calls") in _imports("sim/hsap.py")
    assert ("megatron_hsap.plan.calls", "call_counts") in _imports("plan/chunks.py")
    # the old copies grouped by a key of (srcs, causal) or tested "every src is None" themselves
    for path, tree in SOURCES.items():
        if path == "plan/calls.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(isinstance(e, ast.Attribute) for e in node.elts):
                assert {e.attr for e in node.elts} != {"srcs", "causal"}, f"{path}: a kernel-call grouping key"
        text = ast.unparse(tree)
        assert "in item.srcs) and all(" not in text and "_local_only" not in text, path


def test_local_rows_have_one_home() -> None:
    # runtime/prepared.py's Rows moved to plan/calls.py (LocalRows); nothing else maps tokens to rows by bisect
    classes = [f"{p}:{n.name}" for p, t in SOURCES.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)
               and n.name in {"Rows", "_Rows", "LocalRows"}]  # fmt: skip
    assert classes == ["plan/calls.py:LocalRows"]


def test_wire_formats_have_one_home() -> None:
    fp32_sets = [p for p, t in SOURCES.items() for n in ast.walk(t)
                 if isinstance(n, (ast.Set, ast.Tuple, ast.List)) and {"LSE", "DELTA", "DQ", "DKV"} <= _wire_members(n)]  # fmt: skip
    assert fp32_sets == ["plan/costs.py"], fp32_sets
    for path in ("runtime/executor.py", "sim/hsap.py"):  # no per-wire table of their own
        tables = [n for n in ast.walk(SOURCES[path]) if isinstance(n, ast.Dict) and _wire_members(n)
                  and any(_sizes(v) for v in n.values)]  # fmt: skip
        assert not tables, f"{path} has its own per-wire table: {[ast.unparse(t)[:60] for t in tables]}"
    text = ast.unparse(SOURCES["runtime/executor.py"])  # the slot dtype from the shape's one rule
    assert ".row_shapes(" in text and ".element_bytes(" in text and ".fp32_wire(" in text
    assert ".token_elements(" in ast.unparse(SOURCES["sim/hsap.py"])


def test_kv_heads_per_rank_has_one_home() -> None:
    assert _functions("kv_heads_per_rank") == ["plan/options.py:kv_heads_per_rank"]
    assert _functions("_kv_heads_exchanged") == []
    for path in ("sim/hsap.py", "runtime/ulysses.py"):
        assert ("megatron_hsap.plan.options", "kv_heads_per_rank") in _imports(path), path
    # the rule's two modulo tests (Hkv % P, P % Hkv) are written only in its home
    for path in ("sim/hsap.py", "runtime/ulysses.py"):
        for node in ast.walk(SOURCES[path]):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                operands = {ast.unparse(node.left), ast.unparse(node.right)}
                assert not (operands & {"hkv", "num_kv_heads"} and operands & {"p", "intra", "intra_size"}), (
                    f"{path}: {ast.unparse(node)} restates the kv-heads rule")


def test_executor_dispatches_on_types() -> None:
    tree = SOURCES["runtime/executor.py"]
    text = ast.unparse(tree)
    assert "step[0]" not in text and '"post"' not in text and '"compute"' not in text
    assert any(isinstance(n, ast.Match) for n in ast.walk(tree))
    assert "step[0]" not in ast.unparse(SOURCES["runtime/prepared.py"])


def test_divisors_and_the_intra_head_rule_have_one_home() -> None:
    # ``_divisors`` was written in runtime/ulysses.py, megatron/arguments.py and launch/config.py, and
    # the intra head rule a second time in megatron/arguments.py (``_heads_fit``)
    assert _functions("divisors") == ["plan/checks.py:divisors"]
    assert _functions("intra_fits_heads") == ["plan/options.py:intra_fits_heads"]
    assert _functions("valid_intra_sizes") == ["plan/options.py:valid_intra_sizes"]
    for path, tree in SOURCES.items():
        if path == "plan/checks.py":
            continue
        for node in ast.walk(tree):  # ``[x for x in range(1, n + 1) if n % x == 0]``, any names
            if isinstance(node, ast.comprehension) and isinstance(node.iter, ast.Call) and ast.unparse(node.iter.func) == "range":
                for cond in node.ifs:
                    for n in ast.walk(cond):
                        if (isinstance(n, ast.Compare) and isinstance(n.left, ast.BinOp) and isinstance(n.left.op, ast.Mod)
                                and ast.unparse(n.left.right) == ast.unparse(node.target)
                                and ast.unparse(n.comparators[0]) == "0"
                                and ast.unparse(n.left.left) + " + 1" == ast.unparse(node.iter.args[-1])):
                            raise AssertionError(f"{path}: {ast.unparse(node)} restates plan/checks.py divisors")
    # the kv tests of the rule (Hkv % P, P % Hkv: split or replicated) only in its home; TE's a2a
    # (registry._te_a2a) is another rule: it asserts both head counts divisible, no replication
    for path in ("megatron/arguments.py", "bench/memory.py", "runtime/ulysses.py", "baselines/registry.py",
                 "baselines/hierarchical.py", "baselines/kernel_blocks.py", "sim/methods.py", "sim/hsap.py"):
        skip = {id(n) for f in ast.walk(SOURCES[path]) if isinstance(f, ast.FunctionDef) and f.name == "_te_a2a" for n in ast.walk(f)}
        for node in ast.walk(SOURCES[path]):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and id(node) not in skip:
                names = {ast.unparse(node.left).rpartition(".")[2], ast.unparse(node.right).rpartition(".")[2]}
                assert not (names & {"kv_heads", "hkv", "num_kv_heads", "g"} and names & {"d", "p", "P", "q", "u", "intra", "intra_size", "group", "head_split"}), (
                    f"{path}: {ast.unparse(node)} restates the intra head rule")


def test_intra_head_rule_agrees_with_kv_heads_per_rank() -> None:
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.plan.checks import divisors
    from megatron_hsap.plan.options import intra_fits_heads, kv_heads_per_rank, valid_intra_sizes

    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(7) == [1, 7]
    for heads in range(1, 25):
        for kv in range(1, heads + 1):
            for intra in range(1, 2 * heads + 1):
                try:
                    kv_heads_per_rank(heads, kv, intra)
                    ok = True
                except ConfigError:
                    ok = False
                assert ok == (heads % kv == 0 and intra_fits_heads(heads, kv, intra)), (heads, kv, intra)
                assert ok == (intra in valid_intra_sizes(heads, kv)), (heads, kv, intra)

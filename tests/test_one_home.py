"""One home per rule (issue 17 item 3): the positive-integer check and the LRU-cache idiom are
each defined once and imported from there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_hsap
from megatron_hsap.errors import ConfigError

PKG = Path(megatron_hsap.__file__).resolve().parent
SOURCES = {p.relative_to(PKG).as_posix(): ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}
CHECK_NAMES = {"positive_int", "check_size", "_positive", "_positive_int", "check_positive", "_check_positive"}


def _two_arg_checks() -> list[str]:
    """``(name, value)`` validators named like the positive-integer check (``argtypes.positive_int``,
    an argparse type of one text argument, is another thing)."""
    out = []
    for path, tree in SOURCES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in CHECK_NAMES and len(node.args.args) >= 2:
                out.append(f"{path}:{node.name}")
    return out


def _lru_idioms(tree: ast.AST) -> int:
    """Calls of ``.move_to_end(...)`` or ``.popitem(last=False)``: the hand-written LRU."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "move_to_end" or (
                node.func.attr == "popitem" and any(k.arg == "last" for k in node.keywords)
            ):
                n += 1
    return n


def _inline_positive_checks(tree: ast.AST) -> int:
    """``isinstance(x, bool) ... x < 1`` in one boolean expression: the check written inline."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            text = ast.unparse(node)
            if "isinstance(" in text and ", bool)" in text and "< 1" in text:
                n += 1
    return n


def test_positive_int_defined_once():
    assert _two_arg_checks() == ["plan/checks.py:positive_int"]


# Inline copies not folded yet (a ratchet: this set may only shrink). rendezvous stays torch- and
# numpy-free on purpose (it runs before any planner import); baselines/ and sim/ belong to the
# simulator's owner; options (head_chunks, moved from chunks)/workloads/memory carry their own messages, tested elsewhere.
INLINE_LEFT = {"runtime/rendezvous.py", "baselines/windowed.py", "baselines/flat.py", "baselines/hierarchical.py",
               "sim/cluster.py", "plan/options.py", "plan/workloads.py", "bench/memory.py"}


def test_no_inline_positive_int_copies():
    inline = {path for path, tree in SOURCES.items() if _inline_positive_checks(tree)}
    assert inline <= {"plan/checks.py"} | INLINE_LEFT, inline - INLINE_LEFT


def test_scanners_can_fail():
    assert _inline_positive_checks(ast.parse("if not isinstance(v, int) or isinstance(v, bool) or v < 1: pass"))
    assert _lru_idioms(ast.parse("c.move_to_end(k)\nc.popitem(last=False)\n")) == 2


def test_lru_idiom_defined_once():
    users = {path: n for path, tree in SOURCES.items() if (n := _lru_idioms(tree))}
    assert set(users) == {"plan/lru.py"}, users
    importers = {path for path, tree in SOURCES.items()
                 for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module == "megatron_hsap.plan.lru"}
    # the plan cache, executors, runners and handshake agreements all use the one LRUCache
    assert {"plan/cache.py", "runtime/executor.py", "runtime/hsap.py", "runtime/handshake.py"} <= importers


def test_positive_int_semantics():
    import numpy as np

    from megatron_hsap.plan.checks import positive_int

    assert positive_int("n", 3) == 3 and type(positive_int("n", np.int64(4))) is int
    for bad in (0, -1, True, 2.0, "2", None):
        with pytest.raises(ConfigError, match=rf"^n must be an integer >= 1, got {bad!r}$".replace("(", r"\(")):
            positive_int("n", bad)


def test_lru_semantics():
    from megatron_hsap.plan.lru import LRUCache

    c: LRUCache[str, int] = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now the most recent
    c.put("c", 3)  # evicts b, the least recently used
    assert c.keys() == ["a", "c"] and c.get("b") is None and len(c) == 2
    c.put("a", 10)
    assert c.keys() == ["c", "a"] and c.get("a") == 10
    c.clear()
    assert len(c) == 0
    with pytest.raises(ConfigError, match="maxsize must be an integer >= 1"):
        LRUCache(0)


# --- the causal pair count: one closed form (plan/window.staircase_pairs), one block count
# (plan/window.banded_pairs, spelled units.causal_work on TokenRanges); every copy calls one of them.

def _staircase_forms(tree: ast.AST) -> list[str]:
    """``x * (x ± 1) // 2`` or ``/ 2`` (the closed form written out)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Div)) and \
                isinstance(node.right, ast.Constant) and node.right.value == 2 and \
                isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mult):
            a, b = node.left.left, node.left.right
            for x, y in ((a, b), (b, a)):
                if isinstance(y, ast.BinOp) and isinstance(y.op, (ast.Add, ast.Sub)) and \
                        isinstance(y.right, ast.Constant) and y.right.value == 1 and ast.unparse(y.left) == ast.unparse(x):
                    out.append(ast.unparse(node))
                    break
    return out


# The one written-out form left: not an integer count (flat's diagonal block at P = 1 has c = l/2 rows).
STAIRCASE_LEFT: set[str] = set()
STAIRCASE_FORMS_LEFT = {("baselines/flat.py", "c * (c + 1) / 2")}


def test_causal_closed_form_written_once():
    users = {path: forms for path, tree in SOURCES.items() if (forms := _staircase_forms(tree))}
    assert set(users.pop("plan/window.py")) == {"n * (n - 1) // 2"}  # staircase_pairs itself
    left = {(p, f) for p, forms in users.items() if p not in STAIRCASE_LEFT for f in forms} - STAIRCASE_FORMS_LEFT
    assert not left, sorted(left)


def _function(path: str, name: str) -> ast.FunctionDef:
    """``name`` (``f`` or ``Class.f``) in ``path``."""
    tree = SOURCES[path]
    *cls, fn = name.split(".")
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls[0]).body if cls else tree.body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == fn)


def _calls(fn: ast.AST) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


@pytest.mark.parametrize("path,name,home", [
    ("plan/units.py", "causal_work", "banded_pairs"),
    ("plan/ir.py", "Unit.work", "banded_pairs"),
    ("plan/ir.py", "ComputeItem.work", "banded_pairs"),
    ("plan/window.py", "banded_pairs", "staircase_pairs"),
    ("plan/window.py", "doc_pairs", "banded_pairs"),
    ("plan/placement.py", "Placement.rows_work", "staircase_pairs"),
    ("plan/placement.py", "rows_for_work", "staircase_pairs"),
    ("plan/balanced.py", "piece_work", "staircase_pairs"),
    ("plan/layout.py", "Batch.doc_work", "staircase_pairs"),
    ("sim/builder.py", "causal_pairs", "staircase_pairs"),
    ("baselines/flat.py", "_causal_pairs", "staircase_pairs"),
])
def test_causal_count_copies_call_the_home(path, name, home):
    assert home in _calls(_function(path, name)), f"{path}:{name} must count pairs through {home}"


def test_causal_count_forms_agree():
    import numpy as np

    from megatron_hsap.baselines.flat import _causal_pairs
    from megatron_hsap.plan.balanced import piece_work
    from megatron_hsap.plan.ir import TokenRange
    from megatron_hsap.plan.units import causal_work
    from megatron_hsap.plan.window import banded_pairs, staircase_pairs
    from megatron_hsap.sim.builder import causal_pairs

    brute = lambda qs, qe, ks: sum(1 for i in range(qs, qe) for j in range(ks, qe) if j <= i)  # noqa: E731
    for qs, qe, ks in ((0, 1, 0), (3, 9, 0), (5, 12, 2), (4, 4, 0), (7, 8, 7)):
        want = brute(qs, qe, ks)
        assert staircase_pairs(qe - qs, qs - ks + 1) == banded_pairs(qs, qe, ks, qe) == want
        assert causal_work(TokenRange(qs, qe), TokenRange(ks, qe), True) == piece_work(ks, qs, qe) == want
    n, first = np.array([0, 1, 5, 1000]), np.array([1, 3, 1, 7])
    assert causal_pairs(n, first).tolist() == [float(staircase_pairs(int(a), int(b))) for a, b in zip(n, first)]
    assert _causal_pairs(np.array([3, 8])) == brute(0, 3, 0) + brute(0, 8, 0)


def test_staircase_scanner_can_fail():
    assert _staircase_forms(ast.parse("y = n * (n + 1) // 2\nz = (m - 1) * m / 2\n")) == ["n * (n + 1) // 2", "(m - 1) * m / 2"]


# --- the phase wire table (plan/ir.PHASE_WIRES), the "computed where it lives" predicate
# (ir.Unit.is_local) and the slot lookup of an item (ir.ComputeItem.src / dst)

def _wire_tuples(tree: ast.AST) -> list[str]:
    """Tuple / set / list displays of two or more ``Wire.X`` members (a wire table written out)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.Set, ast.List)) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "Wire" for e in node.elts):
            out.append(ast.unparse(node))
    return out


def _local_predicates(tree: ast.AST) -> int:
    """``a.rank == a.q_owner == a.kv_owner`` (or ``r == u.q_owner == u.kv_owner``) written inline."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 2 and all(isinstance(o, ast.Eq) for o in node.ops):
            attrs = [c.attr for c in node.comparators if isinstance(c, ast.Attribute)]
            n += attrs == ["q_owner", "kv_owner"]
    return n


def _dict_lookups(tree: ast.AST) -> int:
    """``dict(x.srcs)`` / ``dict(x.dsts)``: an item's slots looked up by hand."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id == "dict" and len(node.args) == 1 and isinstance(node.args[0], ast.Attribute)
               and node.args[0].attr in ("srcs", "dsts"))


PHASE_TABLE = {"(Wire.O, Wire.LSE)", "(Wire.DQ, Wire.DKV)", "(Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA)",
               "{Wire.Q, Wire.KV}", "(Wire.Q, Wire.KV)", "{Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA, Wire.KV}",
               "(Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA, Wire.KV)"}


def test_phase_wire_table_written_once():
    users = {path: hits for path, tree in SOURCES.items() if path.startswith("plan/")
             if (hits := [t for t in _wire_tuples(tree) if t in PHASE_TABLE])}
    assert set(users) == {"plan/ir.py"}, users  # PHASE_WIRES; codegen, verify and dump import it


def test_is_local_predicate_written_once():
    users = {path: n for path, tree in SOURCES.items() if (n := _local_predicates(tree))}
    assert users == {"plan/ir.py": 1}, users


def test_item_slots_looked_up_through_the_accessor():
    users = {path for path, tree in SOURCES.items() if _dict_lookups(tree)}
    assert not users, users  # ComputeItem.src / .dst


def test_one_home_scanners_can_fail():
    tree = ast.parse("a = (Wire.O, Wire.LSE)\nif u.rank == u.q_owner == u.kv_owner: s = dict(it.srcs)[w]\n")
    assert _wire_tuples(tree) == ["(Wire.O, Wire.LSE)"] and _local_predicates(tree) == 1 and _dict_lookups(tree) == 1


def test_item_accessors_find_each_slot():
    from megatron_hsap.plan.ir import ComputeItem, Slot, TokenRange, Wire

    a, b = Slot(0, 256), Slot(256, 512)
    it = ComputeItem(q=TokenRange(4, 8), kv=TokenRange(0, 8), causal=True, srcs=((Wire.Q, None), (Wire.KV, a)),
                     dsts=((Wire.O, b), (Wire.LSE, None)))
    assert (it.src(Wire.Q), it.src(Wire.KV), it.dst(Wire.O), it.dst(Wire.LSE)) == (None, a, b, None)
    with pytest.raises(KeyError):
        it.src(Wire.DO)


@pytest.mark.parametrize("module,name", [
    ("megatron_hsap.plan.plan_type", "Plan.key"), ("megatron_hsap.plan.codegen", "Message.key"),
    ("megatron_hsap.plan.codegen", "phase_messages"), ("megatron_hsap.plan.schedule", "assign_stages"),
    ("megatron_hsap.plan.stats", "wire_bytes"), ("megatron_hsap.plan.cuts", "is_local"),
    ("megatron_hsap.plan.plan", "compile_plan.cache_clear"), ("megatron_hsap.plan.plan", "Plan.with_window"),
])
def test_dead_or_duplicate_entry_points_are_gone(module, name):
    import importlib

    obj = importlib.import_module(module)
    *parents, last = name.split(".")
    for p in parents:
        obj = getattr(obj, p)
    assert not hasattr(obj, last), f"{module}.{name} was deleted (issue 17 item 3); use its one home"


def _stats_subscripts(tree: ast.AST) -> int:
    """``x.stats()[...]``: a PlanStats field read by string (it is a frozen dataclass now)."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
               and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "stats" and not node.value.args)


def test_plan_stats_read_by_attribute():
    tests_dir = PKG.parent / "tests"
    trees = {**SOURCES, **{f"tests/{p.relative_to(tests_dir).as_posix()}": ast.parse(p.read_text())
                           for p in sorted(tests_dir.rglob("*.py"))}}
    assert {p for p, t in trees.items() if _stats_subscripts(t)} == set()
    assert _stats_subscripts(ast.parse('plan.stats()["imbalance"]')) == 1  # the scanner can fail
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.stats import PlanStats

    s = compile_plan([0, 100, 256], 2, num_heads=4, head_dim=16, layout="contiguous").stats()
    assert isinstance(s, PlanStats) and s.as_dict()["imbalance"] == s.imbalance
    with pytest.raises(TypeError):
        s["imbalance"]  # noqa: B018 - not subscriptable


# --- the phase vocabulary (plan/ir.Phase, a StrEnum): no "fwd" / "bwd" string literal elsewhere

def _phase_literals(tree: ast.AST) -> list[str]:
    """String constants that are exactly ``"fwd"`` or ``"bwd"`` (docstrings and longer strings such
    as ``"fwd_tflops_per_gpu"`` are other things), as ``line:value``."""
    return [f"{node.lineno}:{node.value}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ("fwd", "bwd")]


# Literals that are not a phase. Each entry: (path, value, reason); the count must match exactly.
PHASE_LITERALS_ALLOWED = {
    # the two column headers of the MagiAttention table (text of a markdown header, not a phase key)
    ("sim/magi.py", "fwd"): 1,
    ("sim/magi.py", "bwd"): 1,
}


def test_phase_literals_written_only_in_ir():
    found: dict[tuple[str, str], int] = {}
    for path, tree in SOURCES.items():
        if path == "plan/ir.py":  # Phase itself: FWD = "fwd", BWD = "bwd"
            continue
        for hit in _phase_literals(tree):
            key = (path, hit.split(":")[1])
            found[key] = found.get(key, 0) + 1
    assert found == PHASE_LITERALS_ALLOWED, {k: v for k, v in found.items() if PHASE_LITERALS_ALLOWED.get(k) != v}
    assert sorted(h.split(":")[1] for h in _phase_literals(SOURCES["plan/ir.py"])) == ["bwd", "fwd"]


def test_phase_scanner_can_fail():
    tree = ast.parse('"""docstring naming "fwd"."""\nx = run("fwd") if p == \'bwd\' else f"{g(\'fwd\')}"\ny = "fwd_s"\n')
    assert sorted(_phase_literals(tree)) == ["2:bwd", "2:fwd", "2:fwd"]  # the docstring and "fwd_s" are not hits


def test_phase_formats_as_its_value():
    import json

    from megatron_hsap.plan.ir import Phase

    assert f"{Phase.FWD}" == "fwd" and f"{Phase.BWD}" == "bwd" and str(Phase.BWD) == "bwd"
    assert "%s/%s" % (Phase.FWD, Phase.BWD) == "fwd/bwd" and f"{Phase.FWD:>4}" == " fwd"
    assert [p.value for p in Phase] == ["fwd", "bwd"] and list(Phase) == ["fwd", "bwd"]
    assert Phase("fwd") is Phase.FWD and Phase(Phase.BWD) is Phase.BWD
    assert {Phase.FWD: 1}["fwd"] == 1 and hash(Phase.BWD) == hash("bwd")
    assert json.dumps({Phase.FWD: Phase.BWD}) == '{"fwd": "bwd"}'
    for bad in ("forward", "FWD", "", None, 0):
        with pytest.raises(ConfigError, match=r"phase must be one of 'fwd', 'bwd' \(or Phase.FWD / Phase.BWD\), got "):
            Phase(bad)


def test_public_phase_parameters_accept_strings_and_reject_others():
    from megatron_hsap.plan.hardware import KernelCurve, KernelModel
    from megatron_hsap.plan.ir import Phase
    from megatron_hsap.sim.config import merge_bytes

    k = KernelModel(fwd_peak=4.0, bwd_peak=2.0, curve=KernelCurve(half_rate_tokens=512.0, launch_s=1e-5))
    assert float(k.rate(256, 256, "fwd")) == float(k.rate(256, 256, Phase.FWD)) == 2 * float(k.rate(256, 256, "bwd"))
    assert merge_bytes("te", "bwd") == merge_bytes("te", Phase.BWD) == 12.0
    with pytest.raises(ConfigError, match="phase must be one of"):
        k.rate(256, 256, "backward")
    with pytest.raises(ConfigError, match="phase must be one of"):
        merge_bytes("te", "forward")

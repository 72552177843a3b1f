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
# simulator's owner; chunks/workloads/memory carry their own messages, tested elsewhere.
INLINE_LEFT = {"runtime/rendezvous.py", "baselines/windowed.py", "baselines/flat.py", "baselines/hierarchical.py",
               "sim/cluster.py", "plan/chunks.py", "plan/workloads.py", "bench/memory.py"}


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

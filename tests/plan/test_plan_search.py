"""The candidate search's bounds on work (plan/plan.py): what it skips must not change the plan.

Counts and plan hashes only (no timing): the layout prune generates no code for a layout that
cannot win (balanced or contiguous), and the owner-computes recheck stops rebuilding once its restaged price leaves
the recheck's window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import megatron_hsap.plan.plan as search
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.cache import clear_plan_cache
from megatron_hsap.plan.fingerprint import plan_hash

GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128, hardware="a100")


def _compile_counting(monkeypatch: pytest.MonkeyPatch, cu: list[int], size: int) -> tuple[object, int]:
    calls = [0]
    real = search.generate

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "generate", counting)
    clear_plan_cache()
    plan = compile_plan(cu, size, **GQA)
    monkeypatch.setattr(search, "generate", real)
    return plan, calls[0]


def test_layout_prune_keeps_the_plan_and_generates_no_code_for_the_losing_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # one document filling the batch over 16 ranks: the head-tail split makes every rank fetch all
    # earlier kv over InfiniBand, so the balanced layout loses (its best staged price is 1.5x)
    cu = [0, 16384]
    pruned, n_pruned = _compile_counting(monkeypatch, cu, 16)
    monkeypatch.setattr(search, "_LAYOUT_PRUNE", float("inf"))
    full, n_full = _compile_counting(monkeypatch, cu, 16)
    assert pruned.stats().layout == full.stats().layout == "contiguous"
    assert plan_hash(pruned) == plan_hash(full)
    assert pruned.chosen.time == full.chosen.time
    assert n_pruned == 2  # the contiguous plan's forward and backward, nothing for the balanced one
    assert n_full > n_pruned


def test_layout_prune_never_skips_a_layout_that_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # a packed batch where the balanced layout is kept: the prune must not fire (seed 0: seed 1
    # keeps the contiguous layout since the estimate's ports drain as transfers start)
    from megatron_hsap.plan.workloads import pack_batches

    cu = [int(x) for x in pack_batches("fineweb", 65536, 1, 0)[0]]
    pruned, _ = _compile_counting(monkeypatch, cu, 8)
    monkeypatch.setattr(search, "_LAYOUT_PRUNE", float("inf"))
    full, _ = _compile_counting(monkeypatch, cu, 8)
    assert full.stats().layout == "balanced"
    assert plan_hash(pruned) == plan_hash(full)


def test_layout_prune_generates_no_code_for_a_contiguous_layout_that_loses(monkeypatch: pytest.MonkeyPatch) -> None:
    # a packed batch whose contiguous layout loses by ~15% (owner imbalance): its code is not
    # generated once the balanced plan is built; the shipped plan is the same
    from megatron_hsap.plan.workloads import pack_batches

    cu = [int(x) for x in pack_batches("fineweb", 65536, 2, 12345)[1]]
    pruned, n_pruned = _compile_counting(monkeypatch, cu, 8)
    monkeypatch.setattr(search, "_LAYOUT_PRUNE", float("inf"))
    full, n_full = _compile_counting(monkeypatch, cu, 8)
    assert pruned.stats().layout == full.stats().layout == "balanced"
    assert plan_hash(pruned) == plan_hash(full) and pruned.chosen.time == full.chosen.time
    assert n_full - n_pruned >= 2, (n_full, n_pruned)  # at least the contiguous forward and backward


def _fake_choose(monkeypatch: pytest.MonkeyPatch, owner_results: list[tuple[float | None, float]]) -> tuple[object, float, int]:
    """``_choose`` with min-traffic built at 1.0 s and owner-computes quick-priced at 1.02 s (within
    the recheck's 5%), its rebuilds answering ``owner_results`` in turn: (built time or None for a
    pool overflow, restaged price)."""
    calls = {"owner-computes": 0}

    def fake_build(name, split, st, budget, *rest):
        if name != "owner-computes":
            return SimpleNamespace(name=name, time=1.0), float("nan"), st, budget
        built, price = owner_results[calls[name]]
        calls[name] += 1
        if built is not None:
            return SimpleNamespace(name=name, time=built), float("nan"), st, budget
        return None, price, st, budget * search._OVERFLOW_STEP

    monkeypatch.setattr(search, "_build_or_halve", fake_build)
    priced = {"min-traffic": (1.0, None, None), "owner-computes": (1.02, None, None)}
    best, _, owner_time = search._choose(priced, 4, None, 1 << 30, None, 0.0, float(1 << 28))
    return best, owner_time, calls["owner-computes"]


def test_owner_recheck_stops_once_the_restaged_price_leaves_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # overflows restaged at 1.03 and 1.045 (still within 5% of the chosen 1.0), then 1.06: stop there
    results = [(None, 1.03), (None, 1.045), (None, 1.06)] + [(0.5, 0.5)] * 10
    best, owner_time, n = _fake_choose(monkeypatch, results)
    assert n == 3
    assert best.name == "min-traffic"
    assert owner_time == 1.06


def test_owner_recheck_still_keeps_owner_computes_when_it_fits_and_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    best, owner_time, n = _fake_choose(monkeypatch, [(None, 1.03), (1.005, float("nan"))])
    assert n == 2
    assert best.name == "owner-computes"  # within _OWNER_MARGIN of the mover: leaving work home wins
    assert owner_time == 1.005

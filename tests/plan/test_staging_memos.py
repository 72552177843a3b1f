"""The staging memos of 2026-12-05 give what a fresh computation gives (plans unchanged:
``tests.plan.plan_identity``): a staging's poured local blocks kept on its split, a rank's untiled
remote order shared by every pool budget, and a built price reading its staging's remote traffic
from the memo ``price_staging`` filled."""

from __future__ import annotations

from dataclasses import replace

import pytest

import megatron_hsap.plan.estimate as est
import megatron_hsap.plan.schedule as sched
from megatron_hsap.plan.cuts import needs_tiles
from megatron_hsap.plan.estimate import _kept_traffic, price_staging, quick_price
from megatron_hsap.plan.plan import _BUDGET_FRACTION
from megatron_hsap.plan.schedule import BlocksByRank
from tests.plan.speed_equal_cases import plan_and_rates, split_and_stagings

# 16 inter ranks: InfiniBand with 8 per node, so the traffic has both links
CASES = [("fineweb", 8192, 4, 0, {}), ("sharegpt", 8192, 16, 1, {}), ("ultrachat", 16384, 8, 2, {"layout": "contiguous"})]


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES)
def test_built_price_from_the_kept_traffic_equals_fresh(workload, T, inter, seed, kw, monkeypatch) -> None:
    plan, rates = plan_and_rates(workload, T, inter, seed, **kw)
    latency = plan.hardware.latency(plan.link)
    _, stagings = split_and_stagings(plan, rates)
    kept = 0
    for st in stagings:
        price_staging(st, inter, rates, latency)  # fills the memo, as the planner does first
        units = st.units()
        n = 2 + max(u.stage for u in units)
        kept += _kept_traffic(st, inter, n, rates) is not None
        got = quick_price(units, inter, rates, latency, st)
        assert got == quick_price(units, inter, rates, latency)
        with monkeypatch.context() as m:  # both phases' paths by numpy (rank_path.path_finish over both at once)
            m.setattr(est, "_PY_CELLS", -1)
            assert quick_price(units, inter, rates, latency) == got
    assert kept, "no staging read its traffic from the memo: the test would not exercise it"


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES[:2])
def test_pours_are_kept_on_the_split(workload, T, inter, seed, kw, monkeypatch) -> None:
    plan, rates = plan_and_rates(workload, T, inter, seed, **kw)
    _, stagings = split_and_stagings(plan, rates)
    calls = []
    pour = sched.fill_stages_by_budget
    monkeypatch.setattr(sched, "fill_stages_by_budget", lambda *a: calls.append(1) or pour(*a))
    poured = []
    for st in stagings:
        before = len(calls)
        first = st.units()
        made = len(calls) - before
        assert made <= sum(1 for loc in st.local if loc)
        assert st.units() == first and len(calls) == before + made  # poured again: from the memo
        assert first == replace(st, memo=None).units()  # equal to a fresh pour
        poured.append(made)
    rows = {(r, st.local_budget[r].tobytes()) for st in stagings for r, loc in enumerate(st.local) if loc}
    assert sum(poured) == len(rows)  # one pour per distinct (rank, budgets), whatever the shape


def test_untiled_remote_order_is_shared_by_every_budget(monkeypatch) -> None:
    plan, rates = plan_and_rates("sharegpt", 8192, 16, 1)
    budget = plan.pool_capacity * _BUDGET_FRACTION
    split, _ = split_and_stagings(plan, rates, budget)
    r = max(range(split.size), key=lambda i: len(split.remote[i]))
    assert split.remote[r]
    order = sched._ordered_remote(split, r, 1.0, budget, rates)
    calls = []
    interleave = sched._interleave
    monkeypatch.setattr(sched, "_interleave", lambda *a: calls.append(1) or interleave(*a))
    untiled = [b for b in (budget / 2, budget / 3) if not any(needs_tiles(u, b, rates) for u in split.remote[r])]
    assert untiled
    for b in untiled:
        assert sched._ordered_remote(split, r, 123.0, b, rates) is order
    assert not calls
    fresh = BlocksByRank.of([u for rem in split.remote for u in rem] + [u for loc in split.local for u in loc], split.size)
    assert sched._ordered_remote(fresh, r, 1.0, untiled[-1], rates) == order  # (the same blocks, work, footprints and least budget)
    # a budget under which a block needs tiles: ordered afresh each time, never the shared list
    monkeypatch.setattr(sched, "needs_tiles", lambda u, b, rates: True)
    before = len(calls)
    tiled = sched._ordered_remote(split, r, 1000.0, budget / 5, rates)
    again = sched._ordered_remote(split, r, 1000.0, budget / 5, rates)
    assert tiled is not order and again is not tiled and len(calls) == before + 2


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES)
def test_a_cut_is_reused_only_where_a_fresh_cut_is_the_same(workload, T, inter, seed, kw) -> None:
    # _cut_remote's least budget: every budget from it up to the one cut under gives the same parts
    # (a fresh split: no memo), so _cut_again reuses the parts there (a pool-overflow restaging)
    plan, rates = plan_and_rates(workload, T, inter, seed, **kw)
    budget = plan.pool_capacity * _BUDGET_FRACTION
    split, _ = split_and_stagings(plan, rates, budget)
    blocks = [u for rem in split.remote for u in rem] + [u for loc in split.local for u in loc]
    slack = 0
    for b in (budget, budget / 4, budget / 16):
        for r in range(split.size):
            if not split.remote[r]:
                continue
            for n_mid in (1, 2, 3):
                try:
                    got = sched._cut_remote(split, r, n_mid, rates, b)
                except sched.StagingError:
                    continue
                least = got[3]
                assert least <= b
                for smaller in {least, (least + b) / 2} - {b}:
                    if smaller <= 0:
                        continue
                    slack += 1
                    fresh = BlocksByRank.of(blocks, split.size)
                    again = sched._cut_remote(fresh, r, n_mid, rates, smaller)
                    assert again[:3] == got[:3]  # why: every pool-byte test goes the same way
                    first = sched._cut_again(split, r, n_mid, rates, b, None)  # (made, or found, under b)
                    assert sched._cut_again(split, r, n_mid, rates, smaller, None) is first  # why: reused, not cut again
    assert slack, "no cut had a budget to spare: the test would not exercise the reuse"

"""``bounds.price_floor`` bounds every staged price from below, and the layout choice that uses it
to skip staging the contiguous layout (``priced.PricedLayout.floor`` / ``exact``) ships the plan the
eager search ships (issue 14 item 5: compile time, plans identical).

References: ``price_staging`` itself over every stage shape of every placement (the floor must
not exceed any of them); a compile with every layout explored eagerly (``_price_on`` forced to
``lazy=False``) for the plans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_hsap.plan.plan as plan_mod
from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.bounds import price_floor
from megatron_hsap.plan.estimate import price_staging
from megatron_hsap.plan.fingerprint import plan_hash
from megatron_hsap.plan.schedule import BlocksByRank, StagingError, stage, stage_shapes
from megatron_hsap.plan.workloads import pack_batches

GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def _stagings(cu, inter: int, hardware: str, layout: str):
    """Every placement's split and every staging the planner could price on ``layout``, with the
    layout's ``PricedLayout`` (rates, latency)."""
    plan = compile_plan(cu, inter, **GQA, hardware=hardware, layout=layout, layout_fallback=False, flatten="never")
    p = plan_mod._price_on(plan.layout, plan.batch, plan.shape, plan.options)
    budget = p.capacity * plan_mod._BUDGET_FRACTION
    for pl in plan_mod._placements(list(p.units), inter, p.rates, plan.options.allow_helpers).values():
        split = BlocksByRank.of(pl.placed(), inter)
        for shp in stage_shapes(split, p.rates, budget):
            try:
                s = stage(split, p.rates, shp, budget)
            except StagingError:
                continue
            yield split, s, p


@settings(deadline=None, max_examples=8)
@given(workload=st.sampled_from(["fineweb", "sharegpt", "ultrachat"]), inter=st.sampled_from([2, 4, 8, 16]),
       seed=st.integers(0, 3), hardware=st.sampled_from(["a100", "h100-fa3"]),
       layout=st.sampled_from(["contiguous", "balanced"]))
def test_no_staging_is_priced_below_the_floor(workload, inter, seed, hardware, layout) -> None:
    clear_plan_cache()
    cu = pack_batches(workload, 16384, seed + 1, 5)[seed]
    n = 0
    for split, s, p in _stagings(cu, inter, hardware, layout):
        work = split.local_work + np.asarray(split.remote_work, dtype=np.float64)
        floor = price_floor(work, p.rates)
        t = price_staging(s, inter, p.rates, p.latency)
        assert 0 < floor <= t, (floor, t)
        # not vacuous: the busiest rank's pairs at the kernel's peak, from the blocks themselves
        k, r = p.rates.kernel, p.rates
        pairs = [sum(u.work for u in split.local[i] + split.remote[i]) for i in range(inter)]
        assert floor == pytest.approx(max(pairs) * (r.fpp_fwd / k.fwd_peak + r.fpp_bwd / k.bwd_peak), rel=1e-8)
        n += 1
    assert n > 0


@settings(deadline=None, max_examples=6)
@given(workload=st.sampled_from(["fineweb", "slimpajama", "sharegpt"]), inter=st.sampled_from([4, 8, 16]),
       seed=st.integers(0, 3), window=st.sampled_from([None, (512, 0)]))
def test_floor_before_staging_is_at_most_the_price(workload, inter, seed, window) -> None:
    """``PricedLayout.floor`` before staging (from each placement's tracked per-rank work, which
    equals its placed blocks' pairs) ≤ the price once staged; after, the price itself."""
    clear_plan_cache()
    cu = pack_batches(workload, 32768, seed + 1, 2)[seed]
    # flatten="never": the floor is of the P_inter plan (auto may keep a one-level all-to-all)
    plan = compile_plan(cu, inter, **GQA, layout="contiguous", window_size=window, flatten="never")
    lazy = plan_mod._price_on(plan.layout, plan.batch, plan.shape, plan.options, lazy=True)
    assert lazy.pending
    with pytest.raises(AssertionError):
        _ = lazy.price  # not staged yet: no price to read
    with pytest.raises(AssertionError):
        _ = lazy.priced
    for pl in lazy.placements.values():
        pairs = np.zeros(inter)
        for u in pl.placed():
            pairs[u.rank] += u.work
        assert np.array_equal(np.asarray(pl.work, dtype=np.float64), pairs)
    floor = lazy.floor
    price = lazy.exact().price
    assert not lazy.pending and 0 < floor <= price == lazy.floor
    priced = lazy.priced
    assert lazy.exact().priced is priced  # memoised: staged once


# (workload, T, P_inter, seed, options): the first two skip staging the contiguous layout (its
# floor is over the balanced plan's built time), the others need it
CASES = [("fineweb", 65536, 16, 2, GQA), ("fineweb", 262144, 64, 0, GQA), ("fineweb", 65536, 16, 0, GQA),
         ("fineweb", 16384, 8, 1, dict(num_heads=4, num_kv_heads=2, head_dim=16)),
         ("sharegpt", 65536, 8, 0, {**GQA, "link": "ib"})]


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES)
def test_lazy_layout_search_ships_the_eager_plan(workload, T, inter, seed, kw, monkeypatch) -> None:
    cu = pack_batches(workload, T, seed + 1, 0)[seed]
    skipped = []
    price_on = plan_mod._price_on

    def watched(*a, **k):
        p = price_on(*a, **k)
        skipped.append(p)
        return p

    monkeypatch.setattr(plan_mod, "_price_on", watched)
    clear_plan_cache()
    lazy = compile_plan(cu, inter, **kw)
    lazy_skipped = any(p.pending for p in skipped)  # (the skipped layout stays pending)
    monkeypatch.setattr(plan_mod, "_price_on", lambda *a, lazy=False: price_on(*a, lazy=False))
    clear_plan_cache()
    eager = compile_plan(cu, inter, **kw)
    assert plan_hash(lazy) == plan_hash(eager) and lazy.layout.name == eager.layout.name
    assert (lazy.chosen.time, lazy.owner_time, lazy.alternatives) == (eager.chosen.time, eager.owner_time, eager.alternatives)
    if (workload, T, inter, seed) in (("fineweb", 65536, 16, 2), ("fineweb", 262144, 64, 0)):
        assert lazy_skipped  # the shortcut was taken (else this case tests nothing new)

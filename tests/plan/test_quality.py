"""The issue's plan-quality targets (docs/design.md §4 measurement set: bf16, d 128, MHA 32/32 and GQA 32/8),
checked on a fast subset; the full grid and the timing budgets run under ``-m slow``.

Efficiency = lower bound / estimated time; compute-dominated = necessary-traffic time ≤ 0.5 ×
compute time. Known misses are pinned explicitly (with the floor they do reach), so a regression
and an improvement both show up.

Like with like: the baselines here are priced flat (``baselines/flat.py``: work × flat rate, no
merges, launches or kernel efficiency), so HSAP's chosen plan is priced here by the same flat
model (``flat_stats``) — the planner's own estimate (``Plan.stats()``) now prices what the
hardware charges (docs/design.md §4) and is compared with the simulator in
``tests/sim/test_estimate_accuracy.py``.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from megatron_hsap.plan import compile_plan
from megatron_hsap.baselines.flat import BASELINES, price_baseline
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import A100, link_class_for
from megatron_hsap.plan.workloads import pack_batches

K, M = 1 << 10, 1 << 20
HEADS = {"mha": (32, 32), "gqa": (32, 8)}

# (T, P, heads) -> efficiency actually reached where the target is missed, and why:
# one document, GQA over InfiniBand: rank 0 must ship its kv to every rank that keeps a block
# (i, 0) and return o for every block it takes over (q rows cost 3× kv bytes under GQA), and rank
# P−1 must receive every earlier kv; the necessary-traffic bound averages traffic over all ranks,
# which the triangle's source and sink cannot.
ONE_DOC_MISSES = {(64 * K, 16, "gqa"): 0.80, (64 * K, 64, "gqa"): 0.50}
# Known misses since the planner prices what the hardware charges (issue 14 item 2): it now picks
# the plan that is fastest with kernel efficiency, LSE merges, launches and the kernel slowdown
# beside transfers priced (the simulator agrees within 10%), which under the FLAT model of these
# baselines can be a little slower than the flat-optimal ring: (T, P, heads) -> HSAP flat time /
# best flat baseline reached (measured 1.017 and 1.029), and packed points -> wins reached.
RING_TIE_MISSES = {(64 * K, 8, "mha"): 1.02, (256 * K, 16, "mha"): 1.035}
PACKED_WIN_MISSES = {("slimpajama", 256 * K, 8, "gqa"): 1}  # 1 of 3 seeds below the best flat baseline


def plan_of(cu, P: int, heads: str):
    h, hkv = HEADS[heads]
    return compile_plan(cu, P, num_heads=h, num_kv_heads=hkv, head_dim=128)


def flat_stats(plan):
    """``plan.stats()`` with its times priced by the flat model the baselines use: forward and
    backward ``phase_time`` of the chosen blocks and messages at the flat rates (``Prices`` without
    a kernel), efficiency against the flat compute bound."""
    from dataclasses import replace

    from megatron_hsap.plan.estimate import compute_bound, phase_time
    from megatron_hsap.plan.placement import Prices

    s = plan.stats()
    pr = replace(Prices.of(plan.shape, plan.hardware, plan.hardware.bandwidth(plan.link)), kernel=None)
    lat = plan.hardware.latency(plan.link)
    units = list(plan.chosen.units)
    t = sum(phase_time(units, plan.raw_messages(ph), plan.inter_size, sec, pr.bw, lat).total
            for ph, sec in (("fwd", pr.sec_fwd), ("bwd", pr.sec_bwd)))
    comp = compute_bound(plan.batch.total_work(), plan.inter_size, pr.sec_fwd, pr.sec_bwd)
    bound = max(comp, s.traffic_bound_s)
    return replace(s, estimated_time_s=t, compute_bound_s=comp, lower_bound_s=bound, efficiency=bound / t,
                   compute_dominated=s.traffic_bound_s <= 0.5 * comp)


def baseline_times(cu, P: int, heads: str) -> dict[str, float]:
    h, hkv = HEADS[heads]
    shape = HeadShape(num_heads=h, num_kv_heads=hkv, head_dim=128, head_dim_v=128)
    out = {}
    for method in BASELINES:
        cost = price_baseline(method, cu, world=P, shape=shape, hardware=A100, link=link_class_for(P))
        if cost is not None:
            out[method] = cost.time
    return out


def check_one_document(T: int, P: int, heads: str) -> None:
    s = flat_stats(plan_of([0, T], P, heads))
    floor = ONE_DOC_MISSES.get((T, P, heads))
    if floor is not None:
        assert s.efficiency >= floor
    elif s.compute_dominated:
        assert s.imbalance <= 1.05 and s.efficiency >= 0.9, s
    else:
        assert s.efficiency >= 0.6, s
    if s.compute_dominated and floor is None:
        # a balanced ring is optimal for one compute-bound document: HSAP ties it (within 0.5%).
        # Where traffic rules, the baselines' bf16 gradients (HSAP: fp32 partials) can win.
        assert s.estimated_time_s <= min(baseline_times([0, T], P, heads).values()) * RING_TIE_MISSES.get((T, P, heads), 1.005)


@pytest.mark.parametrize(
    ("T", "P", "heads"),
    [(64 * K, 8, "mha"), (64 * K, 8, "gqa"), (64 * K, 16, "mha"), (64 * K, 16, "gqa"), (256 * K, 16, "mha"),
     (256 * K, 16, "gqa"), (1 * M, 8, "mha"), (1 * M, 4, "gqa")],
)
def test_one_document(T: int, P: int, heads: str) -> None:
    check_one_document(T, P, heads)


@pytest.mark.slow
@pytest.mark.parametrize("T", [64 * K, 256 * K, 1 * M])
@pytest.mark.parametrize("P", [2, 4, 8, 16, 64])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_one_document_full_grid(T: int, P: int, heads: str) -> None:
    check_one_document(T, P, heads)


def check_packed(workload: str, T: int, P: int, heads: str, seeds) -> None:
    """NVLink: median efficiency >= 0.8; every batch within 20% of the best baseline (worst seen:
    slimpajama 256K MHA seed 6, +16% against Ulysses) and strictly below it on >= 80% of batches. InfiniBand (reported, not a target): never worse than
    owner-computes. Ties and losses happen when one document dominates the batch: TE's zigzag ring
    is then itself within 0.1% of the bound, or (over InfiniBand) moving that document's work
    cannot hide its bytes while Ulysses' head split is balanced by construction."""
    seeds = list(seeds)
    batches = pack_batches(workload, T, max(seeds) + 1, 0)
    effs, wins = [], 0
    for seed in seeds:
        cu = batches[seed]
        plan = plan_of(cu, P, heads)
        own = plan.stats()  # the planner's own (hardware-priced) estimate: never worse than owner-computes
        # why 1e-12: two float sums of the same kind of terms in another order; a real loss is far larger
        assert own.estimated_time_s <= own.owner_computes_time_s * (1 + 1e-12) or np.isnan(own.owner_computes_time_s)
        s = flat_stats(plan)
        effs.append(s.efficiency)
        if link_class_for(P).value == "nvlink":
            best = min(baseline_times(cu, P, heads).values())
            assert s.estimated_time_s <= best * 1.20, (seed, s.estimated_time_s, best)
            wins += s.estimated_time_s < best
    if link_class_for(P).value == "nvlink":
        assert statistics.median(effs) >= 0.8, effs
        need = PACKED_WIN_MISSES.get((workload, T, P, heads), 0.8 * len(seeds))
        assert wins >= need, (wins, len(seeds))


@pytest.mark.parametrize("workload", ["fineweb", "slimpajama", "ultrachat", "sharegpt"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_packed_256k_p8(workload: str, heads: str) -> None:
    check_packed(workload, 256 * K, 8, heads, range(3))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["fineweb", "slimpajama", "ultrachat", "sharegpt"])
@pytest.mark.parametrize("T", [256 * K, 1 * M])
@pytest.mark.parametrize("P", [8, 16, 64])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_packed_full_grid(workload: str, T: int, P: int, heads: str) -> None:
    check_packed(workload, T, P, heads, range(5) if (T, P) == (1 * M, 64) else range(10))


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_dominating_document_ties_the_ring(heads: str) -> None:
    # a 161K-token document in a 1M batch: TE's zigzag ring is within 0.1% of the lower bound
    cu = pack_batches("sharegpt", 1 * M, 3, 0)[2]
    s = flat_stats(plan_of(cu, 8, heads))
    base = baseline_times(cu, 8, heads)
    assert s.efficiency >= 0.98
    assert s.estimated_time_s <= min(base.values()) * 1.02


@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_bytes_far_below_the_te_ring(heads: str) -> None:
    # docs/design.md §4: targets hold for the median of the seeded batches; the worst is reported. A batch
    # with one long document (owner-computes 3× unbalanced) moves up to ~0.4× to halve its time.
    h, hkv = HEADS[heads]
    shape = HeadShape(num_heads=h, num_kv_heads=hkv, head_dim=128, head_dim_v=128)
    ratios = []
    for cu in pack_batches("fineweb", 64 * K, 10, 0):
        s = plan_of(cu, 8, heads).stats()
        te = price_baseline("te_thd_ring", cu, world=8, shape=shape, hardware=A100, link=link_class_for(8))
        ratios.append(s.bytes_total / te.bytes_sent.sum())
    assert statistics.median(ratios) <= 0.15, ratios
    assert max(ratios) <= 0.5, ratios


def test_pool_within_capacity_and_reported() -> None:
    for cu in pack_batches("slimpajama", 256 * K, 3, 1):
        s = plan_of(cu, 8, "mha").stats()
        assert 0 < s.pool_peak_bytes <= s.pool_capacity_bytes
        # why approx (rel 1e-6 default): one float division of two exact integers, recomputed here
        assert s.pool_use == pytest.approx(s.pool_peak_bytes / s.pool_capacity_bytes)

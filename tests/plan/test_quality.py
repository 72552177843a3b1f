"""The issue's plan-quality targets (docs/design.md §4 measurement set: bf16, d 128, MHA 32/32 and GQA 32/8),
checked on a fast subset; the full grid and the timing budgets run under ``-m slow``.

Like with like under the real kernel curve (issue 14: "the same workload and kernel curve for
everyone"): HSAP's time is the planner's own estimate (``Plan.stats()``, docs/design.md §4: blocks
at the kernel's rate for their shape, launches, LSE merges and accumulations, the kernel slowdown
beside transfers) and the baselines' are ``baselines/flat.py``'s, priced with the same
``Hardware.kernel`` and merge bytes (each call the implementation makes, at its blocks' shapes).
Efficiency = max(ideal compute, necessary-traffic time) / estimated time, the ideal being issue
14's: every document whole at the kernel's rate for its own shape, perfectly spread
(``ideal_s``, recomputed here from the kernel model); compute-dominated = necessary-traffic time
≤ 0.5 × ideal compute. Known misses are pinned explicitly with the values they do reach, so a
regression and an improvement both show up.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.baselines.flat import BASELINES, price_baseline
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import A100, link_class_for
from megatron_hsap.plan.window import staircase_pairs
from megatron_hsap.plan.workloads import pack_batches

K, M = 1 << 10, 1 << 20
HEADS = {"mha": (32, 32), "gqa": (32, 8)}

# Known misses, measured with the kernel-model estimate on A100 constants (FA2) over the whole
# one-document grid (the fast subset is a part of it); limits are the measured values rounded to
# the next 0.005 outward. (T, P, heads) -> efficiency reached where the target (0.9
# compute-dominated, 0.6 else) is missed:
EFF_MISSES = {(64 * K, 2, "mha"): 0.89, (64 * K, 4, "mha"): 0.85, (64 * K, 8, "gqa"): 0.86,
              (64 * K, 8, "mha"): 0.805, (64 * K, 64, "gqa"): 0.35, (256 * K, 4, "mha"): 0.895,
              (256 * K, 8, "mha"): 0.88, (256 * K, 16, "mha"): 0.855, (256 * K, 16, "gqa"): 0.88,
              (1 * M, 8, "mha"): 0.895, (1 * M, 16, "mha"): 0.895, (1 * M, 64, "mha"): 0.855,
              (1 * M, 64, "gqa"): 0.88, (64 * K, 16, "mha"): 0.535, (64 * K, 16, "gqa"): 0.75,
              (64 * K, 64, "mha"): 0.585, (256 * K, 64, "mha"): 0.59, (256 * K, 64, "gqa"): 0.705}
# Remeasured 2026-12-03 over the whole grid with partial gradients in the activation dtype (the
# default grad_wire_dtype) and the search's 3% explore margin: every limit tightened to the new
# measured value (64K/4 GQA, 256K/8 GQA, 1M/4 MHA and 1M/16 GQA now meet 0.9 and left the table).
# The history and the breakdowns below were measured with fp32 gradient returns.
# Partial gradients in the activation dtype (the default grad_wire_dtype) halve the dq / dkv bytes,
# so the traffic bound fell with them: 256K/64 GQA became compute-dominated (bound 61.3 ms against
# a 163 ms kernel ideal) and is held to the 0.9 target, which it misses at 0.705 — region-distflash,
# imbalance 1.00, 230.9 ms against TE's ring at 231.4 (0.998×): the kernel rate of 4K-row pieces
# over 64 ranks is the term (kernel efficiency 0.705). 64K/64 GQA 0.3545 (was 0.36): its estimate
# fell less than its bound.
# The three P_inter 64 entries fell with the InfiniBand per-flow cap (docs/design.md §4): NCCL drives
# one network peer of a 64-rank communicator with one 14 GB/s channel, which the estimate now charges
# as the simulator does, while the traffic bound stays at the NIC's 48 GB/s (a rank with several peers
# can reach it, so that is the bound). Measured: 64K MHA 0.57 -> 0.518, 64K GQA 0.475 -> 0.360,
# 256K MHA 0.58 -> 0.527: the estimate rose toward the simulated time (estimate / simulated on 20
# InfiniBand batches 0.78–1.01 before the cap, 0.92–1.02 with it).
# The four 64K/16, 64K/64 MHA and 256K/64 MHA entries, and 64K/64 GQA 0.53 -> 0.475: the traffic
# bound used to price every necessary byte at the NIC's rate, which is no bound when inter ranks
# share a node (the estimate, like the hardware, moves node-local pairs over NVLink beside the NIC;
# a 4.82 ms estimate sat below a 4.94 ms "bound"). Now cross-node bytes over the NICs and all bytes
# over both ports (bounds.lower_bounds): these plans did not change, their bound fell; at 64K/16
# GQA the plan is now compute-dominated by the rule below (0.9 target) and reaches its kernel
# efficiency, 0.717 (one document over two nodes: LSE merges of the cut blocks).
# (64K, 64, GQA) is traffic-bound over InfiniBand: rank 0 must ship its kv to every rank that keeps
# a block (i, 0), rank P−1 receive every earlier kv; the necessary-traffic bound averages traffic
# over all ranks, which the triangle's source and sink cannot. Its floor went 0.54 -> 0.53 when the
# estimate became a per-rank path (the same owner-computes plan, simulated 62.05 ms both times: the
# estimate rose 42.11 -> 42.95 ms, received merges now follow the wait; the efficiency here is
# bound / estimate). (256K, 8, GQA) 0.88 -> 0.875 with it too (0.8775 measured: the per-rank
# path prices received merges after the wait, so the estimate rose toward the simulated time).
#
# (T, P, heads) -> HSAP time / the best baseline's on one compute-bound document (target: a tie,
# 1.005). The best is Ulysses (P ≥ 4 where P ≤ H: one whole-document block per rank at tile
# efficiency ≈ 0.99, no merges, unoverlapped all-to-alls so no kernel slowdown), the zigzag
# all-gather at P = 2 and GQA P = 4 (one call per q chunk, no merge) and TE's ring at P = 64.
# Against TE's ring HSAP is within 1.5% at 1M (P ≤ 16) but 1.15× at 64K/8 MHA. The terms, from the
# estimate's breakdown (max-rank sums, forward + backward):
#   64K/8 MHA 1.288 (ring 1.148): HSAP 113.0 ms = kernel 87.3 + merges/launches 17.6 (18 stages)
#     + kernel slowdown beside transfers ≈ 8; Ulysses 87.7 = kernel 81.8 + all-to-alls 6.0. LSE
#     merges and dq/dkv accumulations of HSAP's many pieces are the term.
#   64K/8 GQA 1.167 (ring 1.031): 99.9 = kernel 84.3 + merges 7.0 + slowdown ≈ 8.6; Ulysses 85.5.
#   256K/16 MHA 1.172 (ring 1.087): 818 = kernel 670 + merges 71 (34 stages) + slowdown ≈ 78;
#     Ulysses 698 = 652 + 47.
#   256K/16 GQA 1.099 (ring 1.011): 754 = kernel 659 + merges 28 + slowdown ≈ 67; Ulysses 687.
#   1M/8 MHA 1.114 (ring 1.014): 23.30 s = kernel 20.91 + merges 0.33 + slowdown ≈ 2.06; Ulysses
#     20.92. The 10% kernel slowdown beside in-flight transfers (Hardware.overlap_slowdown) is the term.
#   1M/4 GQA 1.090 vs the zigzag all-gather (ring 0.996): the same slowdown (≈ 3.7 s of 45.5 s).
#   64K/16 GQA 1.146 (ring 1.077), checked since the traffic bound counts node-local pairs at
#     NVLink rate (compute-dominated now): 57.0 ms, region-distflash over 17 stages, imbalance
#     1.00, against a 40.9 ms kernel ideal; Ulysses 49.7 ms. Merges and the slowdown again.
#   256K/8 GQA 1.127 (was 1.12 before the per-rank estimate: received merges now priced after the
#     wait, 1.485 s against Ulysses' 1.318 s; the same merges + slowdown terms).
BEST_MISSES = {(64 * K, 2, "mha"): 1.08, (64 * K, 2, "gqa"): 1.04, (64 * K, 4, "mha"): 1.105,
               (64 * K, 4, "gqa"): 1.03, (64 * K, 8, "mha"): 1.155, (64 * K, 8, "gqa"): 1.11,
               (256 * K, 2, "mha"): 1.085, (256 * K, 2, "gqa"): 1.035, (256 * K, 4, "mha"): 1.1,
               (256 * K, 4, "gqa"): 1.03, (256 * K, 8, "mha"): 1.115, (256 * K, 8, "gqa"): 1.1,
               (256 * K, 16, "mha"): 1.09, (256 * K, 16, "gqa"): 1.075, (1 * M, 2, "mha"): 1.09,
               (1 * M, 2, "gqa"): 1.03, (1 * M, 4, "mha"): 1.095, (1 * M, 4, "gqa"): 1.03,
               (1 * M, 8, "mha"): 1.11, (1 * M, 8, "gqa"): 1.095, (1 * M, 16, "mha"): 1.1,
               (1 * M, 16, "gqa"): 1.095, (64 * K, 16, "gqa"): 1.095}
# Remeasured 2026-12-03 (activation-dtype gradient returns, 3% explore margin): every limit
# tightened to the new measured ratio; 1M/64 MHA and GQA now beat the best baseline (0.949 / 0.995)
# and left the table. The per-point breakdowns above are the fp32-wire measurement's.


def plan_of(cu, P: int, heads: str):
    h, hkv = HEADS[heads]
    return compile_plan(cu, P, num_heads=h, num_kv_heads=hkv, head_dim=128)


def ideal_s(plan) -> float:
    """Issue 14's ideal: every document whole at the kernel's rate for its own causal block,
    forward + backward, spread perfectly over the ranks (from ``KernelModel.rate`` directly)."""
    k, sh = plan.hardware.kernel, plan.shape
    n = np.diff(np.asarray(plan.batch.doc_starts, dtype=np.float64))
    n = n[n > 0]
    pairs = staircase_pairs(n)
    group = sh.num_heads // sh.num_kv_heads
    t = sum(float((pairs * fpp / k.rate(n, n, ph, group, pairs)).sum())
            for ph, fpp in (("fwd", sh.fwd_flops_per_pair), ("bwd", sh.bwd_flops_per_pair)))
    return t / plan.inter_size


def efficiency(plan, s) -> tuple[float, bool]:
    """(max(ideal, traffic bound) / estimated time, compute-dominated)."""
    ideal = ideal_s(plan)
    return max(ideal, s.traffic_bound_s) / s.estimated_time_s, s.traffic_bound_s <= 0.5 * ideal


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
    plan = plan_of([0, T], P, heads)
    s = plan.stats()
    eff, compute_dominated = efficiency(plan, s)
    floor = EFF_MISSES.get((T, P, heads))
    if compute_dominated:
        assert s.imbalance <= 1.05, s
    assert eff >= (floor if floor is not None else 0.9 if compute_dominated else 0.6), (eff, s)
    if compute_dominated:
        # a balanced ring is near-optimal for one compute-bound document: HSAP should tie the best
        # baseline (within 0.5%); measured misses in BEST_MISSES. Where traffic rules, the
        # baselines can win.
        best = min(baseline_times([0, T], P, heads).values())
        assert s.estimated_time_s <= best * BEST_MISSES.get((T, P, heads), 1.005), (s.estimated_time_s, best)


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


# (workload, T, P, heads) -> HSAP / best baseline reached on the worst batch where it exceeds 1.20:
# sharegpt 256K seed 9 (one 161K-token document): 1.225 against Ulysses (524.2 ms): HSAP 642.2 ms =
# kernel 516.7 + merges/launches 54.0 (19 stages) + kernel slowdown beside transfers ≈ 71.
PACKED_WORST_MISSES = {("sharegpt", 256 * K, 8, "mha"): 1.23}


def check_packed(workload: str, T: int, P: int, heads: str, seeds) -> None:
    """NVLink: median efficiency >= 0.8; every batch within 20% of the best baseline and strictly
    below it on >= 80% of batches (measured at P 8 over 10 seeds: median efficiency 0.81–0.93,
    9 or 10 wins of 10, the worst batch 0.38–1.23× the best baseline). InfiniBand (reported, not a
    target): never worse than owner-computes."""
    seeds = list(seeds)
    batches = pack_batches(workload, T, max(seeds) + 1, 0)
    effs, wins = [], 0
    for seed in seeds:
        cu = batches[seed]
        plan = plan_of(cu, P, heads)
        s = plan.stats()
        # why 1e-12: two float sums of the same kind of terms in another order; a real loss is far larger
        assert s.estimated_time_s <= s.owner_computes_time_s * (1 + 1e-12) or np.isnan(s.owner_computes_time_s)
        effs.append(efficiency(plan, s)[0])
        if link_class_for(P).value == "nvlink":
            best = min(baseline_times(cu, P, heads).values())
            limit = PACKED_WORST_MISSES.get((workload, T, P, heads), 1.20)
            assert s.estimated_time_s <= best * limit, (seed, s.estimated_time_s, best)
            wins += s.estimated_time_s < best
    if link_class_for(P).value == "nvlink":
        assert statistics.median(effs) >= 0.8, effs
        assert wins >= 0.8 * len(seeds), (wins, len(seeds))


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
    # a 161K-token document in a 1M batch: HSAP beats the best baseline (measured 0.982× Ulysses
    # MHA, 0.937× GQA). Efficiency reached (target 0.98), measured 0.841 MHA / 0.933 GQA: MHA
    # 633.7 ms = kernel 543.8 + merges/launches 29.8 + kernel slowdown beside its transfers ≈ 60
    # against an ideal of 532.9 ms; GQA 571.3 = 540.8 + 17.0 + ≈ 13. GQA's floor 0.93 -> 0.925 with
    # the per-rank estimate: the same plan, simulated 573.5 ms, now estimated 573.1 (was 571.3:
    # the merges of received results follow the wait instead of hiding under it).
    cu = pack_batches("sharegpt", 1 * M, 3, 0)[2]
    plan = plan_of(cu, 8, heads)
    s = plan.stats()
    base = baseline_times(cu, 8, heads)
    assert efficiency(plan, s)[0] >= {"mha": 0.84, "gqa": 0.925}[heads]
    assert s.estimated_time_s <= min(base.values()) * 1.0


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

"""Issue 14 items 2–3 on the benchmark batches (``sim/estimate_accuracy.py``): the chosen plan
simulates no slower than owner-computes on the same batch, the kept layout is the faster one in
simulation, and the planner's closed-form estimate is within 10% of the simulated time (median
per table).

Reference: the simulator (``sim/methods.run_method``), which executes the compiled programs event
by event — an independent computation from the planner's estimate (``plan/estimate.py``). The
8-GPU batches (seed 0) run in the default suite; every Table 2, Table 4 and MagiAttention batch
(64 GPUs included) under ``slow``."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.sim.estimate_accuracy import Case, cases, layouts, measure

# why 1e-9: the same plan simulated twice is bit-identical; only a genuinely slower plan fails
SAME = 1e-9

# The estimate is a per-rank longest path (plan/rank_path.py), so it no longer overprices
# owner-computes on balanced layouts through a per-stage max over ranks (7.7-7.9% over on "full SP4
# 32K s0" and "full 32K 2x4 s0" before); its ports carry a round's transfers as they start (the
# port drain), so it no longer overprices transfer-bound backward passes by charging every
# transfer the busier end's whole round bytes from the later post (owner-computes' backward on
# "slimpajama SP8 32K s0" 13.6% and on "slimpajama 32K 1x8 s0" 14.7% over before, ~1% after; the
# fused merge then tipped both to a slower rebalanced plan). A kernel beside a round a rank only
# receives from a higher-numbered sender is slowed like any other (sim/builder.Builder.build; before,
# "ultrachat 32K 1x8 s1" simulated its chosen plan 0.7% slower than owner-computes through that
# artefact alone: 1.775 vs 1.763 ms, 1.795 once fixed). A port shares itself among its transfers,
# so a short one ends before the port drains (rank_path's shared term): once gathered kernel calls
# (plan/calls.py) made owner-computes' stages transfer-bound, the drain alone priced its plan on
# "slimpajama SP8 32K s0" 5.4% over the simulator and the planner kept a region-distflash plan
# simulating 2.4% slower (6.304 vs 6.156 ms; "slimpajama 32K 1x8 s0" 0.5%), 1.0% over with it.
# No known losses are left; KNOWN pins one with its measured cause and a bound, so a regression
# still fails.
KNOWN: dict[str, float] = {}


def _quick() -> list[Case]:
    """Table 2 at SP ≤ 8 (seed 0 and the full document), Table 4 at 16K on all four topologies,
    MagiAttention at 8 GPUs on all four topologies: 24 batches."""
    t2 = [c for c in cases("table2", 1, 8)]
    t4 = [c for c in cases("table4", 1, 8) if " 16K " in c.label and c.label.split()[0] in ("fineweb", "full")]
    mg = cases("magi", 1, 8)
    return t2 + t4 + mg


def _check(sel: list[Case]) -> None:
    got = [measure(c) for c in sel]
    slower = [f"{m.case.label}: {m.placement} ({m.layout}) {m.simulated_s * 1e3:.3f} ms vs owner-computes {m.owner_s * 1e3:.3f} ms"
              for m in got if m.simulated_s > m.owner_s * KNOWN.get(m.case.label, 1 + SAME)]
    assert not slower, "chosen plan simulates slower than owner-computes:\n" + "\n".join(slower)
    for table in dict.fromkeys(m.case.table for m in got):
        ratios = np.array([m.ratio for m in got if m.case.table == table])
        # the target: the estimate within 10% of the simulated time, median per table
        assert abs(np.median(ratios) - 1) <= 0.10, f"{table}: estimate/simulated median {np.median(ratios):.3f} (all: {np.round(ratios, 3)})"
        assert ratios.min() > 0.5 and ratios.max() < 2.0, f"{table}: an estimate off by 2× ({np.round(ratios, 3)})"


def test_never_slower_than_owner_computes_8_gpus() -> None:
    _check(_quick())


def test_kept_layout_is_faster_in_simulation_8_gpus() -> None:
    wrong = []
    for c in cases("table2", 1, 8)[:6] + cases("magi", 1, 8)[:2]:
        kept, con, bal = layouts(c)
        mine, other = (con, bal) if kept == "contiguous" else (bal, con)
        if mine > other * (1 + SAME):
            wrong.append(f"{c.label}: kept {kept} {mine * 1e3:.3f} ms, the other {other * 1e3:.3f} ms")
    assert not wrong, "kept the layout that simulates slower:\n" + "\n".join(wrong)


# Kept the layout that simulates slower, on every Table 2 / Table 4 / MagiAttention batch
# (``python -m megatron_hsap.sim.estimate_accuracy --layouts``): 12 of 167 on 2026-12-03 (by
# 0.1-1.9%, P_intra 2-4), none since the intra all-to-all's pipeline replays the runtime's issue
# order with its SM contention, each head chunk's SAP is priced at its shape, the layouts are
# compared on whole layers and a work-moving plan must beat the other layout's owner-computes by
# 0.1% (plan._LAYOUT_OWNER_MARGIN). A known loss would be pinned here with its cause and a bound.
KNOWN_LAYOUT: dict[str, float] = {}


@pytest.mark.slow
def test_kept_layout_is_faster_in_simulation_every_benchmark_batch() -> None:
    wrong = []
    for c in cases("table2", 3) + cases("table4", 3) + cases("magi", 2):
        kept, con, bal = layouts(c)
        mine, other = (con, bal) if kept == "contiguous" else (bal, con)
        if mine > other * KNOWN_LAYOUT.get(c.label, 1 + SAME):
            wrong.append(f"{c.label}: kept {kept} {mine * 1e3:.3f} ms, the other {other * 1e3:.3f} ms")
    assert not wrong, "kept the layout that simulates slower:\n" + "\n".join(wrong)


@pytest.mark.slow
def test_never_slower_than_owner_computes_every_benchmark_batch() -> None:
    _check(cases("table2", 3) + cases("table4", 1) + cases("magi", 2))


def test_estimate_prices_staggered_transfers_like_the_simulator() -> None:
    """The estimate's port model (``plan/rank_path.py``) against the simulator's event-by-event
    max-min fair network (``sim/engine.py``) on three ranks. One round: rank 1 (posts at 1 s)
    receives 1 GB from rank 2 (posts at 1 s) and 1 GB from rank 0 (posts at 2 s), 1 GB/s, 0.25 s
    latency. The first transfer has rank 1's port to itself from 1.25 s to 2.25 s; the second
    then runs alone until 3.25 s. Pricing every transfer the busier end's whole round bytes from
    the later post (the estimate before) charged rank 1 2.25 + 2 = 4.25 s: 31% over."""
    from megatron_hsap.plan.hardware import LinkClass
    from megatron_hsap.plan.rank_path import flows_of, path_finish
    from megatron_hsap.sim.engine import Busy, PostTag, TaggedTransfer, WaitTag, Workload, simulate

    gb, lat = 1e9, 0.25
    post_at = [2.0, 1.0, 1.0]
    work = Workload([[Busy(t), PostTag(0), WaitTag(0)] for t in post_at],
                    [TaggedTransfer(0, 1, gb, 0), TaggedTransfer(2, 1, gb, 0)])
    sim = simulate(work, link=lambda a, b: LinkClass.NVLINK, bandwidth=lambda c: gb, latency=lambda c: lat).finish
    # the estimate: stage 0 computes until the post, round 1 carries the transfers (nothing computes beside it)
    comp = np.array([[t, 0.0] for t in post_at])
    flows = flows_of(np.array([1, 1]), np.array([0, 2]), np.array([1, 1]), np.array([0, 0]), np.array([gb, gb]), 3)
    est = path_finish(comp, None, *flows, (gb, gb), lat)
    # why 1e-6: the simulator ends a transfer within 1e-6 bytes (engine.pop_done), i.e. 1e-15 s here
    assert sim.tolist() == pytest.approx([3.25, 3.25, 2.25], abs=1e-6)
    assert est[:2].tolist() == pytest.approx(sim[:2].tolist(), abs=1e-6)  # the receiving port and the later sender: exact
    # rank 2's transfer is done at 2.25 s, but the estimate waits for rank 1's port to drain (an
    # upper bound, docs/design.md §4)
    assert est[2] == pytest.approx(3.25, abs=1e-6) and est[2] >= sim[2]


def test_cases_cover_the_tables() -> None:
    from megatron_hsap.sim import paper

    t2 = cases("table2", 1)
    assert {(c.inter, c.cu[-1]) for c in t2} == {(sp, T) for sp, T in paper.TABLE2}
    t4 = cases("table4", 1)
    assert {(c.intra, c.inter) for c in t4} == {(1, 8), (2, 4), (4, 2), (8, 1)} and len(t4) == 4 * 3 * 4
    assert {c.intra * c.inter for c in cases("magi", 1)} == {8, 64}

"""plan/estimate.py: ``phase_time`` on a hand-made 2-rank plan equals the by-hand sum of
per-stage max(compute, transfer) plus one latency per non-empty round; ``quick_price`` equals
``phase_time`` over the messages codegen actually emitted; on random packings the lower bounds
(compute, traffic) never exceed the chosen plan's estimate (docs/design.md §2.1 step 6, §4).

Reference: the hand computation below, and the plan's own generated messages."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.bounds import compute_bound, lower_bounds, necessary_traffic
from megatron_hsap.plan.codegen import Message
from megatron_hsap.plan.estimate import phase_time, quick_price
from megatron_hsap.plan.ir import TokenRange, Unit, Wire
from megatron_hsap.plan.placement import CostRates


def test_phase_time_by_hand_two_ranks() -> None:
    r = TokenRange
    units = [
        Unit(0, r(0, 4), r(0, 4), True, 0, 0, 0, stage=0),   # 10 pairs, local on rank 0
        Unit(0, r(4, 8), r(4, 8), True, 1, 1, 1, stage=0),   # 10 pairs, local on rank 1
        Unit(0, r(4, 8), r(0, 4), False, 1, 0, 1, stage=1),  # 16 pairs on rank 1, kv from rank 0
    ]
    msgs = [Message(round=0, src=0, dst=1, wire=Wire.KV, tokens=r(0, 4), nbytes=400)]
    t = phase_time(units, msgs, 2, sec_per_pair=1e-3, bw=1000.0, latency=0.05)
    # stage 0: max(10 ms compute, 400 B / 1000 B/s) = 0.4 s; stage 1: 16 ms; stage 2: nothing; one round: 0.05 s
    assert t.total == pytest.approx(0.4 + 0.016 + 0.05, rel=1e-12)  # why: float sums of the same three terms
    assert t.latency == pytest.approx(0.05, rel=1e-12)  # why: one latency, one multiplication
    assert t.work.tolist() == [10, 26]
    assert t.sent.tolist() == [400, 0] and t.recv.tolist() == [0, 400]
    assert t.compute == pytest.approx([0.010, 0.016, 0.0], abs=1e-15)  # why: integer pairs × 1e-3 in floats
    assert t.transfer == pytest.approx([0.4, 0.0, 0.0], abs=1e-15)  # why: one float division


def test_compute_bound_and_lower_bounds_by_hand() -> None:
    assert compute_bound(1000, 4, 1e-3, 2e-3) == pytest.approx(0.75, rel=1e-12)  # why: one float product
    plan = compile_plan([0, 256], 4, num_heads=4, num_kv_heads=2, head_dim=16, layout="contiguous")
    total = 256 * 257 // 2
    nec_f, nec_b, nec_x = necessary_traffic(list(plan.work_units), plan.shape)
    b = plan.shape.token_bytes
    # contiguous: rank i's q rows see rank j's kv (j < i): the cheaper side of each cross block moves
    cross = [(64, 64)] * 6
    assert nec_f == sum(min(nk * b(Wire.KV), nq * (b(Wire.Q) + b(Wire.O) + b(Wire.LSE))) for nq, nk in cross)
    lb = lower_bounds(total, nec_f, nec_b, 4, plan.shape, plan.hardware, plan.link)
    assert lb["bound_s"] == max(lb["compute_s"], lb["traffic_s"])
    assert lb["traffic_s"] == pytest.approx((nec_f + nec_b) / (4 * plan.hardware.bandwidth(plan.link)), rel=1e-12)  # why: one division


def test_traffic_bound_counts_node_local_pairs_at_nvlink_rate() -> None:
    # 16 inter ranks, 8 GPUs per node: ranks 0-7 on node 0, 8-15 on node 1. The estimate moves
    # node-local pairs over NVLink beside the NIC, so only cross-node bytes are bound by the NIC
    # (found by hypothesis: an estimate 4.82 ms "below" an all-over-InfiniBand bound of 4.94 ms)
    cu = [0, 2267, 4019, 7813, 10034, 11204, 14075, 16384]
    plan = compile_plan(cu, 16, num_heads=32, num_kv_heads=32, head_dim=128, layout="balanced", layout_fallback=False)
    node = tuple(i // 8 for i in range(16))
    nec_f, nec_b, cross = necessary_traffic(list(plan.work_units), plan.shape, node)
    assert necessary_traffic(list(plan.work_units), plan.shape)[2] == nec_f + nec_b  # no nodes: every byte
    by_hand = sum(f + g for u, f, g in _necessary_per_unit(plan) if node[u.q_owner] != node[u.kv_owner])
    assert cross == by_hand and 0 < cross < nec_f + nec_b
    hw = plan.hardware
    lb = lower_bounds(plan.batch.total_work(), nec_f, nec_b, 16, plan.shape, hw, plan.link, cross)
    assert lb["traffic_s"] == max(cross / (16 * hw.ib_bw), (nec_f + nec_b) / (16 * (hw.ib_bw + hw.nvlink_bw)))
    stats = plan.stats()
    assert stats.traffic_bound_s == lb["traffic_s"] and stats.necessary_bytes == nec_f + nec_b
    assert stats.lower_bound_s <= stats.estimated_time_s
    # the all-over-the-NIC figure would claim more than the plan's own estimate: no bound
    assert (nec_f + nec_b) / (16 * hw.ib_bw) > stats.estimated_time_s


def _necessary_per_unit(plan):
    """(unit, forward bytes, backward bytes) of every cross-rank unit, from the wire sizes."""
    b = plan.shape.token_bytes
    out = []
    for u in plan.work_units:
        if u.q_owner != u.kv_owner:
            nq, nk = len(u.q), len(u.kv)
            out.append((u, min(nk * b(Wire.KV), nq * (b(Wire.Q) + b(Wire.O) + b(Wire.LSE))),
                        min(nk * (b(Wire.KV) + b(Wire.DKV)),
                            nq * (b(Wire.Q) + b(Wire.DO) + b(Wire.LSE) + b(Wire.DELTA) + b(Wire.DQ)))))
    return out


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4),
       st.sampled_from(["contiguous", "balanced"]), st.sampled_from([4096, None]),
       st.sampled_from([{}, {"link": "ib", "hardware": "h100"}]))  # NVLink; InfiniBand with NCCL's per-flow cap (28 of 48 GB/s)
def test_bounds_below_estimate_and_quick_price_equals_phase_time(lengths, inter, layout, pool, net) -> None:
    cu = list(np.concatenate([[0], np.cumsum(lengths)]).astype(int))
    plan = compile_plan(cu, inter, num_heads=4, num_kv_heads=2, head_dim=16, layout=layout, pool_bytes=pool, **net)
    c = plan.chosen
    # the layout's segments, as the planner prices with them: local items fuse into one varlen call
    # where their local rows run on (plan/calls.py)
    segments = tuple(tuple((s.tokens.start, s.local_start) for s in segs) for segs in plan.layout.segments)
    rates = CostRates.of(plan.shape, plan.hardware, plan.hardware.bandwidth(plan.link), segments=segments,
                         flow_bw=plan.hardware.flow_bandwidth(plan.link, inter))
    assert (rates.flow_bw < rates.bw) == bool(net)
    latency = plan.hardware.latency(plan.link)
    f = phase_time(list(c.units), plan.raw_messages("fwd"), inter, rates.sec_fwd, rates.bw, latency, rates=rates, phase="fwd")
    b = phase_time(list(c.units), plan.raw_messages("bwd"), inter, rates.sec_bwd, rates.bw, latency, rates=rates, phase="bwd")
    assert (f.total, b.total) == (c.fwd_time.total, c.bwd_time.total)  # the plan's stored estimate is this
    qf, qb = quick_price(list(c.units), inter, rates, latency)
    assert qf == pytest.approx(f.total, rel=1e-9) and qb == pytest.approx(b.total, rel=1e-9)  # why: same terms summed in another order
    total = plan.batch.total_work()
    nec_f, nec_b, nec_x = necessary_traffic(list(plan.work_units), plan.shape)
    lb = lower_bounds(total, nec_f, nec_b, inter, plan.shape, plan.hardware, plan.link)
    assert lb["compute_s"] <= c.time * (1 + 1e-9)  # why: float sums; a real violation is whole pairs
    assert lb["traffic_s"] <= c.time * (1 + 1e-9)  # why: as above


def test_block_costs_by_hand() -> None:
    # two local blocks on rank 0 writing the same 4 q rows: the second merges 4 rows; one remote
    # block on rank 1 (q from rank 0): its 4 rows are merged on rank 0 one stage later. Each
    # (rank, stage, sources, causality) group is one launch.
    from megatron_hsap.plan.estimate import _arrays, block_costs
    from megatron_hsap.plan.hardware import HARDWARE

    r = TokenRange
    units = [
        Unit(0, r(4, 8), r(4, 8), True, 0, 0, 0, stage=0),
        Unit(0, r(4, 8), r(0, 4), False, 0, 0, 0, stage=0),
        Unit(0, r(4, 8), r(8, 12), False, 0, 1, 1, stage=0),
    ]
    hw = HARDWARE["a100"]
    from megatron_hsap.plan.costs import HeadShape

    rates = CostRates.of(HeadShape(num_heads=4, num_kv_heads=4, head_dim=16, head_dim_v=16), hw, hw.nvlink_bw)
    bc = block_costs(_arrays(units), 2, 2, rates, "fwd")
    k = hw.kernel
    want = [10 * rates.fpp_fwd / float(k.rate(4, 4, "fwd", 1, 10)), 16 * rates.fpp_fwd / float(k.rate(4, 4, "fwd", 1, 16))]
    assert bc.kernel[0, 0] == pytest.approx(sum(want), rel=1e-12)  # why: the same float terms, summed in another order
    assert bc.launch.tolist() == [2 * k.launch_s, k.launch_s]  # causal and rectangle calls on rank 0, one on rank 1
    assert bc.fixed[0, 0] == pytest.approx(2 * k.launch_s + 4 * rates.merge_o, rel=1e-12)  # why: as above
    assert bc.fixed[0, 1] == 0.0 and bc.after[0, 1] == pytest.approx(4 * rates.merge_o, rel=1e-12)  # the remote result merged after the next wait


def test_gathered_call_by_hand() -> None:
    # rank 0 holds q rows [20, 24): a causal local block at stage 0, then two rectangles at stage 1
    # with kv from ranks 1 and 2 — one gathered call (plan/calls.py): one block (4, 8) of 32
    # pairs, one launch, its 4 q rows merged once, plus the copy of 8 kv rows (read and write);
    # backward: one grid of ⌈8/128⌉ tiles and one GQA dK/dV accumulation over 8 kv rows. A third
    # rectangle of another q range stays a call of its own.
    from megatron_hsap.plan.costs import HeadShape
    from megatron_hsap.plan.estimate import _arrays, block_costs
    from megatron_hsap.plan.hardware import HARDWARE

    r = TokenRange
    units = [
        Unit(0, r(20, 24), r(20, 24), True, 0, 0, 0, stage=0),
        Unit(0, r(20, 24), r(0, 4), False, 0, 1, 0, stage=1),
        Unit(0, r(20, 24), r(8, 12), False, 0, 2, 0, stage=1),
        Unit(0, r(16, 18), r(0, 4), False, 0, 1, 0, stage=1),
    ]
    hw = HARDWARE["h100"]
    shape = HeadShape(num_heads=8, num_kv_heads=2, head_dim=16, head_dim_v=16)
    rates = CostRates.of(shape, hw, hw.nvlink_bw)
    k = hw.kernel
    fwd, bwd = (block_costs(_arrays(units), 3, 2, rates, ph) for ph in ("fwd", "bwd"))
    gather = 2 * 8 * shape.token_bytes(Wire.KV) / hw.hbm_bw
    for bc, ph, fpp in ((fwd, "fwd", rates.fpp_fwd), (bwd, "bwd", rates.fpp_bwd)):
        want = 32 * fpp / float(k.rate(4, 8, ph, 4, 32)) + 8 * fpp / float(k.rate(2, 4, ph, 4, 8))
        assert bc.kernel[0, 1] == pytest.approx(want, rel=1e-12)  # why: the same terms, summed in another order
        assert bc.launch.tolist() == [3 * k.launch_s, 0.0, 0.0]  # stage 0; stage 1: gathered + the other
    merge = 4 * rates.merge_o
    assert fwd.fixed[0, 1] == pytest.approx(2 * k.launch_s + merge + gather, rel=1e-12)
    grid = k.cta_s * 1 * 8 * 2  # two calls of ⌈kv/128⌉ = 1 tile × 8 heads
    acc = 2 * 128 * 8 * rates.accum_row / hw.hbm_bw if k.gqa_dkv_accum else 0.0  # ⌈8/128⌉ + ⌈4/128⌉ tiles
    assert bwd.fixed[0, 1] == pytest.approx(2 * k.launch_s + 4 * rates.merge_dq + gather + grid + acc, rel=1e-12)
    assert bwd.after[1, 1] == pytest.approx((4 + 4) * rates.merge_dkv, rel=1e-12)  # each part's dk/dv back to its owner


def test_quick_price_under_flat_rates_equals_phase_time() -> None:
    # without a kernel model (rates.kernel None) compute is pairs × seconds per pair per [rank,
    # stage]: quick_price's grid (one bincount of the blocks' pairs) prices what phase_time prices
    # over codegen's messages
    plan = compile_plan([0, 3000, 4096], 4, num_heads=4, num_kv_heads=2, head_dim=16, layout="contiguous")
    c = plan.chosen
    rates = replace(CostRates.of(plan.shape, plan.hardware, plan.hardware.bandwidth(plan.link)), kernel=None)
    latency = plan.hardware.latency(plan.link)
    units = list(c.units)
    assert len({u.stage for u in units}) >= 2 and not all(u.is_local for u in units)  # staged, with traffic
    f = phase_time(units, plan.raw_messages("fwd"), 4, rates.sec_fwd, rates.bw, latency, rates=rates, phase="fwd")
    b = phase_time(units, plan.raw_messages("bwd"), 4, rates.sec_bwd, rates.bw, latency, rates=rates, phase="bwd")
    qf, qb = quick_price(units, 4, rates, latency)
    assert qf == pytest.approx(f.total, rel=1e-12) and qb == pytest.approx(b.total, rel=1e-12)  # why: the same terms, one summation order apart
    assert qf > latency and qb > qf  # why: compute is priced (backward 2.5x forward's pairs)

"""Flat prices of the hierarchical and per-sample baselines: hand-computed cases, and the flat
price against the simulated schedule of the same method on small cases (the simulator given the
flat model's constants: flat kernel rate, free memory traffic, no calibrated terms)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.baselines.flat import _causal_pairs
from megatron_hsap.baselines.hierarchical import HIERARCHICAL, hybrid_stages, price, window_size
from megatron_hsap.baselines.registry import REGISTRY, unavailable
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, KernelCurve, KernelModel, LinkClass
from megatron_hsap.plan.workloads import pack_batches
from tests.baselines.test_flat import TOY

NV, IB = LinkClass.NVLINK, LinkClass.INFINIBAND
TWO = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
GQA = HeadShape(num_heads=16, num_kv_heads=8, head_dim=128, head_dim_v=128, dtype_bytes=2)
TIGHT = dict(rel=1e-9)


def test_te_a2a_by_hand() -> None:
    # one document of 8 on 2 ranks: padded to 2P = 4 (no padding), 4 tokens per rank. Each of the
    # four all-to-alls moves 4 tokens × 1 head × 1 byte to the one peer at 1 B/s + 0.5 s = 4.5 s;
    # each rank computes all 36 pairs of its one head: 18 full-head pairs of 2 s each (2 heads).
    c = price("te_a2a", [0, 8], intra=1, inter=2, shape=TWO, hardware=TOY, link=NV)
    assert c is not None
    assert c.fwd_time == pytest.approx(4 * 4.5 + 18 * 2, **TIGHT)
    assert c.bwd_time == pytest.approx(4 * 4.5 + 18 * 2, **TIGHT)
    assert list(c.work) == [18.0, 18.0]
    # a document of 6 is padded to 8: the padding travels (the same bytes), the kernel skips it
    p = price("te_a2a", [0, 6], intra=1, inter=2, shape=TWO, hardware=TOY, link=NV)
    assert p.bytes_sent[0] == c.bytes_sent[0] and p.work[0] == pytest.approx(21 / 2, **TIGHT)


def test_usp_ring_by_hand() -> None:
    # USP at 1x2 on one head: documents padded to 4, chunks c = 2 per rank half. Step 0: causal
    # 2c×2c = 2c² + c = 10 pairs, step 1: 2c² = 8 pairs; forward: step 0 overlaps the KV round
    # (4 tokens × 2 bytes at 1 B/s = 8 s) + 0.5 s latency, step 1 computes alone.
    one = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
    c = price("usp", [0, 8], intra=1, inter=2, shape=one, hardware=TOY, link=NV)
    assert c.fwd_time == pytest.approx(max(10, 8) + 0.5 + 8, **TIGHT)
    # backward: round 0 the KV (8 s) under step 0, round 1 the dKV of step 0 under step 1, then
    # the last step's dKV alone (8 s + 0.5 s)
    assert c.bwd_time == pytest.approx((max(10, 8) + 0.5) + (max(8, 8) + 0.5) + 8.5, **TIGHT)
    assert c.work.sum() == pytest.approx(_causal_pairs(np.array([8])), **TIGHT)


def test_hybrid_cp_stages_run_one_after_another() -> None:
    # Megatron hybrid CP, 2 ranks, 8K tokens per rank: a 16K sample spans both ranks (a ring),
    # then two 8K samples share the next stage (one per rank)
    cu = np.cumsum([0, 16384, 8192, 8192])
    stages = hybrid_stages(np.diff(cu), 2)
    assert stages == [[(16384, 0, 2)], [(8192, 0, 1), (8192, 1, 1)]]
    c = price("hybrid_cp", cu, intra=1, inter=2, shape=TWO, hardware=TOY, link=NV)
    assert c.work.sum() == pytest.approx(_causal_pairs(np.diff(cu)), **TIGHT)  # every real pair once
    single = 2 * _causal_pairs(np.array([8192]))  # full-head pairs at 2 s each (2 heads)
    ring = price("te_a2a_p2p", [0, 16384], intra=1, inter=2, shape=TWO, hardware=TOY, link=NV)  # the bare zigzag ring
    # stage 1 = the 16K ring; stage 2 = one 8K call per rank; a barrier (0.5 s) after each
    assert c.fwd_time == pytest.approx(ring.fwd_time + 0.5 + single + 0.5, rel=1e-6)


def test_loongtrain_window_is_the_ring_ranks_of_a_node() -> None:
    assert window_size(8, 1, 8) == 8 and window_size(8, 2, 8) == 4 and window_size(8, 8, 8) == 1
    assert window_size(6, 2, 8) == 3  # 4 per node would not divide the ring of 6


def test_every_registry_flat_key_is_priced_and_unavailability_is_the_registry_rule() -> None:
    cu = pack_batches("fineweb", 16384, 1, 0)[0]
    for b in REGISTRY.values():
        if b.flat is None:
            continue
        intra, inter = (2, 4) if b.hierarchical else (1, 8)
        c = price(b.flat, cu, intra=intra, inter=inter, shape=GQA, hardware=TOY, link=NV)
        assert (c is None) == (unavailable(b.name, intra=intra, inter=inter, shape=GQA) is not None), b.name
        if c is not None:
            assert c.fwd_time > 0 and c.bwd_time > c.fwd_time * 0.5 and len(c.work) == 8, b.name
    # TE a2a needs P | Hkv: 16 ranks do not divide 8 kv heads
    assert price("te_a2a", cu, intra=1, inter=16, shape=GQA, hardware=TOY, link=NV) is None
    with pytest.raises(ConfigError, match="intra"):
        price("usp", cu, intra=0, inter=2, shape=GQA, hardware=TOY, link=NV)


# ---------------------------------------------------------------- flat price vs simulated schedule
# The flat model's constants on the pricing side too: every block at its peak rate (a zero
# half-rate size, no launch), no merge bytes, no kernel slowdown beside transfers.
FLAT = Hardware(name="flatx", attn_fwd_flops=200e12, attn_bwd_flops=170e12, nvlink_bw=200e9, ib_bw=20e9,
                nvlink_latency=10e-6, ib_latency=15e-6, gpus_per_node=8,
                kernel=KernelModel(fwd_peak=200e12, bwd_peak=170e12, curve=KernelCurve(half_rate_tokens=0.0, launch_s=0.0)),
                merge_fwd_bytes=0.0, merge_bwd_bytes=0.0, overlap_slowdown=0.0, a2a_efficiency=1.0, hbm_bw=1e30)  # as _sim_flat_hw
CASES = [([0, 4096], 2, 2), ("fineweb", 32768, 2, 4), ("slimpajama", 65536, 4, 4), ("fineweb", 65536, 8, 2), ([0, 65536], 2, 8)]
# The flat model prices a step as the slowest rank's max(compute, transfer) + one latency; the
# simulator runs the same rounds event by event (a round starts when both peers posted, ranks
# drift by a latency). On these cases that is at most 6.4% apart; 10% leaves room, not slack.
FLAT_VS_SIM = 0.10


def _sim_flat_hw():
    from megatron_hsap.sim.config import KernelModel, SimHardware

    return SimHardware(name="flatx", kernel=KernelModel(fwd_peak=200e12, bwd_peak=170e12,
                                                        curve=KernelCurve(half_rate_tokens=1e-12, launch_s=0.0)),
                       nvlink_bw=200e9, ib_bw=20e9, nvlink_latency=10e-6, ib_latency=15e-6, hbm_bw=1e30, dense_peak_flops=1.0)


@pytest.mark.parametrize("method", HIERARCHICAL)
def test_flat_price_matches_the_simulated_schedule(method: str) -> None:
    from megatron_hsap.sim.methods import run_method

    sim = _sim_flat_hw()
    for case in CASES:
        if isinstance(case[0], list):
            cu, intra, inter = np.asarray(case[0]), case[1], case[2]
        else:
            cu, intra, inter = pack_batches(case[0], case[1], 1, 0)[0], case[2], case[3]
        i, j = (1, intra * inter) if method in ("te_a2a", "hybrid_cp") else (intra, inter)
        link = IB if intra * inter > 8 else NV
        f = price(method, cu, intra=i, inter=j, shape=GQA, hardware=FLAT, link=link)
        r = run_method(method, cu, hw=sim, intra=i, inter=j, shape=GQA)
        assert (f is None) == (r is None), (method, case)
        if f is None:
            continue
        assert f.fwd_time == pytest.approx(r.fwd.seconds, rel=FLAT_VS_SIM), (method, case, "fwd")
        assert f.bwd_time == pytest.approx(r.bwd.seconds, rel=FLAT_VS_SIM), (method, case, "bwd")


# ---------------------------------------------------------------- the kernel model's terms
# KERNEL_TOY (tests/baselines/test_flat.py): 4 × 4 tiles with half a tile of prologue per row
# tile, so a block costs m · (key tiles per row + 0.5) · 16 pair-seconds (1 pair/s peaks),
# m = ⌈rows / 4⌉, key tiles per row = pairs / rows / 4 + 0.5 clipped to [1, ⌈keys / 4⌉]; 1 s per
# launch; merges 1 s per o / dq row and 2 s per dk+dv row (ONE: 1 head of size 1); kernels 1.5×
# slower while the round moves bytes; NVLink 1 B/s and 0.5 s per round.


def test_te_a2a_kernel_terms_by_hand(unit_merge_bytes) -> None:
    from tests.baselines.test_flat import KERNEL_TOY

    c = price("te_a2a", [0, 16], intra=1, inter=2, shape=TWO, hardware=KERNEL_TOY, link=NV)
    # four all-to-alls of 8 tokens × 1 head × 1 B to the one peer at the all-to-all rate (NVLink 1 B/s
    # × a2a_efficiency 0.45) plus 0.5 s latency each; two flash_attn_a2a_communicate calls per phase,
    # each a software pipeline of reorder copies (one read + write of the 16-B local tensor at 1 B/s
    # HBM: 32 s) around the transfers: q, k, v = first copy + max(core, next copy) + max(core, both
    # neighbours' copies) + max(core, previous copy) + last copy; out = copy + core + copy. Then ONE
    # call per phase on 1 of the 2 heads: the 16 × 16 causal block, 136 pairs: m 4, key tiles
    # 136/16/4 + 0.5 = 2.625 -> 4 · 3.125 · 16 = 200 s, plus one launch; no merge.
    core, cp = 8 / 0.45 + 0.5, 32.0
    comm = (2 * cp + max(core, cp) + max(core, 2 * cp) + max(core, cp)) + (2 * cp + core)
    assert c.fwd_time == pytest.approx(comm + 200 + 1, **TIGHT)
    assert c.bwd_time == pytest.approx(comm + 200 + 1, **TIGHT)


def test_usp_ring_kernel_terms_by_hand(unit_merge_bytes) -> None:
    from tests.baselines.test_flat import KERNEL_TOY

    one = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
    c = price("usp", [0, 8], intra=1, inter=2, shape=one, hardware=KERNEL_TOY, link=NV)
    # c = 2: rank 0 holds chunks {0, 3}, rank 1 {1, 2}; KV round 4 tokens × 2 B = 8 s. Every call
    # is one row tile of 4 × 4 keys at most: 1 · (1 + 0.5) · 16 = 24 s (diagonal 10 pairs, upper
    # 2 × 4 and lower 4 × 2 blocks 8 pairs). Forward: step 0 beside the KV round (24 · 1.5 + 1
    # launch); step 1 alone, plus FA3RingAttnFunc's output corrections of both steps after the
    # loop (rank 0: 4 + 2 q rows, rank 1: 4 + 4, 1 s each).
    assert c.fwd_time == pytest.approx(max(24 * 1.5 + 1, 8) + 0.5 + max(24 + 1 + 6, 24 + 1 + 8), **TIGHT)
    # backward: step 0 (upper / lower) beside the KV round; step 1 the diagonal beside the dKV
    # round, plus the dq (4 rows · 1 s) and dk, dv (4 rows · 2 s) accumulations; then the last
    # step's dKV alone (8 s + 0.5 s)
    assert c.bwd_time == pytest.approx((24 * 1.5 + 1 + 0.5) + (24 * 1.5 + 1 + 4 + 8 + 0.5) + 8.5, **TIGHT)
    assert c.work.tolist() == [18.0, 18.0]  # 10 + 8 pairs each: 36 = 8 · 9 / 2 in all


def test_hybrid_cp_one_call_per_sample_by_hand(unit_merge_bytes) -> None:
    from tests.baselines.test_flat import KERNEL_TOY

    one = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
    c = price("hybrid_cp", [0, 24, 40], intra=1, inter=2, shape=one, hardware=KERNEL_TOY, link=NV)
    # both samples need one rank and fit rank 0's 8K tokens: one stage, two flash_attn_func calls
    # on rank 0 (hybrid_dcp.py calls the kernel per sample, not one varlen call): 24 × 24, 300
    # pairs: m 6, key tiles 300/24/4 + 0.5 = 3.625 -> 6 · 4.125 · 16 = 396 s; 16 × 16: 200 s;
    # a launch each, then the barrier (0.5 s).
    assert hybrid_stages(np.array([24, 16]), 2) == [[(24, 0, 1), (16, 0, 1)]]
    assert c.fwd_time == pytest.approx(396 + 1 + 200 + 1 + 0.5, **TIGHT)
    assert c.bwd_time == pytest.approx(396 + 1 + 200 + 1 + 0.5, **TIGHT)


def _perfect(hw: Hardware) -> Hardware:
    """``hw`` with perfect kernels: every block at the kernel model's peak, no launch, grid,
    atomics, merge bytes or slowdown beside transfers."""
    from dataclasses import replace

    k = hw.kernel
    return replace(hw, kernel=KernelModel(fwd_peak=k.fwd_peak, bwd_peak=k.bwd_peak, curve=KernelCurve(half_rate_tokens=0.0, launch_s=0.0)),
                   merge_fwd_bytes=0.0, merge_bwd_bytes=0.0, overlap_slowdown=0.0, a2a_efficiency=1.0, hbm_bw=1e30)  # as _sim_flat_hw


@pytest.mark.parametrize("hw_name", ["a100", "h100-fa3"])
def test_kernel_model_price_is_never_below_perfect_kernels(hw_name: str) -> None:
    """Every hierarchical / per-sample peer priced with the kernel model costs at least what the
    same schedule costs with perfect kernels at the model's peak, moves the same bytes and
    computes the same pairs; with perfect kernels TE's a2a is the flat formula (pairs × FLOPs
    per pair / peak + its all-to-alls) exactly."""
    from megatron_hsap.plan.hardware import HARDWARE

    hw = HARDWARE[hw_name]
    ideal = _perfect(hw)
    for cu in (pack_batches("fineweb", 65536, 1, 0)[0], np.array([0, 65536]), pack_batches("slimpajama", 32768, 1, 1)[0]):
        for shape in (GQA, HeadShape(num_heads=32, num_kv_heads=32, head_dim=128, head_dim_v=128)):
            for method in HIERARCHICAL:
                for intra, inter in ((1, 8), (2, 4), (8, 2)):
                    link = IB if intra == 8 else NV
                    got = price(method, cu, intra=intra, inter=inter, shape=shape, hardware=hw, link=link)
                    low = price(method, cu, intra=intra, inter=inter, shape=shape, hardware=ideal, link=link)
                    if got is None:
                        assert low is None
                        continue
                    key = (method, intra, inter, shape.num_kv_heads)
                    assert got.fwd_time >= low.fwd_time and got.bwd_time >= low.bwd_time, key
                    assert got.time > low.time * 1.001, key  # launches, tiles and merges cost something
                    np.testing.assert_array_equal(got.bytes_sent, low.bytes_sent)
                    np.testing.assert_array_equal(got.work, low.work)
                    if method != "te_a2a_p2p":  # which computes TE's padding too
                        assert got.work.sum() == pytest.approx(_causal_pairs(np.diff(cu)), rel=1e-9), key
            P = 8
            te = price("te_a2a", cu, intra=1, inter=P, shape=shape, hardware=ideal, link=NV)
            if te is not None:
                comm = te.fwd_time - _causal_pairs(np.diff(cu)) / P * shape.fwd_flops_per_pair / hw.kernel.fwd_peak
                comm_b = te.bwd_time - _causal_pairs(np.diff(cu)) / P * shape.bwd_flops_per_pair / hw.kernel.bwd_peak
                assert comm == pytest.approx(comm_b, rel=1e-9) and comm > 0  # the same four all-to-alls each way


def test_loongtrain_with_one_window_is_the_fa3_ring(unit_merge_bytes) -> None:
    """A double ring whose window holds the whole ring (8 ranks in one node: one window, no outer
    transfer) runs USP's FA3 ring step for step: the same calls, merges and overlapped rounds, so
    the same forward time and pairs (its backward rounds differ: KV + dKV in every inner round, no
    exposed tail). Both priced with the kernel model (KERNEL_TOY's launches, tiles, merges and
    slowdown), so a difference in how either composes the calls shows."""
    from tests.baselines.test_flat import KERNEL_TOY

    one = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
    cu = np.cumsum([0, 37, 90, 5, 124])
    assert window_size(8, 1, 8) == 8
    ring = price("usp", cu, intra=1, inter=8, shape=one, hardware=KERNEL_TOY, link=NV)
    double = price("loongtrain", cu, intra=1, inter=8, shape=one, hardware=KERNEL_TOY, link=NV)
    assert double.fwd_time == pytest.approx(ring.fwd_time, **TIGHT)
    np.testing.assert_array_equal(double.work, ring.work)


def test_te_a2a_all_to_alls_are_priced_like_ulysses():
    # one all-to-all rule for everyone: TE's head all-to-alls run at Hardware.a2a_bandwidth (NVLink
    # derated by a2a_efficiency, as HSAP's Ulysses and flat.ulysses) plus the last tensor's reorder
    # copy of each flash_attn_a2a_communicate call; halving the efficiency adds exactly the bytes'
    # time once more (by hand: 4 tensors per phase, (u − 1) peers each, on [T/u, H/u, d] shares).
    import dataclasses

    cu, u = [0, 8192], 4
    fast = dataclasses.replace(FLAT, a2a_efficiency=1.0)
    slow = dataclasses.replace(FLAT, a2a_efficiency=0.5)
    f = price("te_a2a", cu, intra=1, inter=u, shape=GQA, hardware=fast, link=NV)
    s = price("te_a2a", cu, intra=1, inter=u, shape=GQA, hardware=slow, link=NV)
    tokens = 8192 / u
    per_peer = tokens / u * 2 * (16 * 128 + 8 * 128 + 8 * 128 + 16 * 128)  # q, k, v, out per peer
    extra = (u - 1) * per_peer / 200e9  # the second half of the rate, once per phase
    assert s.fwd_time - f.fwd_time == pytest.approx(extra, rel=1e-9)
    assert s.bwd_time - f.bwd_time == pytest.approx(extra, rel=1e-9)
    # the reorder copies: what finite HBM adds is what the simulator's TE a2a pipeline adds
    # (sim.methods._te_a2a, executed by the event engine), forward and backward
    from megatron_hsap.sim.config import with_links as replace_hw
    from megatron_hsap.sim.methods import run_method

    copies = dataclasses.replace(fast, hbm_bw=1e12)
    c = price("te_a2a", cu, intra=1, inter=u, shape=GQA, hardware=copies, link=NV)
    sim_fast = replace_hw(_sim_flat_hw(), a2a_efficiency=1.0)
    sim_copies = replace_hw(sim_fast, hbm_bw=1e12)
    r0 = run_method("te_a2a", np.asarray(cu), hw=sim_fast, intra=1, inter=u, shape=GQA)
    r1 = run_method("te_a2a", np.asarray(cu), hw=sim_copies, intra=1, inter=u, shape=GQA)
    assert c.fwd_time - f.fwd_time == pytest.approx(r1.fwd.seconds - r0.fwd.seconds, rel=1e-6)
    assert c.bwd_time - f.bwd_time == pytest.approx(r1.bwd.seconds - r0.bwd.seconds, rel=1e-6)
    assert c.fwd_time > f.fwd_time  # the copies are charged, not hidden entirely


def test_inter_rings_run_at_nccls_channels_per_peer() -> None:
    """USP's ring and LoongTrain's double ring over 64 inter ranks across nodes: one NCCL channel
    per network peer (``plan/hardware.net_channels_per_peer``), so they price as on a NIC of one
    channel's rate, and slower than at the NIC's."""
    from dataclasses import replace

    one = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
    # kernels 10^4 x faster than TOY's: the rounds' transfers set the time
    fast = replace(TOY, attn_fwd_flops=4e4, attn_bwd_flops=1e5, kernel=KernelModel(fwd_peak=4e4, bwd_peak=1e5, curve=TOY.kernel.curve))
    cu = [0, 2 * 64 * 64 * 4]
    for method in ("usp", "loongtrain"):
        got = price(method, cu, intra=2, inter=64, shape=one, hardware=replace(fast, p2p_channel_net_bw=0.1, p2p_channels=16), link=IB)
        nic = price(method, cu, intra=2, inter=64, shape=one, hardware=replace(fast, ib_bw=0.1), link=IB)
        free = price(method, cu, intra=2, inter=64, shape=one, hardware=fast, link=IB)
        assert got is not None and nic is not None and free is not None, method
        assert (got.fwd_time, got.bwd_time) == pytest.approx((nic.fwd_time, nic.bwd_time)), method
        assert got.time > free.time * 1.2, method

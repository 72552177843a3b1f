"""The baselines' schedules on tiny cases: timelines computed by hand, pair counts from dense masks.

Toy constants make times plain counts: 1 head of size 1 (k+v = 2 bytes per token, 1 byte
elements), 4 forward FLOPs per pair at 4 FLOP/s and 10 backward FLOPs per pair at 10 FLOP/s (one
pair per second either way), a flat kernel curve, free merges, NVLink 1 byte/s with 0.5 s per
operation, InfiniBand 0.25 byte/s with 1 s.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import KernelCurve
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import KernelModel, SimHardware
from megatron_hsap.sim.engine import Busy, simulate_on
from megatron_hsap.sim.methods import run_method
from megatron_hsap.sim.schedules import contiguous_ring_steps, zigzag_steps

TOY = SimHardware(
    name="toy",
    kernel=KernelModel(fwd_peak=4.0, bwd_peak=10.0, curve=KernelCurve(half_rate_tokens=1e-12, launch_s=0.0)),
    nvlink_bw=1.0,
    ib_bw=0.25,
    nvlink_latency=0.5,
    ib_latency=1.0,
    hbm_bw=1e30,
    dense_peak_flops=1.0,
)
ONE = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
TWO = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
TIGHT = dict(rel=1e-9)  # sums of a few floats


def doc_mask(lengths: list[int]) -> np.ndarray:
    """Dense [T, T] mask: causal inside each document, nothing across documents."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def flops_per_rank(run, phase: str) -> np.ndarray:
    pr = run.fwd if phase == "fwd" else run.bwd
    out = np.zeros(len(pr.workload.programs))
    for r, prog in enumerate(pr.workload.programs):
        out[r] = sum(i.flops for i in prog if isinstance(i, Busy))
    return out


def test_te_ring_two_ranks_by_hand() -> None:
    # One document of 8 tokens, P = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks
    # 1 and 2. Step 0 (local, causal over 4 rows): 10 pairs each; step 1: 8 pairs each. Round 0
    # carries 4 tokens of KV = 8 bytes: 0.5 + 8 s, hidden under step 0's 10 s.
    run = run_method("te_thd_ring", [0, 8], hw=TOY, intra=1, inter=2, shape=ONE)
    assert run.fwd.timeline.finish.tolist() == pytest.approx([18.0, 18.0], **TIGHT)
    # Backward: KV round hidden again (10 s); dKV of step 0 (8 bytes) leaves at 10, lands at
    # 18.5; step 1 computes until 18, waits, then returns dKV home: 18.5 + 8.5 = 27.
    assert run.bwd.timeline.finish.tolist() == pytest.approx([27.0, 27.0], **TIGHT)
    assert flops_per_rank(run, "fwd").sum() / 4 == doc_mask([8]).sum()


def test_te_ring_pads_documents_to_2p() -> None:
    # Documents of 3 and 5 tokens at P = 2 are padded to 4 and 8: 4·5/2 + 8·9/2 = 46 pairs.
    run = run_method("te_thd_ring", [0, 3, 8], hw=TOY, intra=1, inter=2, shape=ONE)
    assert flops_per_rank(run, "fwd").sum() / 4 == 46


def test_ulysses_by_hand() -> None:
    # P = 2, 2 heads: each all-to-all moves 4 tokens × 1 head × 1 element = 4 bytes per peer
    # (0.5 + 4 s); forward = q, k, v, o (18 s) + 36 pairs on 1 head (36 s).
    run = run_method("ulysses", [0, 8], hw=TOY, intra=2, inter=1, shape=TWO)
    assert run.fwd.seconds == pytest.approx(54.0, **TIGHT)
    assert run.bwd.seconds == pytest.approx(54.0, **TIGHT)  # dO in; dq, dk, dv out; 36 pairs
    assert run_method("ulysses", [0, 8], hw=TOY, intra=4, inter=1, shape=TWO) is None  # P > H


def test_distflashattn_by_hand() -> None:
    # P = 2, T = 8, L = 4: step 0 diagonal 10 pairs; step 1 rank 1 computes (q1, kv0), 16 pairs,
    # after KV (8 bytes, 8.5 s) arrived during step 0. Rank 0 has no helper work at P = 2.
    run = run_method("distflashattn", [0, 8], hw=TOY, intra=1, inter=2, shape=ONE)
    assert run.fwd.timeline.finish.tolist() == pytest.approx([10.0, 26.0], **TIGHT)
    # document-blind: every causal pair of the whole batch, cross-document ones too
    run2 = run_method("distflashattn", [0, 3, 11, 16], hw=TOY, intra=1, inter=4, shape=ONE)
    assert flops_per_rank(run2, "fwd").sum() / 4 == 16 * 17 / 2


def test_allgather_by_hand() -> None:
    # P = 2, one document of 8: all-gather 4 tokens of KV (8 bytes: 0.5 + 8 s); rank 1's rows
    # 4..7 see 26 pairs; backward adds the reduce-scatter of dKV.
    run = run_method("allgather_kv", [0, 8], hw=TOY, intra=1, inter=2, shape=ONE)
    assert run.fwd.seconds == pytest.approx(8.5 + 26, **TIGHT)
    assert run.bwd.seconds == pytest.approx(8.5 + 26 + 8.5, **TIGHT)
    lengths = [3, 6, 7]
    run2 = run_method("allgather_kv", np.concatenate(([0], np.cumsum(lengths))), hw=TOY, intra=1, inter=4, shape=ONE)
    assert flops_per_rank(run2, "fwd").sum() / 4 == doc_mask(lengths).sum()


def test_contiguous_ring_matches_dense_mask() -> None:
    # ring-flash-attention's naive varlen ring: rank r holds piece r of every document.
    P, pieces = 4, np.array([3, 1, 2])
    steps = contiguous_ring_steps(pieces, P)
    lengths = (pieces * P).tolist()
    mask = doc_mask(lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)))[:-1]
    owner = np.concatenate([np.repeat(np.arange(P), m) for m in pieces])  # rank of each token
    assert len(owner) == sum(lengths) and starts[0] == 0
    expected = np.array([mask[owner == r].sum() for r in range(P)])
    np.testing.assert_array_equal(steps.work, expected)


def test_zigzag_is_balanced_and_complete() -> None:
    P, chunks = 4, np.array([2, 5])
    steps = zigzag_steps(chunks, P)
    total = doc_mask((2 * P * chunks).tolist()).sum()
    assert steps.work.sum() == total
    assert np.ptp(steps.work) == 0  # every rank does the same pairs


def test_usp_splits_heads_then_rings() -> None:
    # 4 GPUs as 2 (all-to-all) × 2 (ring) must do the same pairs as TE's ring on 4 GPUs, per
    # head: total pairs × heads; all-to-all time appears on every rank.
    shape = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
    usp = run_method("te_a2a_p2p", [0, 16], hw=TOY, intra=2, inter=2, shape=shape)
    assert usp.topology == "2x2"
    # one inter group simulated: each rank works on 1 of the 2 heads -> FLOPs / (4·1) = pairs
    assert flops_per_rank(usp, "fwd").sum() / 4 == doc_mask([16]).sum()
    assert usp.fwd.timeline.busy("a2a").min() > 0


def test_hsap_workload_matches_the_plan() -> None:
    from megatron_hsap.plan.plan import compile_plan
    from megatron_hsap.sim.hsap import a2a_calls, hsap_workload

    cu = [0, 900, 1000, 3100, 3200, 4096]
    plan = compile_plan(cu, 4, 2, num_heads=4, num_kv_heads=2, head_dim=8, flatten="never")  # the 2x4 topology
    cluster = Cluster(hw=TOY, intra_size=2, inter_size=4)
    for phase in ("fwd", "bwd"):
        work, gpus = hsap_workload(plan, cluster, phase)
        assert gpus == [0, 2, 4, 6]
        sent = sum(t.nbytes for t in work.transfers)
        assert sent == sum(m.nbytes for m in plan.raw_messages(phase))
        fpp = plan.shape.fwd_flops_per_pair if phase == "fwd" else plan.shape.bwd_flops_per_pair
        flops = sum(i.flops for p in work.programs for i in p if isinstance(i, Busy))
        assert flops == pytest.approx(plan.batch.total_work() * fpp, rel=1e-12)
        before, after = a2a_calls(plan, cluster, phase)
        # by hand: 512 local tokens; q is 2 of 4 heads × 8 × 1 byte... dtype 2 bytes:
        # per peer 512 × 2 × 8 × 2 = 16,384 bytes over NVLink at 1 B/s + 0.5 s
        q_like = 512 * 2 * 8 * 2 / 1.0 + 0.5
        kv_like = 512 * 1 * 8 * 2 / 1.0 + 0.5
        expected = [q_like, kv_like, kv_like] if phase == "fwd" else [q_like]
        assert before == pytest.approx(expected, **TIGHT)
        assert len(after) == (1 if phase == "fwd" else 3)
        tl = simulate_on(work, cluster, gpus)
        assert tl.makespan >= sum(before) + sum(after)


@pytest.mark.parametrize("chunks", [2, 4])
def test_hsap_workload_shares_kv_chunks_like_the_runtime(chunks) -> None:
    """q chunks sharing a kv head (4 q heads, 1 kv head per intra rank): SAP's bytes are the
    runtime's (``chunked_p2p_bytes``: kv side re-sent by every q chunk); on the side stream, k and v
    travel with the first chunk only (forward) and dk, dv return after the last (backward), each
    all-to-all at its chunk's bytes (q, o: 1/C; k, v: whole, Ckv = 1)."""
    from megatron_hsap.plan.chunks import chunked_p2p_bytes
    from megatron_hsap.plan.plan import compile_plan
    from megatron_hsap.sim.engine import Launch
    from megatron_hsap.sim.hsap import a2a_calls, hsap_workload

    cu = [0, 900, 1000, 3100, 3200, 4096]
    plan = compile_plan(cu, 4, 2, num_heads=8, num_kv_heads=2, head_dim=8, head_chunks=chunks, flatten="never")
    assert (plan.shape.num_heads, plan.shape.num_kv_heads) == (4, 1)
    cluster = Cluster(hw=TOY, intra_size=2, inter_size=4)
    predicted = chunked_p2p_bytes(plan)
    for phase in ("fwd", "bwd"):
        work, _ = hsap_workload(plan, cluster, phase)
        assert sum(t.nbytes for t in work.transfers) == pytest.approx(float(predicted[phase][0].sum()), **TIGHT)
        assert sum(t.nbytes for t in work.transfers) > sum(m.nbytes for m in plan.raw_messages(phase))  # kv re-sent
        one_q, one_kv = a2a_calls(plan, cluster, phase, chunks)
        # by hand, toy NVLink (1 B/s + 0.5 s a call): 512 local tokens × d 8 × 2 bytes to the 1 peer,
        # its 4 of the 8 q heads / C, its 1 kv head whole
        q_like, kv_like = 512 * 4 * 8 * 2 / chunks + 0.5, 512 * 1 * 8 * 2 + 0.5
        assert (one_q if phase == "fwd" else one_kv) == pytest.approx([q_like, kv_like, kv_like], **TIGHT)
        launches = [(i.label, i.seconds) for i in work.programs[0] if isinstance(i, Launch)]
        ins = [s for label, s in launches if label.startswith("all-to-all in")]
        backs = [s for label, s in launches if label.startswith("all-to-all back")]
        if phase == "fwd":
            assert ins == pytest.approx([q_like + 2 * kv_like] + [q_like] * (chunks - 1), **TIGHT)
            assert backs == pytest.approx([q_like] * chunks, **TIGHT)
        else:
            assert ins == pytest.approx([q_like] * chunks, **TIGHT)
            assert backs == pytest.approx([q_like] * (chunks - 1) + [q_like + 2 * kv_like], **TIGHT)

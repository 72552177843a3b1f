"""Baseline prices: hand-computed small cases and brute-force (dense-mask) pair counts."""

from __future__ import annotations


import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.baselines.flat import BASELINES, BaselineCost, price_baseline, unavailable_reason
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import A100, Hardware, KernelCurve, KernelModel, LinkClass
from megatron_hsap.plan.workloads import pack_batches

# Toy constants chosen so that times are pair and byte counts: 1 head of size 1, 1 byte per
# element -> 4 FLOPs per forward pair at 4 FLOP/s and 10 per backward pair at 10 FLOP/s (1 pair/s);
# k+v = 2 bytes per token; NVLink 1 byte/s and 0.5 s per round. Its kernel model runs every block
# at its peak (the saturating curve with a zero half-rate size: efficiency n / (n + 0) = 1), with
# no launch cost, no merge bytes, free HBM copies, all-to-alls at the link rate and no slowdown
# beside transfers, so the schedules' structure is
# checked by pair counts; the kernel terms are checked with KERNEL_TOY below.
TOY = Hardware(
    name="toy",
    attn_fwd_flops=4.0,
    attn_bwd_flops=10.0,
    nvlink_bw=1.0,
    ib_bw=0.25,
    nvlink_latency=0.5,
    ib_latency=1.0,
    kernel=KernelModel(fwd_peak=4.0, bwd_peak=10.0, curve=KernelCurve(half_rate_tokens=0.0, launch_s=0.0)),
    merge_fwd_bytes=0.0,
    merge_bwd_bytes=0.0,
    overlap_slowdown=0.0,
    hbm_bw=float("inf"),  # memory-bound copies free
    a2a_efficiency=1.0,  # all-to-alls at the NVLink figure
)
ONE = HeadShape(num_heads=1, num_kv_heads=1, head_dim=1, head_dim_v=1, dtype_bytes=1)
NV = LinkClass.NVLINK
MHA = HeadShape(num_heads=32, num_kv_heads=32, head_dim=128, head_dim_v=128, dtype_bytes=2)


def price(method: str, cu: list[int], P: int, shape: HeadShape = ONE, link: LinkClass = NV) -> BaselineCost:
    cost = price_baseline(method, cu, world=P, shape=shape, hardware=TOY, link=link)
    assert cost is not None
    return cost


# ---------------------------------------------------------------- independent references


def doc_mask(lengths: list[int]) -> np.ndarray:
    """Dense [T, T] mask: causal inside each document, nothing across documents."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def te_zigzag(lengths: list[int], P: int) -> tuple[list[int], np.ndarray]:
    """Padded lengths and the owner rank of every padded token (chunks r and 2P-1-r). P = 1 is
    no context parallelism: nothing padded."""
    if P == 1:
        return list(lengths), np.zeros(sum(lengths), dtype=np.int64)
    padded = [-(-n // (2 * P)) * 2 * P for n in lengths]
    owner = []
    for n in padded:
        c = n // (2 * P)
        chunk_owner = [k if k < P else 2 * P - 1 - k for k in range(2 * P)]
        owner += [chunk_owner[t // c] for t in range(n)] if c else []
    return padded, np.array(owner, dtype=np.int64)


def te_step_pairs(lengths: list[int], P: int, backward: bool = False) -> np.ndarray:
    """[step, rank] pairs by dense mask: at step i rank r holds the kv of rank (r-i) mod P
    (forward) or (r+1+i) mod P (backward)."""
    padded, owner = te_zigzag(lengths, P)
    mask = doc_mask(padded)
    out = np.zeros((P, P))
    for i in range(P):
        for r in range(P):
            kv = (r + 1 + i) % P if backward else (r - i) % P
            out[i, r] = mask[np.ix_(owner == r, owner == kv)].sum()
    return out


def contiguous_pairs(lengths: list[int], P: int) -> np.ndarray:
    """Owner-computes pairs per rank on the contiguous layout (L = ceil(T/P)) by dense mask."""
    mask = doc_mask(lengths)
    L = -(-mask.shape[0] // P)
    return np.array([mask[r * L : (r + 1) * L].sum() for r in range(P)], dtype=np.float64)


# ---------------------------------------------------------------- te_thd_ring


def test_te_one_document_p2_by_hand() -> None:
    cost = price("te_thd_ring", [0, 16], 2)
    # c = 4; rank 0 holds chunks {0, 3}, rank 1 {1, 2}. Forward step 0: 2 diagonals (10 each) + one
    # full block (16) = 36 pairs; step 1: two full blocks = 32. One round of local KV: 8 tokens x 2 B.
    assert cost.work.tolist() == [68, 68]
    assert cost.fwd_time == pytest.approx(max(36, 16) + 0.5 + 32)
    # backward starts with the KV of rank r+1 (32 pairs) while sending KV, ends on its own KV (36) with dKV
    assert cost.bwd_time == pytest.approx(max(32, 16) + 0.5 + max(36, 16) + 0.5)
    assert cost.bytes_sent.tolist() == [48, 48] and cost.bytes_recv.tolist() == [48, 48]
    assert cost.steps == 3
    slow = price("te_thd_ring", [0, 16], 2, link=LinkClass.INFINIBAND)  # 0.25 B/s: 64 s per round
    assert slow.fwd_time == pytest.approx(64 + 1 + 32)
    assert slow.bwd_time == pytest.approx(2 * (64 + 1))


def test_te_pads_each_document_to_2p() -> None:
    cost = price("te_thd_ring", [0, 5], 2)
    # 5 tokens padded to 8: the kernel computes the 8-token causal triangle, 4 tokens per rank
    assert cost.work.sum() == 8 * 9 / 2
    assert cost.bytes_sent.tolist() == [(1 * 4 * 2) * 3] * 2  # fwd KV + bwd KV + bwd dKV
    assert "3 pad tokens" in cost.note


@pytest.mark.parametrize("lengths", [[16], [5, 11], [1, 1, 30], [7, 0, 9, 23]])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_te_pairs_match_dense_mask(lengths: list[int], P: int) -> None:
    cu = np.concatenate(([0], np.cumsum(lengths))).tolist()
    cost = price("te_thd_ring", cu, P)
    fwd = te_step_pairs(lengths, P)
    bwd = te_step_pairs(lengths, P, backward=True)
    np.testing.assert_array_equal(cost.work, fwd.sum(axis=0))  # exact: integer counts in float64
    padded = [-(-n // (2 * P)) * 2 * P for n in lengths] if P > 1 else lengths
    assert cost.work.sum() == sum(n * (n + 1) // 2 for n in padded)
    local_kv = sum(padded) / P * 2  # bytes per rank (2 B per token)
    np.testing.assert_allclose(cost.bytes_sent, 3 * (P - 1) * local_kv)  # exact up to float rounding
    # time: the pipelined formula over the brute-force per-step pairs (1 pair/s, 1 B/s, 0.5 s)
    fwd_t = sum(max(fwd[i].max(), local_kv) + 0.5 for i in range(P - 1)) + fwd[P - 1].max()
    bwd_round = [local_kv] + [2 * local_kv] * (P - 2) + [local_kv] if P > 1 else [0.0]
    bwd_t = sum(max(bwd[i].max(), bwd_round[i]) + (0.5 if P > 1 else 0) for i in range(P))
    assert cost.fwd_time == pytest.approx(fwd_t)
    assert cost.bwd_time == pytest.approx(bwd_t)
    assert cost.steps == 2 * P - 1 if P > 1 else cost.steps == 0


# ---------------------------------------------------------------- allgather_kv


def test_allgather_one_document_p4_by_hand() -> None:
    cost = price("allgather_kv", [0, 16], 4)
    assert cost.work.tolist() == [10, 26, 42, 58]  # rows 4r..4r+3 see 4r+1..4r+4 keys
    ag = 3 * 4 * 2 / 1.0 + 0.5  # (P-1) L tokens of KV, one latency
    assert cost.fwd_time == pytest.approx(ag + 58)
    assert cost.bwd_time == pytest.approx(ag + 58 + ag)  # all-gather, compute, reduce-scatter of dKV
    assert cost.bytes_sent.tolist() == [72] * 4 and cost.bytes_recv.tolist() == [72] * 4
    assert cost.steps == 3


def test_allgather_two_documents_by_hand() -> None:
    cost = price("allgather_kv", [0, 6, 16], 4)
    assert cost.work.tolist() == [10, 5 + 6 + 1 + 2, 3 + 4 + 5 + 6, 7 + 8 + 9 + 10]


@pytest.mark.parametrize("cu", [[0, 10], [0, 3, 3, 10], [0, 1, 2, 17, 40], [0, 50, 51]])
@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_allgather_pairs_match_dense_mask(cu: list[int], P: int) -> None:
    lengths = np.diff(cu).tolist()
    cost = price("allgather_kv", cu, P)
    np.testing.assert_array_equal(cost.work, contiguous_pairs(lengths, P))
    assert cost.work.sum() == sum(n * (n + 1) // 2 for n in lengths)  # tail padding not computed


# ---------------------------------------------------------------- ulysses


def test_ulysses_by_hand() -> None:
    shape = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
    cost = price("ulysses", [0, 16], 2, shape=shape)
    # L = 8; q, k, v, o all-to-alls each move 8 tokens x 1 head x 1 B per rank: 4 x (8 + 0.5) s.
    # 136 / 2 = 68 full-head pairs at 8 FLOPs per pair and 4 FLOP/s.
    assert cost.work.tolist() == [68, 68]
    assert cost.fwd_time == pytest.approx(4 * 8.5 + 68 * 8 / 4)
    assert cost.bwd_time == pytest.approx(4 * 8.5 + 68 * 20 / 10)
    assert cost.bytes_sent.tolist() == [64, 64] and cost.bytes_recv.tolist() == [64, 64]
    assert cost.steps == 8


def test_ulysses_k_and_v_of_different_head_sizes() -> None:
    shape = HeadShape(num_heads=2, num_kv_heads=2, head_dim=2, head_dim_v=1, dtype_bytes=1)
    cost = price("ulysses", [0, 16], 2, shape=shape)
    # per rank and peer: q 8 x 2 B, k 8 x 2 B, v 8 x 1 B, o 8 x 1 B; 12 FLOPs per pair at 4 FLOP/s
    assert cost.fwd_time == pytest.approx((16.5 + 16.5 + 8.5 + 8.5) + 68 * 12 / 4)
    assert cost.bytes_sent.tolist() == [2 * (16 + 16 + 8 + 8)] * 2


def test_ulysses_replicates_kv_heads() -> None:
    # 4 q heads, 2 kv heads, P = 4: every rank needs one (replicated) kv head
    shape = HeadShape(num_heads=4, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
    cost = price("ulysses", [0, 40], 4, shape=shape)
    L = 10
    q_like = 3 * L * 1  # 1 q head per rank, 1 B per element, to/from 3 peers
    kv = 3 * L * 2  # one kv head: k + v
    per_rank = 2 * (q_like + q_like) + 2 * kv  # fwd q, o and bwd do, dq; fwd k, v and bwd dk, dv
    assert cost.bytes_recv.tolist() == [per_rank] * 4
    assert cost.bytes_sent.tolist() == [per_rank] * 4
    assert "replicated" in cost.note


def test_ulysses_gqa_divisible_moves_hkv_over_p() -> None:
    shape = HeadShape(num_heads=8, num_kv_heads=4, head_dim=1, head_dim_v=1, dtype_bytes=1)
    cost = price("ulysses", [0, 40], 2, shape=shape)
    L = 20
    per_rank = 2 * (L * 4 + L * 4) + 2 * (L * 2 * 2)  # 4 q heads each way; 2 kv heads of k+v
    assert cost.bytes_sent.tolist() == [per_rank] * 2


def test_ulysses_not_applicable() -> None:
    shape = HeadShape(num_heads=2, num_kv_heads=2, head_dim=1, head_dim_v=1, dtype_bytes=1)
    assert price_baseline("ulysses", [0, 16], world=4, shape=shape, hardware=TOY, link=NV) is None
    assert unavailable_reason("ulysses", world=4, shape=shape) == "n/a (P > H)"
    six = HeadShape(num_heads=6, num_kv_heads=6, head_dim=1, head_dim_v=1, dtype_bytes=1)
    assert unavailable_reason("ulysses", world=4, shape=six) == "n/a (heads not divisible by P)"
    assert unavailable_reason("te_thd_ring", world=64, shape=shape) is None


# ---------------------------------------------------------------- distflashattn


def test_distflashattn_p4_by_hand() -> None:
    cost = price("distflashattn", [0, 3, 16], 4)  # document-blind: boundaries are ignored
    # step 0: diagonals (10); step 1: ranks 1-3 do (r, r-1), rank 0 helps rank 3 with (3, 0);
    # step 2: ranks 2, 3 do (2, 0), (3, 1); ranks 0, 1 idle (offset 2 is already covered).
    assert cost.work.tolist() == [26, 26, 42, 42]
    # forward rounds: [KV x3 + q of rank 3 -> 0] (8 B max), [KV 0->2, 1->3] (8), [o+lse 0->3] (4 x 5 B)
    assert cost.fwd_time == pytest.approx(max(10, 8) + 0.5 + max(16, 8) + 0.5 + max(16, 20) + 0.5)
    # backward: q+lse+o+do (7 B/token) to the helper; dq (1 B) and dk+dv (2 B) deltas back; tail dKV
    assert cost.bwd_time == pytest.approx(max(10, 28) + 0.5 + max(16, 8) + 0.5 + max(16, 8) + 0.5 + 8 + 0.5)
    assert cost.bytes_sent.tolist() == [36 + 20, 16 + 24, 8 + 24, 4 + 44]
    assert cost.bytes_recv.tolist() == [4 + 44, 8 + 24, 16 + 24, 36 + 20]
    assert cost.steps == 7


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_distflashattn_computes_the_full_triangle(P: int) -> None:
    T = 12 * P
    if P > 1 and P % 2:  # LightSeq supports even rank counts only (the registry's rule)
        assert price_baseline("distflashattn", [0, 5, T], world=P, shape=ONE, hardware=TOY, link=NV) is None
        assert unavailable_reason("distflashattn", world=P, shape=ONE) == "n/a (odd P)"
        return
    cost = price("distflashattn", [0, 5, T], P)
    assert cost.work.sum() == T * (T + 1) / 2
    # balanced: no rank does more than one extra L x L block beyond the mean
    L = T // P
    assert cost.work.max() - cost.work.min() <= L * L
    assert (cost.steps == 0) if P == 1 else (cost.steps > 0)


@pytest.mark.parametrize("P", [2, 4, 6, 8, 16])
def test_distflashattn_follows_lightseq_rules(P: int) -> None:
    """LightSeq's own predicates (even P): at step t rank r computes (q_r, kv_{r-t}) when r >= t;
    ranks r < P/2 idle at t = P/2; otherwise rank r computes (q_{r+P-t}, kv_r) for rank r+P-t.
    Every block (i, j <= i) must be computed exactly once and per-rank work must match."""
    L = 3
    seen: dict[tuple[int, int], int] = {}
    work = np.zeros(P)
    for t in range(P // 2 + 1):
        for r in range(P):
            if r >= t:
                block = (r, r - t)
            elif r < P // 2 and t == P // 2:
                continue
            else:
                block = (r + P - t, r)
            seen[block] = seen.get(block, 0) + 1
            work[r] += L * (L + 1) / 2 if t == 0 else L * L
    assert seen == {(i, j): 1 for i in range(P) for j in range(i + 1)}
    cost = price("distflashattn", [0, L * P], P)
    np.testing.assert_array_equal(cost.work, work)


# ---------------------------------------------------------------- common properties


@pytest.mark.parametrize("method", BASELINES)
@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_bytes_are_conserved(method: str, P: int) -> None:
    cu = pack_batches("fineweb", 4096, 1, seed=3)[0]
    cost = price_baseline(method, cu, world=P, shape=MHA, hardware=A100, link=NV)
    assert cost is not None
    assert cost.bytes_sent.shape == cost.bytes_recv.shape == cost.work.shape == (P,)
    # every byte sent is received by someone; float sums of integers, exact well below 2**53
    assert cost.bytes_sent.sum() == cost.bytes_recv.sum()
    assert cost.time == cost.fwd_time + cost.bwd_time > 0
    if P == 1:
        assert cost.bytes_sent.sum() == 0 and cost.steps == 0


def test_unknown_method_and_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="te_thd_ring"):
        price_baseline("ring", [0, 8], world=2, shape=ONE, hardware=TOY, link=NV)
    with pytest.raises(ConfigError, match="world"):
        price_baseline("te_thd_ring", [0, 8], world=0, shape=ONE, hardware=TOY, link=NV)
    with pytest.raises(ValueError):  # BatchError
        price_baseline("te_thd_ring", [0, 8, 4], world=2, shape=ONE, hardware=TOY, link=NV)


def test_pricing_a_million_tokens() -> None:
    """Every flat price handles a 1M-token batch at P = 64 (vectorised: no per-token loops)."""
    cu = pack_batches("fineweb", 1 << 20, 1, seed=0)[0]
    for method in BASELINES:
        cost = price_baseline(method, cu, world=64, shape=MHA, hardware=A100, link=LinkClass.INFINIBAND)
        if method == "ulysses":  # 64 ranks > 32 heads
            assert cost is None and unavailable_reason(method, world=64, shape=MHA) == "n/a (P > H)"
        else:
            assert cost is not None and cost.time > 0


# ---------------------------------------------------------------- te_thd_ring_nopad, allgather_kv_zigzag


@pytest.mark.parametrize("lengths", [[16], [5, 11], [1, 1, 30], [7, 0, 9, 23]])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_te_nopad_computes_real_pairs_sends_padded_bytes(lengths: list[int], P: int) -> None:
    cu = np.concatenate(([0], np.cumsum(lengths))).tolist()
    pad, nopad = price("te_thd_ring", cu, P), price("te_thd_ring_nopad", cu, P)
    assert nopad.work.sum() == pytest.approx(doc_mask(lengths).sum())  # real pairs only
    np.testing.assert_array_equal(nopad.bytes_sent, pad.bytes_sent)  # the padding still travels
    assert nopad.fwd_time <= pad.fwd_time and nopad.bwd_time <= pad.bwd_time


def zigzag_real_owner(lengths: list[int], P: int) -> np.ndarray:
    """Owner rank of every REAL token under per-document zigzag (chunks r and 2P-1-r of each
    document padded to 2P), from the padded owners of ``te_zigzag``."""
    padded, owner = te_zigzag(lengths, P)
    keep = np.concatenate([np.arange(p) < n for n, p in zip(lengths, padded)]) if lengths else np.zeros(0, bool)
    return owner[keep]


@pytest.mark.parametrize("lengths", [[16], [5, 11], [1, 1, 30], [7, 0, 9, 23], [3, 40, 2]])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_allgather_zigzag_pairs_match_dense_mask(lengths: list[int], P: int) -> None:
    cu = np.concatenate(([0], np.cumsum(lengths))).tolist()
    cost = price("allgather_kv_zigzag", cu, P)
    owner = zigzag_real_owner(lengths, P)
    mask = doc_mask(lengths)
    ref = np.array([mask[owner == r].sum() for r in range(P)], dtype=np.float64)
    np.testing.assert_array_equal(cost.work, ref)
    padded = [-(-n // (2 * P)) * 2 * P for n in lengths] if P > 1 else lengths
    kv = (P - 1) * sum(padded) / P * 2  # all-gathered KV bytes per rank (2 B per token)
    ag = kv + (0.5 if P > 1 else 0.0)
    assert cost.fwd_time == pytest.approx(ag + ref.max())
    assert cost.bwd_time == pytest.approx(2 * ag + ref.max())


def test_zigzag_balances_where_contiguous_does_not() -> None:
    contiguous, zigzag = price("allgather_kv", [0, 64], 4), price("allgather_kv_zigzag", [0, 64], 4)
    assert contiguous.work.max() / contiguous.work.mean() > 1.7  # 7/4 for one document
    assert zigzag.work.max() / zigzag.work.mean() < 1.05
    assert zigzag.fwd_time < contiguous.fwd_time


# ---------------------------------------------------------------- the kernel model's terms

# Tile model with 4 × 4 tiles and half a tile of prologue per row tile: a block costs
# m · (key tiles per row + 0.5) · 16 pair-seconds (peaks of 1 pair/s), m = ⌈rows / 4⌉, key tiles
# per row = pairs / rows / 4 + 0.5 clipped to [1, ⌈keys / 4⌉]; 1 s per launch; merges 1 B per
# element at 1 B/s (1 s per o or dq row of one head of size 1, 2 s per dk+dv row; the baselines' own
# bytes set to 1 by the unit_merge_bytes fixture, tests/conftest.py); kernels 1.5×
# slower while the round moves bytes.
KERNEL_TOY = Hardware(
    name="kernel-toy",
    attn_fwd_flops=4.0,
    attn_bwd_flops=10.0,
    nvlink_bw=1.0,
    ib_bw=0.25,
    nvlink_latency=0.5,
    ib_latency=1.0,
    kernel=KernelModel(fwd_peak=4.0, bwd_peak=10.0, tile=4, mblock_overhead=0.5,
                       curve=KernelCurve(half_rate_tokens=0.0, launch_s=1.0)),
    merge_fwd_bytes=1.0,
    merge_bwd_bytes=1.0,
    hbm_bw=1.0,
    overlap_slowdown=0.5,
)


def test_te_ring_kernel_terms_by_hand(unit_merge_bytes) -> None:
    cost = price_baseline("te_thd_ring", [0, 16], world=2, shape=ONE, hardware=KERNEL_TOY, link=NV)
    assert cost is not None
    # c = 4; rank 0 holds chunks {0, 3}, rank 1 {1, 2}. One call per rank and step (TE's sections):
    # diagonal 8 × 8, 36 pairs: m 2, key tiles 36/8/4 + 0.5 = 1.625 -> 2 · 2.125 · 16 = 68 s;
    # upper (rank 0, q chunk 3 × kv chunks 1, 2) 4 × 8, 32 pairs: key tiles 2.5 -> 2: 1 · 2.5 · 16 = 40 s;
    # lower (rank 1, q chunks 1, 2 × kv chunk 0) 8 × 4, 32 pairs: key tiles 1.5 -> 1: 2 · 1.5 · 16 = 48 s.
    # Forward step 0 sends 16 B of KV (16 s) while the diagonal runs 1.5× slower: 68 · 1.5 + 1 launch;
    # step 1 adds the LSE merge of the call's q rows (4 on rank 0, 8 on rank 1) at 1 s per row.
    assert cost.fwd_time == pytest.approx(max(68 * 1.5 + 1, 16) + 0.5 + max(40 + 1 + 4, 48 + 1 + 8))
    # backward: step 0 (upper / lower beside the KV round), step 1 the diagonal beside the dKV round
    # plus the dq (8 rows · 1 s) and dk, dv (8 rows · 2 s) accumulations
    assert cost.bwd_time == pytest.approx(max(40 * 1.5 + 1, 48 * 1.5 + 1, 16) + 0.5 + max(68 * 1.5 + 1 + 8 + 16, 16) + 0.5)
    assert cost.work.tolist() == [68, 68]  # pairs unchanged by the kernel model


def test_allgather_kernel_terms_by_hand(unit_merge_bytes) -> None:
    cost = price_baseline("allgather_kv", [0, 16], world=4, shape=ONE, hardware=KERNEL_TOY, link=NV)
    assert cost is not None
    # rank 3: rows 12..15 against keys 0..15, 58 pairs: key tiles 58/4/4 + 0.5 = 4.125 -> 4:
    # 1 · 4.5 · 16 = 72 s, one launch; no merge. The all-gather: 3 · 4 tokens · 2 B at 1 B/s + 0.5 s.
    ag = 24 + 0.5
    assert cost.fwd_time == pytest.approx(ag + 72 + 1)
    assert cost.bwd_time == pytest.approx(ag + 72 + 1 + ag)


def test_call_cost_matches_the_kernel_models_own_terms() -> None:
    """``kernel_blocks.call_cost`` against the scalar formulas of ``plan/hardware.py``
    (``blocks_time_py``, ``grid_time``, ``gqa_accum_time``) on random blocks of one call, FA3's
    H100 set (GQA packing, backward grid, dK/dV atomics)."""
    from megatron_hsap.baselines.kernel_blocks import call_cost
    from megatron_hsap.plan.hardware import H100_FA3

    rng = np.random.default_rng(5)
    shape = HeadShape(num_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128)
    nq = rng.integers(1, 3000, 12).astype(float)
    nk = nq + rng.integers(0, 3000, 12)
    pairs = nq * nk - nq * (nq - 1) / 2 * (rng.random(12) < 0.5)  # half causal, half full
    pairs[3] = 0.0  # an empty block: not computed, not in the grid
    k = H100_FA3.kernel
    for phase, fpp in (("fwd", shape.fwd_flops_per_pair), ("bwd", shape.bwd_flops_per_pair)):
        got = call_cost(H100_FA3, nq, nk, pairs, phase, heads=32, kv_heads=8, flops_per_pair=fpp, head_dim=128,
                        head_dim_v=128)
        live = pairs > 0
        blocks = [(int(a), int(b), p * fpp, p) for a, b, p in zip(nq[live], nk[live], pairs[live])]
        want_kernel = k.blocks_time_py(blocks, phase, group=4)
        want_fixed = k.launch_s + k.grid_time(nq[live].max(), nk[live].max(), int(live.sum()), 32, phase) \
            + k.gqa_accum_time(nk[live], shape, phase, H100_FA3.hbm_bw)
        # why rel 1e-12: the same formulas summed in another order
        assert float(got.kernel) == pytest.approx(want_kernel, rel=1e-12)
        assert float(got.fixed) == pytest.approx(want_fixed, rel=1e-12)
        assert (float(got.fixed) > k.launch_s) == (phase == "bwd")  # grid and atomics in backward only


def test_baselines_merge_with_their_own_bytes_not_hsaps() -> None:
    """A baseline's LSE merges cost its implementation's bytes (sim/constants.MERGE_BYTES: TE's
    fused correction 10 / 12), whatever HSAP's merge costs (Hardware.merge_fwd_bytes)."""
    from dataclasses import replace

    from megatron_hsap.baselines.kernel_blocks import MergeRates
    from megatron_hsap.plan.hardware import HARDWARE, MERGE_FWD_BYTES, MERGE_FWD_BYTES_EAGER
    from megatron_hsap.sim.config import merge_bytes

    hw = HARDWARE["h100"]
    assert hw.merge_fwd_bytes == MERGE_FWD_BYTES == merge_bytes("hsap", "fwd") == 10.0  # the fused merge
    eager = replace(hw, merge_fwd_bytes=MERGE_FWD_BYTES_EAGER, merge_bwd_bytes=99.0)
    cu = [0, 9000, 20000, 32768]
    for method, impl in (("te_thd_ring", "te"), ("distflashattn", "distflashattn")):
        a = price_baseline(method, cu, world=8, shape=MHA, hardware=hw, link=NV)
        b = price_baseline(method, cu, world=8, shape=MHA, hardware=eager, link=NV)
        assert a is not None and b is not None and (a.fwd_time, a.bwd_time) == (b.fwd_time, b.bwd_time), method
    m = MergeRates.of(MHA, hw, "ring_flash_attn")
    assert m.o == pytest.approx(32 * 128 * 18.0 / hw.hbm_bw) and m.dq == pytest.approx(32 * 128 * 10.0 / hw.hbm_bw)
    assert MergeRates.of(MHA, eager, "te").o == pytest.approx(32 * 128 * 10.0 / hw.hbm_bw)


def test_rings_over_the_network_run_at_nccls_channels_per_peer() -> None:
    """A ring's point-to-point stream to a network peer gets NCCL's channels per peer, not the
    NIC (NVIDIA/nccl ``src/graph/paths.cc``: 2 channels, 1 from 33 ranks with 16 p2p channels;
    ``plan/hardware.net_channels_per_peer``), as the simulator and HSAP's estimate charge it."""
    from dataclasses import replace

    ib = LinkClass.INFINIBAND
    capped = replace(TOY, p2p_channel_net_bw=0.1, p2p_channels=16)
    c = price_baseline("te_thd_ring", [0, 16], world=2, shape=ONE, hardware=capped, link=ib)
    assert c is not None  # 2 channels × 0.1 B/s = 0.2 B/s under the NIC's 0.25: 16 B per round, 80 s
    assert c.fwd_time == pytest.approx(80 + 1 + 32)
    assert c.bwd_time == pytest.approx(2 * (80 + 1))
    # 64 ranks: one channel, so the ring runs as on a NIC of 0.1 B/s; slower than at the NIC's
    # rate (kernels 10^4 x faster than TOY's: the rounds' transfers set the time)
    fast = replace(TOY, attn_fwd_flops=4e4, attn_bwd_flops=1e5, kernel=KernelModel(fwd_peak=4e4, bwd_peak=1e5, curve=TOY.kernel.curve))
    cu = [0, 64 * 64 * 2]
    for method in ("te_thd_ring", "te_thd_ring_nopad", "distflashattn"):
        got = price_baseline(method, cu, world=64, shape=ONE, hardware=replace(fast, p2p_channel_net_bw=0.1, p2p_channels=16), link=ib)
        nic = price_baseline(method, cu, world=64, shape=ONE, hardware=replace(fast, ib_bw=0.1), link=ib)
        free = price_baseline(method, cu, world=64, shape=ONE, hardware=fast, link=ib)
        assert got is not None and nic is not None and free is not None
        assert (got.fwd_time, got.bwd_time) == pytest.approx((nic.fwd_time, nic.bwd_time)), method
        assert got.time > free.time * 1.2, method

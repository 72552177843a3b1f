"""Flat prices of the baselines on the same packed batch, with the planner's constants (docs/design.md §4).

Moved here from ``plan/baselines.py`` (the planner keeps no baseline code); ``baselines.registry``
holds one record per method and points at these functions, the simulated schedules and the
CPU-executed implementations.

Each ``_price_*`` function models one published schedule. Compute is priced with the one
kernel model (``Hardware.kernel``, the ``KernelModel`` of ``plan/hardware.py`` that the
planner's estimate and the simulator read; ``baselines/kernel_blocks.py``): every kernel call
the implementation makes (each docstring cites how many per step), each document block at its
own shape, ``launch_s`` per call, FA3's backward grid and GQA atomics, and the implementation's
LSE merges / gradient accumulations at HBM bandwidth with the implementation's own bytes per
element (``_MERGE_IMPL``; ``sim/constants.MERGE_BYTES``), like ``plan/estimate.py`` prices HSAP's. A rank's transfer time in a round
= max(bytes sent, bytes received) / the rate of one point-to-point stream (full duplex; over
InfiniBand NCCL's channels per network peer in the ring's communicator, ``Hardware.p2p_bandwidth``:
28 GB/s up to 32 ranks, 14 GB/s from 33, as the simulator and HSAP's estimate charge; collectives
at ``hardware.bandwidth(link)``); a round or
collective costs one ``hardware.latency(link)``. Pipelined schedules price a step as the
slowest rank's max(compute, transfer of the round it overlaps) plus the round's latency, the
kernel part slowed by ``overlap_slowdown`` beside an in-flight transfer (as the estimate does);
collectives that the method cannot overlap are added in full.

Wire formats are what each implementation actually sends: q, k, v, o, do and — unlike HSAP's
fp32 partials — dq/dkv in the activation dtype (Transformer Engine's THD ring and all-gather
backward allocate dk/dv like k/v; DistFlashAttn's delta buffers are ``empty_like(dq/dk/dv)``;
Ulysses' all-to-all of gradients runs in the activation dtype). LSE is fp32. This favours the
baselines by up to 2× on gradient bytes; say so next to any comparison.

``BaselineCost.work`` counts forward (q, k) pairs per rank *as computed* (backward computes the
same pairs): padding pairs for TE's per-document padding, masked cross-document pairs for the
document-blind DistFlashAttn; Ulysses reports full-head-equivalent pairs (all pairs on H/P heads
= total / P). ``steps`` counts communication rounds or collectives, forward + backward, each of
which paid one latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_hsap.baselines.kernel_blocks import _PricingInputs, zigzag_allgather_compute, zigzag_ring_steps
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.plan.window import staircase_pairs

__all__ = ["BASELINES", "BaselineCost", "price_baseline", "unavailable_reason"]

BASELINES = ("te_thd_ring", "te_thd_ring_nopad", "allgather_kv", "allgather_kv_zigzag", "ulysses", "distflashattn")


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineCost:
    """Estimated forward + backward attention cost of one baseline on one batch.

    ``bytes_sent`` / ``bytes_recv``: float64 ``[P]``, forward + backward, per rank.
    ``work``: float64 ``[P]``, forward (q, k) pairs each rank computes (see module docstring).
    """

    method: str
    fwd_time: float
    bwd_time: float
    bytes_sent: np.ndarray
    bytes_recv: np.ndarray
    work: np.ndarray
    steps: int
    note: str = ""

    @property
    def time(self) -> float:
        """Forward + backward seconds."""
        return self.fwd_time + self.bwd_time


def _rounds_time(env, compute: np.ndarray, sent: np.ndarray, recv: np.ndarray, fixed: np.ndarray | None = None,
                 slowdown: float = 0.0) -> tuple[float, int]:
    """Pipelined schedule: row s of ``compute``/``sent``/``recv`` (each ``[steps, P]``) is one step
    whose compute overlaps its round; a step costs max over ranks of max(compute, transfer), plus
    one latency if any byte moves in its round. ``fixed`` (launches, merges) adds to compute
    unslowed; ``compute`` runs ``1 + slowdown`` slower on a rank whose round moves bytes
    (``plan/estimate.py`` ``BlockCosts.seconds``). Rounds are point-to-point: a transfer runs at
    ``env.p2p_bw`` (across nodes, NCCL's per-peer channels). Returns (seconds, rounds that moved bytes)."""
    xfer = np.maximum(sent, recv) / env.p2p_bw
    busy_rank = compute * (1.0 + slowdown * ((sent > 0) | (recv > 0)))
    if fixed is not None:
        busy_rank = busy_rank + fixed
    busy = np.maximum(busy_rank, xfer).max(axis=1)
    moved = (sent.sum(axis=1) + recv.sum(axis=1)) > 0
    return float(busy.sum() + env.lat * moved.sum()), int(moved.sum())


def _causal_pairs(lengths: np.ndarray) -> float:
    """Σ l(l+1)/2: the unmasked pairs of causal documents of these lengths (``plan/window.py``'s
    ``staircase_pairs`` in float64)."""
    return float(staircase_pairs(lengths.astype(np.float64)).sum())


def _prefix_pairs(cu: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Document-causal pairs whose q row is < x, for each x in ``x`` (float64, same shape)."""
    lengths = np.diff(cu).astype(np.float64)
    before = np.concatenate(([0.0], np.cumsum(staircase_pairs(lengths))))
    doc = np.clip(np.searchsorted(cu, x, side="right") - 1, 0, len(lengths))
    inside = (x - cu[doc]).astype(np.float64)  # rows of document `doc` below x
    return before[doc] + staircase_pairs(inside)


def _price_te_thd_ring(env: _PricingInputs, pad_compute: bool = True) -> BaselineCost:
    """Transformer Engine ``AttnFuncWithCPAndKVP2P``, THD format, causal
    (NVIDIA/TransformerEngine ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``).

    ``pad_compute=False`` (``te_thd_ring_nopad``): the same ring and bytes, but the kernel skips
    the per-document padding (cuDNN / FA3 with ``pad_between_seqs``): blocks hold real rows only.

    Layout: every document padded to a multiple of 2P (padding counted as computed tokens, as a
    kernel that cannot skip pre-padded documents does — FA2; cuDNN's pad_between_seqs path would
    skip them) and split into 2P chunks of ``c = padded / 2P``; rank r holds chunks r and
    2P−1−r of every document (zigzag). Forward: P steps; at step i rank r holds the KV of rank
    o = (r−i) mod P and makes ONE varlen call over every document (TE's per-step ``section``):
    step 0 the "diagonal" (both q chunks against both kv chunks, causal: a block of 2c rows);
    o < r the "lower triangle" (both q chunks, full, against kv chunk o: 2c × c); o > r the
    "upper triangle" (q chunk 2P−1−r, full, against both kv chunks: c × 2c). Steps 1..P−1 correct
    the output by LSE (``thd_out_correction``: the call's q rows, merged at HBM bandwidth).
    Steps 0..P−2 each send the whole local padded KV to rank r+1 while computing. Backward (the
    ring runs the other way and starts from the KV kept at the end of forward): P steps, one
    call each, the rounds carrying KV (step 0), KV + dKV (steps 1..P−2) and dKV (step P−1), all
    overlapped with that step's compute; steps 1..P−1 accumulate the call's dq and dk/dv rows
    (``thd_grad_correction`` / ``add_``). dKV travels in the activation dtype, as TE allocates it
    like KV. P = 1 is no CP: one causal call per phase, no padding.
    """
    P = env.P
    c = np.ceil(env.lengths / (2 * P))  # chunk size of each padded document; P = 1: no padding
    ring = zigzag_ring_steps(env, P, c, pad_compute=pad_compute)  # [steps, P] calls and merges
    lengths = env.lengths.astype(np.float64)
    local_tokens = 2 * float(c.sum()) if P > 1 else float(lengths.sum())  # padded tokens per rank
    kv_bytes = local_tokens * env.row_bytes(Wire.KV)
    dkv_bytes = kv_bytes  # activation dtype, same shape as KV

    fwd_round = np.zeros((P, P))
    fwd_round[: P - 1] = kv_bytes
    bwd_round = np.zeros((P, P))
    if P > 1:
        bwd_round[0] = kv_bytes
        bwd_round[1 : P - 1] = kv_bytes + dkv_bytes
        bwd_round[P - 1] = dkv_bytes
    slow = env.hw.overlap_slowdown
    fwd_time, fwd_steps = _rounds_time(env, ring.fwd.kernel, fwd_round, fwd_round, ring.fwd.fixed, slow)
    bwd_time, bwd_steps = _rounds_time(env, ring.bwd.kernel, bwd_round, bwd_round, ring.bwd.fixed, slow)
    sent = fwd_round.sum(axis=0) + bwd_round.sum(axis=0)
    real_tokens = int(env.cu[-1])
    padded = int(round(local_tokens)) * P if P > 1 else real_tokens
    return BaselineCost(
        method="te_thd_ring" if pad_compute else "te_thd_ring_nopad",
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        bytes_sent=sent,
        bytes_recv=sent.copy(),
        work=ring.pairs.sum(axis=0),
        steps=fwd_steps + bwd_steps,
        note=f"documents padded to 2P={2 * P}: {padded - real_tokens} pad tokens ({(padded - real_tokens) / max(real_tokens, 1):.1%}, "
        f"{'computed' if pad_compute else 'sent, not computed'}); dKV in activation dtype; kernel-model priced",
    )


def _contiguous_chunk(env: _PricingInputs) -> int:
    """Tokens per rank of the contiguous layout: T padded to a multiple of P, divided by P."""
    return -(-int(env.cu[-1]) // env.P)


def _price_allgather_kv(env: _PricingInputs) -> BaselineCost:
    """All-gather KV on the plain contiguous layout (owner computes, no balancing): what
    ring-flash-attention's ``llama3_flash_attn_varlen_func`` (zhuzilin/ring-flash-attention
    ``ring_flash_attn/llama3_flash_attn_varlen.py``) and our CPU ``bench/allgather_baseline.py`` run.
    The fair, balanced variant is ``allgather_kv_zigzag``.

    Rank r holds tokens [rL, (r+1)L), L = ceil(T/P) (the tail padding is not computed). Forward:
    one all-gather of KV (each rank sends its L tokens' KV and receives the other (P−1)·L), then
    rank r computes its q rows against every earlier key of the same document; compute starts
    after the collective (not overlapped). Backward: the same all-gather of KV, the backward
    compute, then a reduce-scatter of dKV (activation dtype, as TE's all-gather CP does: each rank
    sends and receives (P−1)·L tokens of dKV). The modelled layout is the plain contiguous one
    (Llama 3 itself gives each rank two chunks for balance). Kernel calls: one varlen call per
    rank and phase over its documents' pieces (``llama3_flash_attn_varlen_func`` with
    ``heads_k_stride`` = all kv heads), each piece q rows × the keys from its document's start;
    no merge (every row's output is complete).
    """
    P = env.P
    L = _contiguous_chunk(env)
    bounds = np.minimum(np.arange(P + 1, dtype=np.int64) * L, env.cu[-1])
    work = np.diff(_prefix_pairs(env.cu, bounds))
    cu = env.cu.astype(np.float64)
    a = np.maximum(cu[None, :-1], bounds[:-1, None].astype(np.float64))  # [P, docs]
    b = np.minimum(cu[None, 1:], bounds[1:, None].astype(np.float64))
    nq = np.maximum(b - a, 0.0)
    nk = np.where(nq > 0, b - cu[None, :-1], 0.0)
    pairs = np.where(nq > 0, staircase_pairs(nk) - staircase_pairs(nk - nq), 0.0)
    f, g = env.calls(nq, nk, pairs, Phase.FWD), env.calls(nq, nk, pairs, Phase.BWD)
    kv_bytes = float((P - 1) * L) * env.row_bytes(Wire.KV)
    dkv_bytes = kv_bytes  # activation dtype
    coll = 0.0 if P == 1 else env.lat
    ag = kv_bytes / env.bw + coll
    rs = dkv_bytes / env.bw + coll
    fwd_time = ag + float(np.max(f.kernel + f.fixed))
    bwd_time = ag + float(np.max(g.kernel + g.fixed)) + rs
    per_rank = np.full(P, 2 * kv_bytes + dkv_bytes)
    return BaselineCost(
        method="allgather_kv",
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        bytes_sent=per_rank,
        bytes_recv=per_rank.copy(),
        work=work,
        steps=0 if P == 1 else 3,
        note=f"compute after the all-gather (not overlapped); dKV reduce-scatter in activation dtype; imbalance {work.max() / max(work.mean(), 1.0):.2f}",
    )


def _price_allgather_kv_zigzag(env: _PricingInputs) -> BaselineCost:
    """Document-aware all-gather KV with per-document zigzag: Llama 3's CP, Transformer Engine's
    all-gather CP (``AttnFuncWithCPAndKVAllGather`` in
    ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``) and
    MagiAttention's ``ring_allgather`` baseline (SandAI-org/MagiAttention
    ``exps/dist_attn/baselines/ring_attn.py``, ``TERingAGAttnFunc`` / ``FA3RingAGAttnFunc``).

    Every document padded to a multiple of 2P (``c = padded / 2P``); rank r holds chunks r and
    2P−1−r of each. Forward: one all-gather of KV (each rank sends its ``2·Σc`` tokens and
    receives the rest), then the two q halves against the keys before them, real tokens only
    (the kernels get unpadded ``cu_seqlens``). Backward: the all-gather again, compute, then a
    reduce-scatter of dKV (activation dtype). Compute is not overlapped with the collectives
    (TE overlaps the two halves with the gather on a side stream; MagiAttention's does not).
    Kernel calls: TE makes one varlen call per q chunk and phase (its loop over
    ``local_seq_chunk_ids``), each chunk's rows × the keys from its document's start; the
    forward writes each chunk's own output rows (no merge), the backward adds both calls' dk/dv
    into the gathered gradient (``dk[...] += dk_per_step``: the kv rows of each call, at HBM
    bandwidth). P = 1 is no CP: one causal call per phase.
    """
    P = env.P
    c = np.ceil(env.lengths / (2 * P)) if P > 1 else env.lengths / 2.0
    work, f_busy, b_busy = zigzag_allgather_compute(env, staircase_pairs, -1)
    local = 2 * float(c.sum())
    kv_bytes = float(P - 1) * local * env.row_bytes(Wire.KV)
    coll = 0.0 if P == 1 else env.lat
    ag = kv_bytes / env.bw + coll
    fwd_time = ag + float(np.max(f_busy))
    bwd_time = ag + float(np.max(b_busy)) + ag
    per_rank = np.full(P, 3 * kv_bytes)
    return BaselineCost(
        method="allgather_kv_zigzag",
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        bytes_sent=per_rank,
        bytes_recv=per_rank.copy(),
        work=work,
        steps=0 if P == 1 else 3,
        note=f"per-document zigzag, documents padded to 2P (padding sent, not computed); imbalance {work.max() / max(work.mean(), 1.0):.2f}",
    )


def _ulysses_kv_heads(P: int, H: int, Hkv: int) -> np.ndarray:
    """KV heads rank j needs after the all-to-all: those used by its q heads [j·H/P, (j+1)·H/P).
    Equals Hkv/P when P divides Hkv, and 1 (a replicated head) when P ≥ Hkv with Hkv | P."""
    h = H // P
    group = H // Hkv
    first = np.arange(P) * h // group
    last = (np.arange(P) * h + h - 1) // group
    return (last - first + 1).astype(np.float64)


def _price_ulysses(env: _PricingInputs) -> BaselineCost:
    """DeepSpeed-Ulysses: all-to-all from sequence split to head split and back, unoverlapped.

    ``shape`` is the full head shape (per TP rank); rank j computes all documents' pairs for q
    heads [j·H/P, (j+1)·H/P), i.e. total work / P in full-head pairs. Layout: contiguous, T padded
    to a multiple of P, L tokens per rank. Forward: all-to-all of q, k, v (before) and o (after);
    backward: of do (before) and dq, dk, dv (after); o and lse stay head-split from forward. KV
    heads: each rank receives the kv heads its q heads use — Hkv/P when P divides Hkv, else
    replicated copies (1 head per rank when P ≥ Hkv), and the replicated bytes are counted (dk/dv
    of replicas travel back and are summed). Each all-to-all costs max over ranks of max(sent,
    received) / ``Hardware.a2a_bandwidth`` (NVLink derated by ``a2a_efficiency``, as the planner
    prices HSAP's own all-to-all) + one latency + the ``t h d -> h t d`` rearrange of the local
    tensor (``Hardware.a2a_copy_time``; DeepSpeed's ``_SeqAllToAll`` makes the input contiguous
    before and after). Needs P ≤ H and H % P == 0. Kernel calls: one varlen
    call per phase over every whole document on H/P heads (a causal block of l × l each); no merge.
    """
    P = env.P
    H, Hkv = env.shape.num_heads, env.shape.num_kv_heads
    L = float(_contiguous_chunk(env))
    need = _ulysses_kv_heads(P, H, Hkv)  # [P]
    others = P - 1
    q_tok = env.row_bytes(Wire.Q) / P  # bytes per token for H/P heads
    o_tok = env.row_bytes(Wire.O) / P
    kv_head_tok = env.row_bytes(Wire.KV) / Hkv  # k + v of one kv head
    # q-like tensors: every rank sends L tokens × H/P heads to each other rank, and receives the same
    q_like = np.full(P, others * L)
    kv_recv = others * L * need * kv_head_tok  # [P]
    kv_sent = L * (need.sum() - need) * kv_head_tok  # to every other rank j, what j needs

    a2a_bw = env.hw.a2a_bandwidth(env.link)

    def a2a(sent: np.ndarray, recv: np.ndarray) -> float:
        """One all-to-all at the hardware's all-to-all rate, plus the rearrange copy of the whole
        local tensor (own share included) around it (``Hardware.a2a_copy_time``)."""
        if P == 1:
            return 0.0
        most = float(np.maximum(sent, recv).max())
        return most / a2a_bw + env.lat + env.hw.a2a_copy_time(most * P / (P - 1))

    # k and v (and dk, dv) are separate all-to-alls: split the KV bytes by head size
    d, dv = env.shape.head_dim, env.shape.head_dim_v
    k_and_v = a2a(kv_sent * d / (d + dv), kv_recv * d / (d + dv)) + a2a(
        kv_sent * dv / (d + dv), kv_recv * dv / (d + dv)
    )
    fwd_comm = a2a(q_like * q_tok, q_like * q_tok) + k_and_v + a2a(q_like * o_tok, q_like * o_tok)
    bwd_comm = a2a(q_like * o_tok, q_like * o_tok) + a2a(q_like * q_tok, q_like * q_tok) + k_and_v
    pairs = _causal_pairs(env.lengths) / P
    work = np.full(P, pairs)
    lengths = env.lengths.astype(np.float64)
    f = env.calls(lengths, lengths, staircase_pairs(lengths), Phase.FWD, head_split=P)
    g = env.calls(lengths, lengths, staircase_pairs(lengths), Phase.BWD, head_split=P)
    sent = 2 * q_like * (q_tok + o_tok) + 2 * kv_sent
    recv = 2 * q_like * (q_tok + o_tok) + 2 * kv_recv
    replicated = "" if Hkv % P == 0 else f"; kv heads replicated ({int(need.max())} per rank)"
    return BaselineCost(
        method="ulysses",
        fwd_time=fwd_comm + float(f.kernel + f.fixed),
        bwd_time=bwd_comm + float(g.kernel + g.fixed),
        bytes_sent=sent,
        bytes_recv=recv,
        work=work,
        steps=0 if P == 1 else 8,
        note="all-to-alls not overlapped; gradients in activation dtype" + replicated,
    )


def _price_distflashattn(env: _PricingInputs) -> BaselineCost:
    """DistFlashAttn (LightSeq) load-balanced causal schedule, document-blind.

    The padded batch (T' = P·L) is ONE causal sequence: masked cross-document blocks are computed
    too, so total work is T'(T'+1)/2. Rank r holds q, k, v of chunk r = [rL, (r+1)L). Step 0: the
    diagonal block, L(L+1)/2. Steps s = 1..⌊P/2⌋: rank r ≥ s computes (q_r, kv_{r−s}) with KV
    sent directly by rank r−s; rank r < s (idle in a plain ring) receives q_{r+P−s} from rank
    r+P−s, computes it against its own kv and returns o + lse (the next round; DistFlashAttn
    returns o with two fp32 row statistics, modelled as lse), except when 2s = P (that offset is
    already covered; helpers idle). Every block (i, j ≤ i) is computed once. The round posted at
    step s carries the inputs of step s+1 and the returns of step s−1 and overlaps step s's
    compute; returns of the last step form one unoverlapped tail round. Backward: the same steps,
    KV re-sent; helpers receive q, lse, o, do and return dq; the kv owner gets dk, dv deltas back
    from each rank that used its KV (activation dtype, LightSeq allocates them like dk/dv).
    DistFlashAttn supports even P only; odd P uses the same rule (offsets s and P−s per step).
    The published code also posts one spare KV transfer at its last step; it is not counted.
    Kernel calls: one per computed block (an L × L block, causal on the diagonal; LightSeq's
    ``_lightseq_forward`` / ``_lightseq_backward`` in RulinShao/LightSeq
    ``lightseq/lightseq_async_attn.py`` call the flash kernel once per step); every block after
    step 0 is merged into its q owner's output by LSE (forward; a helper's in the round after)
    and its dq / dk, dv accumulated into the owners' gradients (backward), L rows each at HBM
    bandwidth.
    """
    P = env.P
    L = float(_contiguous_chunk(env))
    S = P // 2
    ranks = np.arange(P)

    def helping(s: int) -> bool:
        return 1 <= s <= S and 2 * s != P

    compute = np.zeros((S + 2, P))  # rows 0..S steps, S+1 the tail (no compute)
    compute[0] = staircase_pairs(L)
    for s in range(1, S + 1):
        compute[s] = np.where((ranks >= s) | helping(s), L * L, 0.0)

    def rounds(q_pack: float, back_q: float, back_kv: float, kv_tok: float) -> tuple[np.ndarray, np.ndarray]:
        """Bytes per [round, rank]: q_pack = bytes/token sent with q to a helper, back_q = bytes/token
        a helper returns to the q owner, back_kv = bytes/token of dkv returned to the kv owner."""
        sent = np.zeros((S + 2, P))
        recv = np.zeros((S + 2, P))
        for t in range(S + 1):
            s = t + 1  # inputs for step s
            if s <= S:
                kv_dst = ranks + s < P
                sent[t] += np.where(kv_dst, L * kv_tok, q_pack * L if helping(s) else 0.0)
                kv_src = ranks - s >= 0
                recv[t] += np.where(kv_src, L * kv_tok, q_pack * L if helping(s) else 0.0)
        for s in range(1, S + 1):  # returns of step s travel in round s+1 (the tail for s = S)
            helper = ranks < s
            if helping(s):
                sent[s + 1] += np.where(helper, back_q * L, 0.0)
                recv[s + 1] += np.where(ranks >= P - s, back_q * L, 0.0)  # owner r+P−s of helper r
            sent[s + 1] += np.where(~helper, back_kv * L, 0.0)  # rank r ≥ s returns to r−s
            recv[s + 1] += np.where(ranks + s < P, back_kv * L, 0.0)
        return sent, recv

    kv = env.row_bytes(Wire.KV)
    f_sent, f_recv = rounds(env.row_bytes(Wire.Q), env.row_bytes(Wire.O) + env.row_bytes(Wire.LSE), 0.0, kv)
    # dq and dk/dv deltas in the activation dtype: the byte size of q and of kv
    b_sent, b_recv = rounds(
        env.row_bytes(Wire.Q) + env.row_bytes(Wire.LSE) + env.row_bytes(Wire.O) + env.row_bytes(Wire.DO), env.row_bytes(Wire.Q), kv, kv
    )
    m = env.merge
    f_merge, b_merge = np.zeros((S + 2, P)), np.zeros((S + 2, P))
    for s in range(1, S + 1):
        own = ranks >= s  # rank r computes (q_r, kv_{r−s}): merges its o / dq now, dkv lands on r−s next round
        f_merge[s] += own * L * m.o
        b_merge[s] += own * L * m.dq
        b_merge[s + 1, ranks[own] - s] += L * m.dkv
        if helping(s):  # helper r < s computes (q_{r+P−s}, kv_r): dkv stays, o / dq land on r+P−s next round
            helper = ranks < s
            b_merge[s] += helper * L * m.dkv
            f_merge[s + 1, ranks[helper] + P - s] += L * m.o
            b_merge[s + 1, ranks[helper] + P - s] += L * m.dq
    f_cost = env.calls(L, L, compute[..., None], Phase.FWD)
    b_cost = env.calls(L, L, compute[..., None], Phase.BWD)
    slow = env.hw.overlap_slowdown
    fwd_time, fwd_steps = _rounds_time(env, f_cost.kernel, f_sent, f_recv, f_cost.fixed + f_merge, slow)
    bwd_time, bwd_steps = _rounds_time(env, b_cost.kernel, b_sent, b_recv, b_cost.fixed + b_merge, slow)
    work = compute.sum(axis=0)
    return BaselineCost(
        method="distflashattn",
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        bytes_sent=f_sent.sum(axis=0) + b_sent.sum(axis=0),
        bytes_recv=f_recv.sum(axis=0) + b_recv.sum(axis=0),
        work=work,
        steps=fwd_steps + bwd_steps,
        note=f"document-blind: computes {work.sum() / max(_causal_pairs(env.lengths), 1.0):.1f}x the document-causal pairs; {S + 1} steps",
    )


_PRICERS: dict[str, Callable[[_PricingInputs], BaselineCost]] = {
    "te_thd_ring": _price_te_thd_ring,
    "te_thd_ring_nopad": lambda env: _price_te_thd_ring(env, pad_compute=False),
    "allgather_kv": _price_allgather_kv,
    "allgather_kv_zigzag": _price_allgather_kv_zigzag,
    "ulysses": _price_ulysses,
    "distflashattn": _price_distflashattn,
}


def unavailable_reason(method: str, *, world: int, shape: HeadShape) -> str | None:
    """Why ``method`` cannot run at CP size ``world`` with ``shape`` (e.g. ``"n/a (P > H)"``), or
    None: the registry's availability rule for a flat group of ``world`` ranks."""
    from megatron_hsap.baselines.registry import unavailable

    return unavailable(method, intra=1, inter=int(world), shape=shape)


def price_baseline(
    method: str,
    cu_seqlens: object,
    *,
    world: int,
    shape: HeadShape,
    hardware: Hardware,
    link: LinkClass,
) -> BaselineCost | None:
    """Estimated forward + backward attention time and bytes of ``method`` on this batch.

    ``cu_seqlens``: global ``[0, l0, ..., T]``. ``world``: CP size P. ``shape``: heads per TP
    rank (Ulysses splits them itself). Returns None when the method cannot run at this size;
    ``unavailable_reason`` says why. Raises ``ConfigError`` for an unknown method.
    """
    if method not in _PRICERS:
        raise ConfigError(f"unknown baseline {method!r}; choose one of {', '.join(BASELINES)}")
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ConfigError(f"world (CP size) must be an integer >= 1, got {world!r}")
    if unavailable_reason(method, world=int(world), shape=shape) is not None:
        return None
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    impl = _MERGE_IMPL.get(method, "te")
    return _PRICERS[method](_PricingInputs(cu=cu, P=int(world), shape=shape, hw=hardware, link=link, impl=impl))


# Whose merge kernel a flat method runs (the rest are TE's or merge nothing: all-gather, Ulysses)
_MERGE_IMPL = {"distflashattn": "distflashattn"}

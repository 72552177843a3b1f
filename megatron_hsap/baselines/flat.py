"""Flat prices of the baselines on the same packed batch, with the planner's constants (docs/design.md §4).

Moved here from ``plan/baselines.py`` (the planner keeps no baseline code); ``baselines.registry``
holds one record per method and points at these functions, the simulated schedules and the
CPU-executed implementations.

Each ``_price_*`` function models one published schedule with flat rates: compute time =
pairs × FLOPs per pair / rate (``hardware.attn_fwd_flops`` forward, ``attn_bwd_flops`` backward);
a rank's transfer time in a round = max(bytes sent, bytes received) / ``hardware.bandwidth(link)``
(full duplex); a round or collective costs one ``hardware.latency(link)``. Pipelined schedules
price a step as the slowest rank's max(compute, transfer of the round it overlaps) plus the
round's latency, like the planner's estimated time; collectives that the method cannot overlap
are added in full.

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

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Wire
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


@dataclass(frozen=True, slots=True)
class _PricingInputs:
    """What every pricing function needs: the batch, P and the constants."""

    cu: np.ndarray  # int64 [n_docs + 1], global cu_seqlens (empty documents allowed)
    P: int
    shape: HeadShape
    hw: Hardware
    link: LinkClass

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu)

    @property
    def bw(self) -> float:
        return self.hw.bandwidth(self.link)

    @property
    def lat(self) -> float:
        return self.hw.latency(self.link)

    def fwd_s(self, pairs: np.ndarray | float) -> np.ndarray | float:
        return pairs * self.shape.fwd_flops_per_pair / self.hw.attn_fwd_flops

    def bwd_s(self, pairs: np.ndarray | float) -> np.ndarray | float:
        return pairs * self.shape.bwd_flops_per_pair / self.hw.attn_bwd_flops

    def row_bytes(self, wire: Wire) -> float:
        return float(self.shape.token_bytes(wire))


def _rounds_time(env: _PricingInputs, compute: np.ndarray, sent: np.ndarray, recv: np.ndarray) -> tuple[float, int]:
    """Pipelined schedule: row s of ``compute``/``sent``/``recv`` (each ``[steps, P]``) is one step
    whose compute overlaps its round; a step costs max over ranks of max(compute, transfer), plus
    one latency if any byte moves in its round. Returns (seconds, rounds that moved bytes)."""
    xfer = np.maximum(sent, recv) / env.bw
    busy = np.maximum(compute, xfer).max(axis=1)
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
    the per-document padding (cuDNN / FA3 with ``pad_between_seqs``): compute counts real pairs only.

    Layout: every document padded to a multiple of 2P (padding counted as computed tokens, as a
    kernel that cannot skip pre-padded documents does — FA2; cuDNN's pad_between_seqs path would
    skip them) and split into 2P chunks of ``c = padded / 2P``; rank r holds chunks r and
    2P−1−r of every document (zigzag). Forward: P steps; at step i rank r holds the KV of rank
    (r−i) mod P and computes the within-document pairs of its q chunks against those kv chunks
    (per document: c² per kv chunk strictly before a q chunk, c(c+1)/2 on the diagonal); steps
    0..P−2 each send the whole local padded KV to rank r+1 while computing. Backward (the ring runs
    the other way and starts from the KV kept at the end of forward): P steps, the rounds carrying
    KV (step 0), KV + dKV (steps 1..P−2) and dKV (step P−1), all overlapped with that step's
    compute; dKV travels in the activation dtype, as TE allocates it like KV.
    """
    P = env.P
    # chunk size of each padded document; P = 1 is no CP at all: no padding (c = l/2 gives l(l+1)/2)
    c = (-(-env.lengths // (2 * P))).astype(np.float64) if P > 1 else env.lengths / 2.0
    full_block = float((c * c).sum())
    diag_block = float((c * (c + 1) / 2).sum())
    q_chunks = np.stack([np.arange(P), 2 * P - 1 - np.arange(P)], axis=1)  # [P, 2]

    def step_pairs(kv_owner: np.ndarray) -> np.ndarray:
        """Pairs per rank when rank r holds the kv chunks of rank kv_owner[r]: float64 [P]."""
        kv_chunks = q_chunks[kv_owner]  # [P, 2]
        a = q_chunks[:, :, None]
        b = kv_chunks[:, None, :]
        return (b < a).sum(axis=(1, 2)) * full_block + (b == a).sum(axis=(1, 2)) * diag_block

    ranks = np.arange(P)
    fwd_pairs = np.stack([step_pairs((ranks - i) % P) for i in range(P)])  # [P steps, P ranks]
    bwd_pairs = np.stack([step_pairs((ranks + 1 + i) % P) for i in range(P)])
    if not pad_compute and P > 1:  # padding skipped: scale every step to the real pairs
        scale = _causal_pairs(env.lengths) / max(float(fwd_pairs.sum()), 1.0)
        fwd_pairs, bwd_pairs = fwd_pairs * scale, bwd_pairs * scale
    local_tokens = 2 * float(c.sum())  # padded tokens per rank
    kv_bytes = local_tokens * env.row_bytes(Wire.KV)
    dkv_bytes = kv_bytes  # activation dtype, same shape as KV

    fwd_round = np.zeros((P, P))
    fwd_round[: P - 1] = kv_bytes
    bwd_round = np.zeros((P, P))
    if P > 1:
        bwd_round[0] = kv_bytes
        bwd_round[1 : P - 1] = kv_bytes + dkv_bytes
        bwd_round[P - 1] = dkv_bytes
    fwd_time, fwd_steps = _rounds_time(env, env.fwd_s(fwd_pairs), fwd_round, fwd_round)
    bwd_time, bwd_steps = _rounds_time(env, env.bwd_s(bwd_pairs), bwd_round, bwd_round)
    sent = fwd_round.sum(axis=0) + bwd_round.sum(axis=0)
    real = int(env.cu[-1])
    padded = int(round(local_tokens)) * P
    return BaselineCost(
        method="te_thd_ring" if pad_compute else "te_thd_ring_nopad",
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        bytes_sent=sent,
        bytes_recv=sent.copy(),
        work=fwd_pairs.sum(axis=0),
        steps=fwd_steps + bwd_steps,
        note=f"documents padded to 2P={2 * P}: {padded - real} pad tokens ({(padded - real) / real:.1%}, "
        f"{'computed' if pad_compute else 'sent, not computed'}); dKV in activation dtype",
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
    (Llama 3 itself gives each rank two chunks for balance).
    """
    P = env.P
    L = _contiguous_chunk(env)
    bounds = np.minimum(np.arange(P + 1, dtype=np.int64) * L, env.cu[-1])
    work = np.diff(_prefix_pairs(env.cu, bounds))
    kv_bytes = float((P - 1) * L) * env.row_bytes(Wire.KV)
    dkv_bytes = kv_bytes  # activation dtype
    coll = 0.0 if P == 1 else env.lat
    ag = kv_bytes / env.bw + coll
    rs = dkv_bytes / env.bw + coll
    fwd_time = ag + float(np.max(env.fwd_s(work)))
    bwd_time = ag + float(np.max(env.bwd_s(work))) + rs
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
    """
    P = env.P
    lengths = env.lengths.astype(np.float64)
    c = np.ceil(lengths / (2 * P)) if P > 1 else lengths / 2.0

    def rows_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Causal pairs of document rows [a, b) (clipped to the real length), per document."""
        a = np.minimum(a, lengths)
        b = np.minimum(b, lengths)
        return (b * (b + 1) - a * (a + 1)) / 2

    work = np.array([float((rows_pairs(r * c, (r + 1) * c) + rows_pairs((2 * P - 1 - r) * c, (2 * P - r) * c)).sum())
                     for r in range(P)])
    local = 2 * float(c.sum())
    kv_bytes = float(P - 1) * local * env.row_bytes(Wire.KV)
    coll = 0.0 if P == 1 else env.lat
    ag = kv_bytes / env.bw + coll
    fwd_time = ag + float(np.max(env.fwd_s(work)))
    bwd_time = ag + float(np.max(env.bwd_s(work))) + ag
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
    received) / bandwidth + one latency. Needs P ≤ H and H % P == 0.
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

    def a2a(sent: np.ndarray, recv: np.ndarray) -> float:
        return 0.0 if P == 1 else float(np.maximum(sent, recv).max()) / env.bw + env.lat

    # k and v (and dk, dv) are separate all-to-alls: split the KV bytes by head size
    d, dv = env.shape.head_dim, env.shape.head_dim_v
    k_and_v = a2a(kv_sent * d / (d + dv), kv_recv * d / (d + dv)) + a2a(
        kv_sent * dv / (d + dv), kv_recv * dv / (d + dv)
    )
    fwd_comm = a2a(q_like * q_tok, q_like * q_tok) + k_and_v + a2a(q_like * o_tok, q_like * o_tok)
    bwd_comm = a2a(q_like * o_tok, q_like * o_tok) + a2a(q_like * q_tok, q_like * q_tok) + k_and_v
    pairs = _causal_pairs(env.lengths) / P
    work = np.full(P, pairs)
    sent = 2 * q_like * (q_tok + o_tok) + 2 * kv_sent
    recv = 2 * q_like * (q_tok + o_tok) + 2 * kv_recv
    replicated = "" if Hkv % P == 0 else f"; kv heads replicated ({int(need.max())} per rank)"
    return BaselineCost(
        method="ulysses",
        fwd_time=fwd_comm + float(env.fwd_s(pairs)),
        bwd_time=bwd_comm + float(env.bwd_s(pairs)),
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
    fwd_time, fwd_steps = _rounds_time(env, env.fwd_s(compute), f_sent, f_recv)
    bwd_time, bwd_steps = _rounds_time(env, env.bwd_s(compute), b_sent, b_recv)
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
    return _PRICERS[method](_PricingInputs(cu=cu, P=int(world), shape=shape, hw=hardware, link=link))

"""Flat prices of the hierarchical and per-sample baselines, with the planner's constants
(docs/design.md §4's rates, wire formats and transfer rule, exactly as ``baselines.flat``).

One function, ``price(method, cu_seqlens, intra=, inter=, ...)``, prices every baseline of the
registry that has a flat price: the flat-group ones of ``baselines.flat`` (world = intra × inter)
and these five, each modelled as its real implementation behaves:

* ``te_a2a`` — Transformer Engine ``AttnFuncWithCPAndQKVOA2A`` (NVIDIA/TransformerEngine
  ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``,
  ``flash_attn_a2a_communicate``): every document padded to a multiple of 2P (THD dual-chunk
  layout) and split over P ranks; an all-to-all per tensor (q, k, v before; out after; backward
  dout before, dq, dk, dv after) to a head split, whole padded documents per rank; the kernel on
  the real tokens. Its own schedule differs from Ulysses' in the padded bytes and in overlapping
  each tensor's reorder with the next tensor's all-to-all (memory-bound: the simulator prices it,
  the flat model has no HBM term). Needs P | H and P | Hkv.
* ``usp`` — USP (feifeibear/long-context-attention ``yunchang/hybrid/attn_layer.py``
  ``LongContextAttention``; SandAI-org/MagiAttention ``exps/dist_attn/baselines/usp.py``): a head
  all-to-all over the ``intra`` ranks, then the per-document zigzag KV ring over the ``inter``
  ranks on the real tokens (MagiAttention's USP calls its FA3 THD ring, ``ring_attn.py``
  ``FA3RingAttnFunc``); documents padded to 2P. USP fixes its split itself: the largest
  all-to-all inside one node (``registry.usp_degree``), whatever ``intra × inter`` is asked.
* ``te_a2a_p2p`` — TE's ``cp_comm_type="a2a+p2p"`` (the same file: ``AttnFuncWithCPAndQKVOA2A``
  inside the node, ``AttnFuncWithCPAndKVP2P`` across): like USP, but TE's FA2 THD ring computes
  the per-document padding.
* ``loongtrain`` — LoongTrain's 2D attention (MagiAttention ``exps/dist_attn/baselines/
  loongtrain.py`` ``FA3DoubleRingAttnFunc``, after InternLM/InternEvo): USP's all-to-all, then a
  *double ring*: windows of ``w`` ring ranks (those sharing a node); each window's inner steps
  send the KV inside the node while one outer transfer per window moves it to the next window,
  overlapped with the whole window.
* ``hybrid_cp`` — Megatron hybrid / dynamic CP (NVIDIA/Megatron-LM ``megatron/core/
  pipeline_parallel/hybrid_cp_schedule.py`` ``BalancedCPScheduler``, as MagiAttention runs it in
  ``exps/dist_attn/baselines/hybrid_dcp.py``): each sample gets ``g = 2^⌈log2(l / 8K)⌉`` ranks
  (``registry.hybrid_group_sizes``) and samples are packed into stages (``hybrid_stages``); a
  sample with ``g > 1`` runs the zigzag THD ring over its ``g`` consecutive ranks, a sample with
  ``g = 1`` is one kernel call; a stage lasts as long as its slowest rank, plus a barrier.

Pricing: compute = pairs × FLOPs per pair / flat rate; a pipelined step costs the slowest rank's
max(compute, transfer of the round it overlaps) plus one latency if bytes move (``flat.
_rounds_time``); an all-to-all over ``u`` ranks costs ``(u − 1) × bytes per peer / bandwidth +
latency``, unoverlapped. The intra all-to-all runs on NVLink; the ring on ``inter_link``
(InfiniBand when the CP group spans nodes). Gradients travel in the activation dtype, like the
baselines of ``flat``.
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.baselines.flat import BaselineCost, _causal_pairs, _rounds_time, price_baseline
from megatron_hsap.baselines.registry import heads_split_ok, hybrid_group_sizes, split_heads, unavailable, usp_degree
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.layout import normalize_cu_seqlens

__all__ = ["HIERARCHICAL", "price", "hybrid_stages", "window_size", "HYBRID_TOKENS_PER_RANK"]

HIERARCHICAL = ("te_a2a", "usp", "te_a2a_p2p", "loongtrain", "hybrid_cp")
HYBRID_TOKENS_PER_RANK = 8192  # MagiAttention's hybrid_dcp.py: max_seqlen_per_rank = 8K


def window_size(ring: int, intra: int, gpus_per_node: int) -> int:
    """LoongTrain's double-ring window: the ring ranks that share a node (at least 1), dividing ``ring``."""
    w = max(1, min(ring, gpus_per_node // max(intra, 1)))
    while ring % w:
        w -= 1
    return w


def hybrid_stages(lengths: object, P: int, per_rank: int = HYBRID_TOKENS_PER_RANK) -> list[list[tuple[int, int, int]]]:
    """Megatron hybrid CP's stages of ``(sample length, first rank, group size)``: largest sample
    first, each into the first stage with ``g`` consecutive aligned ranks holding room for
    ``l / g`` tokens each (``per_rank`` per rank); a new stage when none has room."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    sizes = hybrid_group_sizes(lengths.tolist(), P, per_rank)
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    stages: list[list[tuple[int, int, int]]] = []
    room: list[np.ndarray] = []
    for i in order:
        n, g = int(lengths[i]), sizes[i]
        share = -(-n // g)
        placed = False
        for s, free in enumerate(room):
            for first in range(0, P, g):
                if (free[first : first + g] >= share).all():
                    free[first : first + g] -= share
                    stages[s].append((n, first, g))
                    placed = True
                    break
            if placed:
                break
        if not placed:
            free = np.full(P, max(per_rank, share), dtype=np.int64)
            free[:g] -= share
            room.append(free)
            stages.append([(n, 0, g)])
    return stages


# ---------------------------------------------------------------- building blocks
def _a2a_seconds(bytes_per_peer: float, u: int, hw: Hardware) -> float:
    """One all-to-all over ``u`` NVLink ranks: ``(u − 1)`` peers' bytes plus one latency."""
    if u <= 1 or bytes_per_peer <= 0:
        return 0.0
    return (u - 1) * bytes_per_peer / hw.bandwidth(LinkClass.NVLINK) + hw.latency(LinkClass.NVLINK)


def _a2a_phase(shape: HeadShape, u: int, local_tokens: float, hw: Hardware) -> tuple[float, float, float]:
    """(fwd seconds, bwd seconds, bytes sent per rank fwd+bwd) of the head all-to-alls over ``u``
    ranks: q, k, v and out forward; dout, dq, dk, dv backward (the same four shapes)."""
    if u <= 1:
        return 0.0, 0.0, 0.0
    hkv = shape.num_kv_heads if shape.num_kv_heads % u == 0 else u  # replicated copies travel
    b = shape.dtype_bytes

    def per_peer(heads: int, dim: int) -> float:
        return local_tokens * (heads // u) * dim * b

    sizes = [per_peer(shape.num_heads, shape.head_dim), per_peer(hkv, shape.head_dim), per_peer(hkv, shape.head_dim_v),
             per_peer(shape.num_heads, shape.head_dim_v)]
    t = sum(_a2a_seconds(s, u, hw) for s in sizes)
    return t, t, 2 * (u - 1) * sum(sizes)


def _ring(lengths: np.ndarray, P: int, r: int, shape: HeadShape, hw: Hardware, link: LinkClass, *,
          pad_compute: bool) -> tuple[float, float, float, float, int]:
    """The per-document zigzag KV ring over ``r`` ranks on ``shape``'s heads, documents padded
    to 2P and split in 2r chunks (``c = padded / 2r``): (fwd s, bwd s, bytes sent per rank
    fwd+bwd, forward pairs per rank, rounds). Step 0 is the causal 2c × 2c block, every other
    step 2c² pairs per document on every rank (balanced); forward rounds 0..r−2 carry the KV;
    backward round s carries the KV of step s+1 and the dKV of step s−1, and the last step's dKV
    travels after it, exposed (the order of ``sim.schedules.ring_schedule``). ``pad_compute``
    False: pairs scaled to the real tokens (cuDNN/FA3 skip padding)."""
    padded = -(-lengths // (2 * P)) * (2 * P) if P > 1 else lengths
    c = padded.astype(np.float64) / (2 * r) if r > 1 else padded.astype(np.float64) / 2.0
    c = c[c > 0]
    step = np.full(r, float((2 * c * c).sum()))
    step[0] = float((2 * c * c + c).sum())
    if not pad_compute and step.sum() > 0:
        step *= _causal_pairs(lengths) / r / step.sum()
    kv = 2 * float(c.sum()) * shape.token_bytes(Wire.KV)
    fwd_round = np.zeros(r)
    fwd_round[: r - 1] = kv
    bwd_round = np.zeros(r)
    if r > 1:
        bwd_round[0] = kv
        bwd_round[1 : r - 1] = 2 * kv
        bwd_round[r - 1] = kv
    fpp_f = shape.fwd_flops_per_pair / hw.attn_fwd_flops
    fpp_b = shape.bwd_flops_per_pair / hw.attn_bwd_flops
    env = _Link(hw, link)
    tf, nf = _rounds_time(env, (step * fpp_f)[:, None], fwd_round[:, None], fwd_round[:, None])  # type: ignore[arg-type]
    tb, nb = _rounds_time(env, (step * fpp_b)[:, None], bwd_round[:, None], bwd_round[:, None])  # type: ignore[arg-type]
    if r > 1:  # the last step's dKV leaves after its compute: one more round, nothing to hide it
        tb += kv / env.bw + env.lat
        nb += 1
    return tf, tb, float(fwd_round.sum() + bwd_round.sum() + (kv if r > 1 else 0.0)), float(step.sum()), nf + nb


class _Link:
    """The two fields ``flat._rounds_time`` reads (bandwidth and latency of one link class)."""

    def __init__(self, hw: Hardware, link: LinkClass) -> None:
        self.bw = hw.bandwidth(link)
        self.lat = hw.latency(link)


# ---------------------------------------------------------------- the five methods
def _price_te_a2a(lengths: np.ndarray, P: int, shape: HeadShape, hw: Hardware, link: LinkClass) -> BaselineCost:
    padded = -(-lengths // (2 * P)) * (2 * P) if P > 1 else lengths
    local = float(padded.sum()) / P
    b = shape.dtype_bytes

    def a2a(heads: int, dim: int) -> tuple[float, float]:
        per_peer = local * (heads // P) * dim * b
        return ((P - 1) * per_peer / hw.bandwidth(link) + hw.latency(link) if P > 1 else 0.0), (P - 1) * per_peer

    parts = [a2a(shape.num_heads, shape.head_dim), a2a(shape.num_kv_heads, shape.head_dim), a2a(shape.num_kv_heads, shape.head_dim_v),
             a2a(shape.num_heads, shape.head_dim_v)]
    comm = sum(t for t, _ in parts)
    sent = 2 * sum(s for _, s in parts)
    pairs = _causal_pairs(lengths) / P
    return BaselineCost(method="te_a2a", fwd_time=comm + pairs * shape.fwd_flops_per_pair / hw.attn_fwd_flops,
                        bwd_time=comm + pairs * shape.bwd_flops_per_pair / hw.attn_bwd_flops,
                        bytes_sent=np.full(P, sent), bytes_recv=np.full(P, sent), work=np.full(P, pairs),
                        steps=0 if P == 1 else 8,
                        note=f"documents padded to 2P={2 * P} ({int(padded.sum()) - int(lengths.sum())} pad tokens travel, not computed)")


def _price_usp_like(method: str, lengths: np.ndarray, intra: int, inter: int, shape: HeadShape, hw: Hardware,
                    link: LinkClass, gpus_per_node: int) -> BaselineCost:
    P = intra * inter
    local_shape = split_heads(shape, intra)
    padded = -(-lengths // (2 * P)) * (2 * P) if P > 1 else lengths
    a_f, a_b, a_bytes = _a2a_phase(shape, intra, float(padded.sum()) / P, hw)
    pad_compute = method == "te_a2a_p2p"
    if method == "loongtrain" and inter > 1:
        tf, tb, r_bytes, pairs, rounds = _double_ring(lengths, P, inter, intra, local_shape, hw, link, gpus_per_node)
    else:
        tf, tb, r_bytes, pairs, rounds = _ring(lengths, P, inter, local_shape, hw, link, pad_compute=pad_compute)
    sent = np.full(P, a_bytes + r_bytes)
    return BaselineCost(method=method, fwd_time=a_f + tf, bwd_time=a_b + tb, bytes_sent=sent, bytes_recv=sent.copy(),
                        work=np.full(P, pairs / max(intra, 1)), steps=rounds + (8 if intra > 1 else 0),
                        note=f"{intra}x{inter}: all-to-all over {intra}, {'double ' if method == 'loongtrain' else ''}ring over {inter}"
                             + ("; padding computed" if pad_compute else ""))


def _double_ring(lengths: np.ndarray, P: int, r: int, u: int, shape: HeadShape, hw: Hardware, link: LinkClass,
                 gpus_per_node: int) -> tuple[float, float, float, float, int]:
    """LoongTrain's double ring (module docstring): window ``w`` of ring ranks; the inner step i
    of window k computes like ring step ``k·w + i`` and overlaps the inner transfer (NVLink when
    the window shares a node); the window overlaps its outer transfer (``link``)."""
    w = window_size(r, u, gpus_per_node)
    nw = r // w
    padded = -(-lengths // (2 * P)) * (2 * P)
    c = padded.astype(np.float64) / (2 * r)
    c = c[c > 0]
    step = np.full(r, float((2 * c * c).sum()))
    step[0] = float((2 * c * c + c).sum())
    step *= _causal_pairs(lengths) / r / step.sum()  # FA3 on the real tokens
    kv = 2 * float(c.sum()) * shape.token_bytes(Wire.KV)
    inner = LinkClass.NVLINK if w * u <= gpus_per_node else link
    total = {}
    rounds = 0
    for ph, moved, rate in ((Phase.FWD, kv, hw.attn_fwd_flops), (Phase.BWD, 2 * kv, hw.attn_bwd_flops)):
        fpp = (shape.fwd_flops_per_pair if ph == Phase.FWD else shape.bwd_flops_per_pair) / rate
        t = 0.0
        for k in range(nw):
            win = 0.0
            for i in range(w):
                comp = step[k * w + i] * fpp
                if i + 1 < w:
                    win += max(comp, moved / hw.bandwidth(inner)) + hw.latency(inner)
                    rounds += 1
                else:
                    win += comp
            if k + 1 < nw:
                win = max(win, moved / hw.bandwidth(link) + hw.latency(link))
                rounds += 1
            t += win
        total[ph] = t
    sent = (w - 1) * nw * 3 * kv + (nw - 1) * 3 * kv
    return total[Phase.FWD], total[Phase.BWD], sent, float(step.sum()), rounds


def _price_hybrid(lengths: np.ndarray, P: int, shape: HeadShape, hw: Hardware, link: LinkClass, gpus_per_node: int) -> BaselineCost:
    fwd = bwd = 0.0
    work = np.zeros(P)
    sent = np.zeros(P)
    stages = hybrid_stages(lengths, P)
    for stage in stages:
        busy_f = np.zeros(P)
        busy_b = np.zeros(P)
        for n, first, g in stage:
            if g == 1:
                pairs = _causal_pairs(np.array([n]))
                busy_f[first] += pairs * shape.fwd_flops_per_pair / hw.attn_fwd_flops
                busy_b[first] += pairs * shape.bwd_flops_per_pair / hw.attn_bwd_flops
                work[first] += pairs
                continue
            lk = LinkClass.NVLINK if g <= gpus_per_node and first // gpus_per_node == (first + g - 1) // gpus_per_node else link
            tf, tb, b, pairs, _ = _ring(np.array([n]), g, g, shape, hw, lk, pad_compute=False)
            busy_f[first : first + g] += tf
            busy_b[first : first + g] += tb
            work[first : first + g] += pairs
            sent[first : first + g] += b
        barrier = hw.latency(link) if P > 1 else 0.0
        fwd += float(busy_f.max()) + barrier
        bwd += float(busy_b.max()) + barrier
    return BaselineCost(method="hybrid_cp", fwd_time=fwd, bwd_time=bwd, bytes_sent=sent, bytes_recv=sent.copy(), work=work,
                        steps=2 * len(stages), note=f"{len(stages)} stage(s) of per-sample CP groups (8K tokens per rank)")


# ---------------------------------------------------------------- entry point
def price(method: str, cu_seqlens: object, *, intra: int, inter: int, shape: HeadShape, hardware: Hardware,
          link: LinkClass, gpus_per_node: int | None = None) -> BaselineCost | None:
    """Flat forward + backward price of ``method`` at ``intra × inter`` (``link``: the ring's, or
    the flat group's, link class). The flat-group baselines of ``baselines.flat`` run on all
    ``intra × inter`` ranks; None when the registry's availability rule says the method cannot
    run (``registry.unavailable`` says why); ``ConfigError`` for a method without a flat price."""
    for name, v in (("intra", intra), ("inter", inter)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    intra, inter = int(intra), int(inter)
    if method not in HIERARCHICAL:
        return price_baseline(method, cu_seqlens, world=intra * inter, shape=shape, hardware=hardware, link=link)
    if unavailable(method, intra=intra, inter=inter, shape=shape) is not None:
        return None
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    lengths = np.diff(cu)
    lengths = lengths[lengths > 0]
    gpn = gpus_per_node or hardware.gpus_per_node
    P = intra * inter
    if method == "te_a2a":
        return _price_te_a2a(lengths, P, shape, hardware, link)
    if method == "hybrid_cp":
        return _price_hybrid(lengths, P, shape, hardware, link, gpn)
    if method == "usp":  # USP fixes its own split: the largest all-to-all inside a node
        intra = usp_degree(P, shape, gpn)
        inter = P // intra
    if not heads_split_ok(shape, intra):
        return None
    return _price_usp_like(method, lengths, intra, inter, shape, hardware, link, gpn)

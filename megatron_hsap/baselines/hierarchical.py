"""Closed-form prices of the hierarchical and per-sample baselines, with the planner's constants
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

Pricing: compute with the one kernel model, as ``baselines.flat`` does (``baselines/kernel_blocks.py``):
every call the implementation makes at its blocks' shapes, one launch per call, FA3's backward
grid and GQA atomics, the rings' LSE corrections and dq/dkv accumulations at HBM bandwidth, the
kernel ``overlap_slowdown`` slower beside an in-flight transfer. A pipelined step costs the
slowest rank's max(compute, transfer of the round it overlaps) plus one latency if bytes move
(``flat._rounds_time``); an all-to-all over ``u`` ranks costs ``(u − 1) × bytes per peer /
bandwidth + latency``, unoverlapped (no rearrange copies and the full NVLink figure, unlike
``flat._price_ulysses``: this favours these peers). The intra all-to-all runs on NVLink; the ring
on ``inter_link`` (InfiniBand when the CP group spans nodes). Gradients travel in the
activation dtype, like the baselines of ``flat``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatron_hsap.baselines.flat import BaselineCost, _causal_pairs, _rounds_time, price_baseline
from megatron_hsap.baselines.kernel_blocks import _PricingInputs, zigzag_ring_steps
from megatron_hsap.baselines.registry import heads_split_ok, hybrid_group_sizes, split_heads, unavailable, usp_degree
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.plan.options import kv_heads_exchanged
from megatron_hsap.plan.window import staircase_pairs

__all__ = ["HIERARCHICAL", "price", "hybrid_stages", "window_size", "te_a2a_pipeline", "HYBRID_TOKENS_PER_RANK"]

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
def _a2a_seconds(bytes_per_peer: float, u: int, hw: Hardware, link: LinkClass = LinkClass.NVLINK) -> float:
    """One all-to-all over ``u`` ranks on ``link``: ``(u − 1)`` peers' bytes at the all-to-all
    rate HSAP's Ulysses and ``flat.ulysses`` are priced at (``Hardware.a2a_bandwidth``: NVLink
    derated by ``a2a_efficiency``) plus one latency."""
    if u <= 1 or bytes_per_peer <= 0:
        return 0.0
    return (u - 1) * bytes_per_peer / hw.a2a_bandwidth(link) + hw.latency(link)


def te_a2a_pipeline(core: list[float], copy: list[float]) -> float:
    """Seconds of one ``flash_attn_a2a_communicate`` call of Transformer Engine
    (``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``) given each
    tensor's all-to-all (``core``) and reorder copy (``copy``: ``movedim(...).contiguous()`` +
    ``index_select``, one read + write of the tensor): the reorder of tensor i+1 before and of
    tensor i−1 after it run on ``cp_stream`` while tensor i travels — first copy, then
    max(transfer, side copies) per tensor, then the last copy. The one rule: the closed form
    below and the simulator's ``sim.methods._te_a2a`` both call it."""
    t = copy[0]
    for i, c in enumerate(core):
        t += max(c, (copy[i + 1] if i + 1 < len(core) else 0.0) + (copy[i - 1] if i > 0 else 0.0))
    return t + copy[-1]


def _te_a2a_pipeline_seconds(per_peer: list[float], u: int, hw: Hardware, link: LinkClass = LinkClass.NVLINK) -> float:
    """:func:`te_a2a_pipeline` of ``per_peer`` bytes over ``u`` ranks at the all-to-all rate."""
    if u <= 1:
        return 0.0
    return te_a2a_pipeline([_a2a_seconds(x, u, hw, link) for x in per_peer], [2.0 * x * u / hw.hbm_bw for x in per_peer])


def _a2a_phase(shape: HeadShape, u: int, local_tokens: float, hw: Hardware) -> tuple[float, float, float]:
    """(fwd seconds, bwd seconds, bytes sent per rank fwd+bwd) of the USP-style head all-to-alls
    over ``u`` ranks (``yunchang`` / MagiAttention's baselines ``_varlen_all2all_before/after_attn``):
    q, k, v and out forward, dout, dq, dk, dv backward (the same four shapes), each with its
    ``t h d -> h t d`` rearrange before and the inverse after (``Hardware.a2a_copy_time``: 4 × the
    whole tensor through HBM), as ``sim.methods._a2a_times`` prices them."""
    if u <= 1:
        return 0.0, 0.0, 0.0
    hkv = kv_heads_exchanged(shape.num_heads, shape.num_kv_heads, u)  # replicated copies travel
    b = shape.dtype_bytes

    def per_peer(heads: int, dim: int) -> float:
        return local_tokens * (heads // u) * dim * b

    sizes = [per_peer(shape.num_heads, shape.head_dim), per_peer(hkv, shape.head_dim), per_peer(hkv, shape.head_dim_v),
             per_peer(shape.num_heads, shape.head_dim_v)]
    t = sum(_a2a_seconds(x, u, hw) + hw.a2a_copy_time(x * u) for x in sizes)
    return t, t, 2 * (u - 1) * sum(sizes)


def _ring(env: _PricingInputs, r: int, link: LinkClass, *, pad_compute: bool,
          merge_every_fwd_step: bool) -> tuple[float, float, float, np.ndarray, int]:
    """The per-document zigzag KV ring over ``r`` ranks on ``env.shape``'s heads (the heads one
    ring rank holds), documents padded to ``2·env.P`` and split in 2r chunks (``c = padded /
    2r``): (fwd s, bwd s, bytes sent per rank fwd+bwd, forward pairs per ring rank ``[r]``,
    rounds). Compute: one call per rank and step at its blocks' shapes with the step's merges
    (``kernel_blocks.zigzag_ring_steps``; ``merge_every_fwd_step`` for MagiAttention's
    ``FA3RingAttnFunc``, which corrects every step's output after the loop), the kernel slowed
    by ``overlap_slowdown`` beside a transfer. Forward rounds 0..r−2 carry the KV; backward
    round s carries the KV of step s+1 and the dKV of step s−1, and the last step's dKV travels
    after it, exposed (the order of ``sim.schedules.ring_schedule``)."""
    P = env.P
    lengths = env.lengths
    padded = -(-lengths // (2 * P)) * (2 * P) if P > 1 else lengths
    c = padded.astype(np.float64) / (2 * r)
    steps = zigzag_ring_steps(env, r, c, pad_compute=pad_compute, merge_every_fwd_step=merge_every_fwd_step)
    kv = 2 * float(c.sum()) * env.row_bytes(Wire.KV)
    fwd_round = np.zeros((r, 1))
    fwd_round[: r - 1] = kv
    bwd_round = np.zeros((r, 1))
    if r > 1:
        bwd_round[0] = kv
        bwd_round[1 : r - 1] = 2 * kv
        bwd_round[r - 1] = kv
    lk, slow = _Link(env.hw, link, r), env.hw.overlap_slowdown
    tf, nf = _rounds_time(lk, steps.fwd.kernel, fwd_round, fwd_round, steps.fwd.fixed, slow)  # type: ignore[arg-type]
    tb, nb = _rounds_time(lk, steps.bwd.kernel, bwd_round, bwd_round, steps.bwd.fixed, slow)  # type: ignore[arg-type]
    if r > 1:  # the last step's dKV leaves after its compute: one more round, nothing to hide it
        tb += kv / lk.p2p_bw + lk.lat
        nb += 1
    sent = float(fwd_round.sum() + bwd_round.sum() + (kv if r > 1 else 0.0))
    return tf, tb, sent, steps.pairs.sum(axis=0), nf + nb


class _Link:
    """The fields ``flat._rounds_time`` reads: the rate of one point-to-point stream over ``link``
    in a ring of ``comm_size`` ranks (``Hardware.p2p_bandwidth``: NCCL's channels per network
    peer) and the link's latency."""

    def __init__(self, hw: Hardware, link: LinkClass, comm_size: int) -> None:
        self.p2p_bw = hw.p2p_bandwidth(link, comm_size)
        self.lat = hw.latency(link)


# ---------------------------------------------------------------- the five methods
def _price_te_a2a(env: _PricingInputs) -> BaselineCost:
    """TE's a2a CP (module docstring): compute is ONE varlen call per phase on H/P heads over
    every whole document (``AttnFuncWithCPAndQKVOA2A`` calls the fused / flash kernel once on
    the gathered sequence, real tokens), a causal l × l block each, no merge — like
    ``flat._price_ulysses``."""
    P, shape, hw, link = env.P, env.shape, env.hw, env.link
    lengths = env.lengths.astype(np.float64)
    padded = -(-env.lengths // (2 * P)) * (2 * P) if P > 1 else env.lengths
    local = float(padded.sum()) / P
    b = shape.dtype_bytes

    def per_peer(heads: int, dim: int) -> float:
        return local * (heads // P) * dim * b

    q, k, v = per_peer(shape.num_heads, shape.head_dim), per_peer(shape.num_kv_heads, shape.head_dim), per_peer(shape.num_kv_heads, shape.head_dim_v)
    o = per_peer(shape.num_heads, shape.head_dim_v)
    # forward: q, k, v in one flash_attn_a2a_communicate call, out in another; backward: dout, then dq, dk, dv
    comm_f = _te_a2a_pipeline_seconds([q, k, v], P, hw, link) + _te_a2a_pipeline_seconds([o], P, hw, link)
    comm_b = _te_a2a_pipeline_seconds([o], P, hw, link) + _te_a2a_pipeline_seconds([q, k, v], P, hw, link)
    sent = 2 * (P - 1) * (q + k + v + o)
    pairs = _causal_pairs(env.lengths) / P
    f, g = (env.calls(lengths, lengths, staircase_pairs(lengths), ph, head_split=P) for ph in Phase)
    return BaselineCost(method="te_a2a", fwd_time=comm_f + float(f.kernel + f.fixed), bwd_time=comm_b + float(g.kernel + g.fixed),
                        bytes_sent=np.full(P, sent), bytes_recv=np.full(P, sent), work=np.full(P, pairs),
                        steps=0 if P == 1 else 8,
                        note=f"documents padded to 2P={2 * P} ({int(padded.sum()) - int(env.lengths.sum())} pad tokens travel, "
                             "not computed); kernel-model priced")


def _price_usp_like(method: str, env: _PricingInputs, intra: int, inter: int, gpus_per_node: int) -> BaselineCost:
    P, shape, hw = env.P, env.shape, env.hw
    ring_env = replace(env, shape=split_heads(shape, intra))  # the heads one rank holds after the all-to-all
    padded = -(-env.lengths // (2 * P)) * (2 * P) if P > 1 else env.lengths
    a_f, a_b, a_bytes = _a2a_phase(shape, intra, float(padded.sum()) / P, hw)
    pad_compute = method == "te_a2a_p2p"
    fa3 = method != "te_a2a_p2p"  # USP and LoongTrain run MagiAttention's FA3 rings (FA3RingAttnFunc / FA3DoubleRingAttnFunc)
    if method == "loongtrain" and inter > 1:
        tf, tb, r_bytes, pairs, rounds = _double_ring(ring_env, inter, intra, env.link, gpus_per_node)
    else:
        tf, tb, r_bytes, pairs, rounds = _ring(ring_env, inter, env.link, pad_compute=pad_compute, merge_every_fwd_step=fa3)
    sent = np.full(P, a_bytes + r_bytes)
    return BaselineCost(method=method, fwd_time=a_f + tf, bwd_time=a_b + tb, bytes_sent=sent, bytes_recv=sent.copy(),
                        work=np.repeat(pairs / max(intra, 1), intra), steps=rounds + (8 if intra > 1 else 0),
                        note=f"{intra}x{inter}: all-to-all over {intra}, {'double ' if method == 'loongtrain' else ''}ring over {inter}"
                             + ("; padding computed" if pad_compute else "") + "; kernel-model priced")


def _double_ring(env: _PricingInputs, r: int, u: int, link: LinkClass,
                 gpus_per_node: int) -> tuple[float, float, float, np.ndarray, int]:
    """LoongTrain's double ring (module docstring): window ``w`` of ring ranks; the inner step i
    of window k computes like ring step ``k·w + i`` (its calls and merges from
    ``kernel_blocks.zigzag_ring_steps``, FA3 on the real tokens, every forward step's output
    corrected after the loop as ``FA3DoubleRingAttnFunc`` does) and overlaps the inner transfer
    (NVLink when the window shares a node); the window overlaps its outer transfer (``link``).
    A step lasts as long as its slowest rank; its kernels run ``overlap_slowdown`` slower while
    an inner or outer transfer is in flight."""
    hw, P = env.hw, env.P
    w = window_size(r, u, gpus_per_node)
    nw = r // w
    padded = -(-env.lengths // (2 * P)) * (2 * P)
    c = padded.astype(np.float64) / (2 * r)
    steps = zigzag_ring_steps(env, r, c, pad_compute=False, merge_every_fwd_step=True)
    kv = 2 * float(c.sum()) * env.row_bytes(Wire.KV)
    inner = LinkClass.NVLINK if w * u <= gpus_per_node else link
    # point-to-point streams of the ring's communicator (r ranks, as the simulator's double ring)
    inner_bw, outer_bw = hw.p2p_bandwidth(inner, r), hw.p2p_bandwidth(link, r)
    total = {}
    rounds = 0
    for ph, moved, cost in ((Phase.FWD, kv, steps.fwd), (Phase.BWD, 2 * kv, steps.bwd)):
        t = 0.0
        for k in range(nw):
            win = 0.0
            for i in range(w):
                s = k * w + i
                busy = cost.kernel[s] * (1.0 + hw.overlap_slowdown * (i + 1 < w or k + 1 < nw)) + cost.fixed[s]
                comp = float(busy.max())
                if i + 1 < w:
                    win += max(comp, moved / inner_bw) + hw.latency(inner)
                    rounds += 1
                else:
                    win += comp
            if k + 1 < nw:
                win = max(win, moved / outer_bw + hw.latency(link))
                rounds += 1
            t += win
        total[ph] = t
    sent = (w - 1) * nw * 3 * kv + (nw - 1) * 3 * kv
    return total[Phase.FWD], total[Phase.BWD], sent, steps.pairs.sum(axis=0), rounds


def _price_hybrid(env: _PricingInputs, gpus_per_node: int) -> BaselineCost:
    """Megatron hybrid CP (module docstring): a ``g = 1`` sample is one ``flash_attn_func``
    call per phase (a causal l × l block; MagiAttention's ``hybrid_dcp.py`` ``apply_fwd_attn``),
    a ``g > 1`` sample its own ``RingAttnP2P`` — the FA3 zigzag ring of ``_ring`` over ``g``
    ranks on the real tokens — one sample after another within a stage."""
    P, shape, hw, link = env.P, env.shape, env.hw, env.link
    fwd = bwd = 0.0
    work = np.zeros(P)
    sent = np.zeros(P)
    stages = hybrid_stages(env.lengths, P)
    for stage in stages:
        busy_f = np.zeros(P)
        busy_b = np.zeros(P)
        for n, first, g in stage:
            if g == 1:
                one = np.array([float(n)])
                pairs = _causal_pairs(one)
                f, b = (env.calls(one, one, staircase_pairs(one), ph) for ph in Phase)
                busy_f[first] += float(f.kernel + f.fixed)
                busy_b[first] += float(b.kernel + b.fixed)
                work[first] += pairs
                continue
            lk = LinkClass.NVLINK if g <= gpus_per_node and first // gpus_per_node == (first + g - 1) // gpus_per_node else link
            sample = _PricingInputs(cu=np.array([0, n], dtype=np.int64), P=g, shape=shape, hw=hw, link=lk, impl="fa3")
            tf, tb, b_sent, pairs, _ = _ring(sample, g, lk, pad_compute=False, merge_every_fwd_step=True)
            busy_f[first : first + g] += tf
            busy_b[first : first + g] += tb
            work[first : first + g] += pairs
            sent[first : first + g] += b_sent
        barrier = hw.latency(link) if P > 1 else 0.0
        fwd += float(busy_f.max()) + barrier
        bwd += float(busy_b.max()) + barrier
    return BaselineCost(method="hybrid_cp", fwd_time=fwd, bwd_time=bwd, bytes_sent=sent, bytes_recv=sent.copy(), work=work,
                        steps=2 * len(stages), note=f"{len(stages)} stage(s) of per-sample CP groups (8K tokens per rank); kernel-model priced")


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
    cu = np.concatenate(([0], np.cumsum(np.diff(cu)[np.diff(cu) > 0])))  # empty documents dropped
    gpn = gpus_per_node or hardware.gpus_per_node
    P = intra * inter
    # USP, LoongTrain and hybrid CP run MagiAttention's FA3 rings (their fused correction), TE its own
    env = _PricingInputs(cu=cu, P=P, shape=shape, hw=hardware, link=link, impl="te" if method.startswith("te_") else "fa3")
    if method == "te_a2a":
        return _price_te_a2a(env)
    if method == "hybrid_cp":
        return _price_hybrid(env, gpn)
    if method == "usp":  # USP fixes its own split: the largest all-to-all inside a node
        intra = usp_degree(P, shape, gpn)
        inter = P // intra
    if not heads_split_ok(shape, intra):
        return None
    return _price_usp_like(method, env, intra, inter, gpn)

"""Head chunks of the intra all-to-all: the valid counts, their estimated time and the count a plan
runs with (docs/design.md §2.2 "Head chunks", §4).

``HSAPAttention`` (``runtime/hsap.py``) splits the ``h = H/P_intra`` q heads and ``hkv`` kv heads a
rank holds after the all-to-all (``plan.shape``; kv heads replicated when ``P_intra > Hkv``) into
``C = plan.head_chunks`` q chunks and pipelines them: while SAP computes chunk ``k``, the
all-to-all of chunk ``k+1`` (q, k, v forward; dO backward) and the return of chunk ``k−1`` (o;
dq, dk, dv) are in flight on the intra group.

**Rule** (:func:`valid_head_chunks`): ``C`` divides ``h`` and either divides ``hkv`` or is a
multiple of it. Chunk ``c`` holds q heads ``[c·h/C, (c+1)·h/C)`` and kv chunk ``c·Ckv // C`` of
``Ckv = min(C, hkv)`` (:func:`kv_head_chunks`): ``hkv/Ckv`` kv heads, exactly those its q heads
use (``h/hkv`` q heads per kv head). Each chunk is one SAP run of the same programs at
:func:`chunk_shape` (``h/C`` q, ``hkv/Ckv`` kv heads).

* ``C | hkv`` (``Ckv = C``): every message and slot shrinks by ``C``; the P2P bytes summed over
  the chunks equal the plan's.
* ``hkv | C`` (``C > hkv``; e.g. one kv head per rank, ``P_intra ≥ Hkv`` under GQA): a kv chunk
  serves ``C/Ckv`` consecutive q chunks. Its all-to-all travels once, with its first q chunk; its
  dk, dv are summed over its q chunks (fp32) and return once, after its last. SAP's kv-side
  messages (``KV``, ``DKV``: :data:`KV_WIRES`) shrink only by ``Ckv``, so each q chunk re-sends
  them: P2P bytes = q-side + kv-side · ``C/Ckv`` (:func:`chunked_p2p_bytes`) — the price the
  estimate weighs against the hidden all-to-all.

Every count ``C > 1`` prices its chunk's SAP at the chunk's shape (:func:`chunk_phase_times`: the
``C`` passes as one longest path), not as ``1/C`` of the plan's: chunked, a pass's P2P waits and
kernel rates do not scale by ``1/C`` (Table 4 fineweb 64K 2x4 s2, backward: the balanced
owner-computes plan waits 0.46 ms on P2P chunked; priced as ``1/C`` the planner kept it, 1.9% slower
in simulation than the contiguous plan; priced per chunk both layer estimates are within 1.1% of
the simulator's and the faster one is kept).

The all-to-all bytes do not depend on ``C``.

**Choice** (:func:`resolve_head_chunks`): ``options.head_chunks`` when given; else 1 when
``P_intra = 1`` (no all-to-all); else the valid count of least ``pipeline.pipelined_time`` summed
over forward and backward (ties: fewer chunks). ``P_inter = 1`` (pure Ulysses) is priced the same
way: the local attention of chunk ``k`` hides the all-to-alls of its neighbours just as SAP does.
A count is re-priced only when a lower bound of its estimate does not already lose
(:func:`choose_head_chunks`, :func:`chunk_sap_floor`): the same count as pricing every one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.calls import call_counts
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.block_costs import block_costs
from megatron_hsap.plan.codegen import new_message, wire_bytes
from megatron_hsap.plan.estimate import PhaseTime, rows_of, phase_time
from megatron_hsap.plan.pipeline import PipelinePhase, pipelined_time
from megatron_hsap.plan.hardware import Hardware, LinkClass, link_class_for
from megatron_hsap.plan.ir import Phase, Post, Recv, Send, Wire
from megatron_hsap.plan.options import check_head_chunks, kv_head_chunks, valid_head_chunks  # rule: defined there; re-exported
from megatron_hsap.plan.placement import CostRates, plan_rates
from megatron_hsap.plan.traffic import same_node

if TYPE_CHECKING:
    from megatron_hsap.plan.options import PlanOptions
    from megatron_hsap.plan.plan_type import Plan

__all__ = [
    "valid_head_chunks",
    "kv_head_chunks",
    "check_head_chunks",
    "KV_WIRES",
    "chunk_shape",
    "chunked_p2p_bytes",
    "chunk_phase_times",
    "intra_link",
    "a2a_call_bytes",
    "a2a_bytes_sent",
    "a2a_layer_floor",
    "pipeline_phases",
    "head_chunk_estimates",
    "head_chunk_estimate",
    "chunk_sap_floor",
    "choose_head_chunks",
    "choose_head_chunks_timed",
    "layer_estimate",
    "resolve_head_chunks",
]

# P2P wires whose rows carry kv heads: they shrink by Ckv per chunk, the others by C
KV_WIRES = frozenset({Wire.KV, Wire.DKV})


def chunk_shape(shape: HeadShape, chunks: int) -> HeadShape:
    """The head shape of one of ``chunks`` head chunks of ``shape`` (the rule above): ``h/C`` q and
    ``hkv/Ckv`` kv heads, the same head sizes and dtype. The executor and the simulator both use it."""
    if chunks < 1 or chunks not in valid_head_chunks(shape.num_heads, shape.num_kv_heads):
        raise ConfigError(f"{chunks} head chunks do not split {shape.num_heads} q / {shape.num_kv_heads} kv heads "
                          f"evenly; valid: {valid_head_chunks(shape.num_heads, shape.num_kv_heads)}")
    kv = kv_head_chunks(chunks, shape.num_kv_heads)
    return shape if chunks == 1 else replace(shape, num_heads=shape.num_heads // chunks,
                                             num_kv_heads=shape.num_kv_heads // kv)


def _chunk_nbytes(nbytes: int, wire: Wire, shape: HeadShape, part: HeadShape) -> int:
    """One chunk's bytes of a message of ``nbytes`` at ``shape`` (rows × the chunk's row bytes)."""
    return nbytes // shape.token_bytes(wire) * part.token_bytes(wire)


def chunked_p2p_bytes(plan: "Plan") -> dict[Phase, tuple[np.ndarray, np.ndarray]]:
    """P2P bytes each inter rank sends and receives per phase, ``{phase: (sent [P], recv [P])}``,
    all ``plan.head_chunks`` chunks together: q-side wires as the plan's, kv-side wires
    (:data:`KV_WIRES`) ``C/Ckv`` times (each q chunk re-sends its kv chunk's rows). What the
    executors count (``PhaseStats.bytes_sent`` / ``bytes_recv`` summed over the chunks)."""
    c = plan.head_chunks if plan.intra_size > 1 else 1
    part = chunk_shape(plan.shape, c)
    out = {}
    for ph in (Phase.FWD, Phase.BWD):
        sent = np.zeros(plan.inter_size, dtype=np.int64)
        recv = np.zeros(plan.inter_size, dtype=np.int64)
        for r in range(plan.inter_size):
            for ins in plan.program(r, ph).instrs:
                if isinstance(ins, Post):
                    for op in ins.round.ops:
                        n = _chunk_nbytes(op.nbytes, op.wire, plan.shape, part) * c
                        if isinstance(op, Send):
                            sent[r] += n
                        elif isinstance(op, Recv):
                            recv[r] += n
        out[ph] = (sent, recv)
    return out


def chunk_phase_times(plan: "Plan", chunks: int) -> tuple[PhaseTime, PhaseTime]:
    """The plan's estimate (``estimate.phase_time``, forward and backward) of its SAP run as
    ``chunks`` head chunks back to back: the same staged blocks and messages at
    :func:`chunk_shape` — kernels at the chunk's heads and GQA group, q-side messages ``1/C``,
    kv-side ``1/Ckv`` of the plan's — repeated ``C`` times as one longest path (``repeat``:
    ranks run ahead into the next chunk as the runtime's do). ``total`` covers all chunks."""
    part = chunk_shape(plan.shape, chunks)
    hw, link = plan.hardware, plan.link
    rates = _chunk_rates(plan, part)
    units = list(plan.chosen.units)
    full, sub = wire_bytes(plan.shape), wire_bytes(part)  # one chunk's bytes: rows × the chunk's row bytes
    times = []
    for ph, code, sec in ((Phase.FWD, plan.chosen.fwd, rates.sec_fwd), (Phase.BWD, plan.chosen.bwd, rates.sec_bwd)):
        msgs = [new_message(m.round, m.src, m.dst, m.wire, m.tokens, m.nbytes // full[m.wire] * sub[m.wire], m.part)
                for m in code.messages]
        times.append(phase_time(units, msgs, plan.inter_size, sec, rates.bw, hw.latency(link), rates=rates, phase=ph,
                                repeat=chunks))
    return times[0], times[1]


def _chunk_rates(plan: "Plan", part: HeadShape) -> CostRates:
    """The plan's rates at the chunk's shape ``part``, as ``compile_plan`` built them."""
    return plan_rates(part, plan.hardware, plan.link, plan.options, plan.layout.segment_starts())


def chunk_sap_floor(plan: "Plan", chunks: int) -> tuple[float, float]:
    """Lower bounds of ``PipelinePhase.chunk_sap_s`` (forward, backward) at ``chunks`` head chunks,
    without pricing the ``C`` passes' longest path (:func:`chunk_phase_times`, most of its cost).

    Why it is a bound: ``rank_path``'s recurrence gives each rank ``r`` and round ``k``
    ``t_r(k+1) ≥ t_r(k) + max(compute_r(k), x_r(k)) + after_r(k)``, where ``x_r(k)`` is 0 if ``r``
    has no transfer in round ``k``, else ``latency + max over r's ports of their bytes / bandwidth``
    (every transfer of ``r`` starts at ``max(t_s, t_d) + latency ≥ t_r(k) + latency``, and a port's
    drain is at least its earliest start plus all its bytes over its bandwidth). Summed over the
    ``C`` identical passes, ``total ≥ C · max_r S_r`` with ``S_r = Σ_k max(compute, x) + after``,
    so ``chunk_sap_s = total/C − launch ≥ max_r S_r − launch``. Compute, merges, launches and bytes
    are ``phase_time``'s own at the chunk's shape (``block_costs``, the chunk's message bytes), so
    nothing about the kernel model is assumed; shaved by 1e-9 for summation order."""
    part = chunk_shape(plan.shape, chunks)
    rates = _chunk_rates(plan, part)
    if rates.kernel is None:
        return 0.0, 0.0
    size, lat = plan.inter_size, plan.hardware.latency(plan.link)
    a, groups = rows_of(list(plan.chosen.units), size, rates)
    n = 2 + int(a[:, 1].max(initial=0))
    same = same_node(rates, size)
    bws = np.array([rates.bw, rates.nvl_bw if rates.nvl_bw > 0 else rates.bw])[:, None, None]
    full, sub = wire_bytes(plan.shape), wire_bytes(part)
    out = []
    for ph, code in ((Phase.FWD, plan.chosen.fwd), (Phase.BWD, plan.chosen.bwd)):
        m = code.messages
        rnd, src, dst = (np.fromiter((getattr(x, f) for x in m), dtype=np.int64, count=len(m)) for f in ("round", "src", "dst"))
        nb = np.fromiter((x.nbytes // full[x.wire] * sub[x.wire] for x in m), dtype=np.float64, count=len(m))
        link = same[src, dst].astype(np.int64) if same is not None else np.zeros(len(m), dtype=np.int64)

        def per_port(end: np.ndarray, keep: np.ndarray) -> np.ndarray:
            idx = ((link * size + end) * n + rnd)[keep]
            return np.bincount(idx, weights=nb[keep], minlength=2 * size * n).reshape(2, size, n)

        every = np.ones(len(m), dtype=bool)
        sent, recv = per_port(src, every), per_port(dst, every)  # as message_traffic counts them (the slowdown)
        bc = block_costs(a, size, n, rates, ph, groups(n) if len(a) else None)
        comp = bc.seconds(sent.sum(axis=0), recv.sum(axis=0), rates.overlap_slowdown)
        flows = (src != dst) & (nb > 0)  # the transfers the path prices (rank_path.flows_of)
        fs, fr = per_port(src, flows), per_port(dst, flows)
        port = np.maximum(fs / bws, fr / bws).max(axis=0)
        x = np.where((fs + fr).sum(axis=0) > 0, lat + port, 0.0)
        s_r = (np.maximum(comp, x) + bc.after).sum(axis=1)
        out.append(float(s_r.max(initial=0.0)) * (1 - 1e-9) - float(bc.launch.max(initial=0.0)))
    return out[0], out[1]


# all_to_all_single calls per chunk before / after SAP (runtime/hsap.py): q, k, v in and o out
# forward; dO in and dq, dk, dv out backward
_CALLS = {Phase.FWD: (("q", "k", "v"), ("o",)), Phase.BWD: (("o",), ("q", "k", "v"))}


def intra_link(opts: "PlanOptions") -> LinkClass:
    """The intra group's link: NVLink when its ``tp_size × intra_size`` GPUs fit one node."""
    return link_class_for(opts.tp_size * opts.intra_size, opts.gpus_per_node)


def a2a_call_bytes(plan: "Plan") -> dict[str, int]:
    """Bytes one rank sends in the all-to-all of each tensor, all chunks together: ``{"q", "k",
    "v", "o"}`` (``t_local`` rows of ``h`` (or ``hkv``) heads to each of the ``P_intra − 1`` peers;
    dO, dq, dk, dv have the shapes of o, q, k, v)."""
    return _call_bytes(plan.shape, plan.intra_size, plan.local_tokens)


def _call_bytes(s: HeadShape, p: int, local_tokens: int) -> dict[str, int]:
    """``a2a_call_bytes`` of a plan with head shape ``s``, ``p`` intra ranks and ``local_tokens``."""
    row = local_tokens * (p - 1) * s.dtype_bytes
    return {"q": row * s.num_heads * s.head_dim, "k": row * s.num_kv_heads * s.head_dim,
            "v": row * s.num_kv_heads * s.head_dim_v, "o": row * s.num_heads * s.head_dim_v}  # fmt: skip


def a2a_bytes_sent(plan: "Plan") -> dict[str, int]:
    """Intra all-to-all bytes one rank sends per phase, ``{"fwd", "bwd"}`` (whatever the chunk count)."""
    b = a2a_call_bytes(plan)
    return {ph.value: sum(b[n] for side in _CALLS[ph] for n in side) for ph in (Phase.FWD, Phase.BWD)}


def _kernel_calls(plan: "Plan", phase: Phase) -> int:
    """Most varlen kernel calls one inter rank makes in ``phase`` (``plan/calls.py``: the calls the
    runtime launches and the simulator prices)."""
    return max(call_counts(plan, phase), default=0)


def pipeline_phases(plan: "Plan", chunks: int = 1) -> dict[Phase, PipelinePhase]:
    """The inputs of ``pipeline.pipelined_time`` per phase at ``chunks`` head chunks: the plan's
    SAP estimate, its round latencies and kernel launches (paid again by every chunk), the
    all-to-all bytes and calls (those of k, v forward and dk, dv backward marked as the kv
    side), and — at ``C > 1`` — the mean chunk's SAP re-priced at its shape
    (:func:`chunk_phase_times`: waits, kernel rates and, where q chunks share a kv chunk, kv-side
    traffic do not shrink as ``1/C``)."""
    return _phases_at(plan, _base_phases(plan), chunks)


def _phases_at(plan: "Plan", base: dict[Phase, PipelinePhase], chunks: int) -> dict[Phase, PipelinePhase]:
    """``pipeline_phases`` from its count-free part ``base`` (:func:`_base_phases`)."""
    if not _repriced(plan, chunks):
        return base
    parts = chunk_phase_times(plan, chunks)
    return _with_chunk_sap(base, {Phase.FWD: _chunk_sap(parts[0], chunks), Phase.BWD: _chunk_sap(parts[1], chunks)})


def _repriced(plan: "Plan", chunks: int) -> bool:
    """Whether a chunk's SAP is re-priced at its shape (every count above 1, with an all-to-all)."""
    return plan.intra_size > 1 and chunks > 1


def _chunk_sap(part: PhaseTime, chunks: int) -> float:
    """One chunk's SAP seconds without launches, from the ``C`` passes priced together."""
    return (part.total - chunks * part.launch) / chunks


def _with_chunk_sap(base: dict[Phase, PipelinePhase], sap: dict[Phase, float]) -> dict[Phase, PipelinePhase]:
    return {ph: replace(p, chunk_sap_s=sap[ph]) for ph, p in base.items()}


def _base_phases(plan: "Plan") -> dict[Phase, PipelinePhase]:
    """``pipeline_phases`` without a chunk's own SAP price: every field but ``chunk_sap_s`` is the
    same at every chunk count (so the choice builds them once)."""
    hw = plan.hardware
    sides = _a2a_sides(plan.shape, plan.intra_size, plan.local_tokens, hw)
    return {ph: replace(sides[ph], sap_s=pt.total - pt.launch, latency_s=pt.latency, launch_s=_kernel_calls(plan, ph) * hw.kernel.launch_s,
                        overlap_slowdown=hw.overlap_slowdown, kernel_share=_kernel_share(pt))
            for ph, pt in ((Phase.FWD, plan.chosen.fwd_time), (Phase.BWD, plan.chosen.bwd_time))}  # fmt: skip


def _a2a_sides(shape: HeadShape, p: int, local_tokens: int, hw: Hardware) -> dict[Phase, PipelinePhase]:
    """Per phase, the all-to-all fields of ``PipelinePhase`` (bytes, calls, copies) of a plan with
    head shape ``shape``, ``p`` intra ranks and ``local_tokens`` per rank; its SAP fields zero (no
    SAP time, latency, launches or slowdown)."""
    b = _call_bytes(shape, p, local_tokens)
    out = {}
    for ph in (Phase.FWD, Phase.BWD):  # copies: 4 × each whole tensor, P/(P−1) × the bytes sent (Hardware.a2a_copy_time)
        before, after = _CALLS[ph]
        sent_in, sent_out = sum(b[n] for n in before), sum(b[n] for n in after)
        out[ph] = PipelinePhase(sap_s=0.0, latency_s=0.0, launch_s=0.0,
                                in_bytes=sent_in, out_bytes=sent_out,
                                in_calls=len(before), out_calls=len(after),
                                in_copy_s=hw.a2a_copy_time(sent_in * p / max(1, p - 1)),
                                out_copy_s=hw.a2a_copy_time(sent_out * p / max(1, p - 1)),
                                kv_in_bytes=sum(b[n] for n in before if n in ("k", "v")),
                                kv_out_bytes=sum(b[n] for n in after if n in ("k", "v")),
                                kv_in_calls=sum(n in ("k", "v") for n in before), kv_out_calls=sum(n in ("k", "v") for n in after),
                                overlap_slowdown=0.0, kernel_share=0.0)  # fmt: skip
    return out


def a2a_layer_floor(opts: "PlanOptions", shape: HeadShape, local_tokens: int, hw: Hardware) -> float:
    """A lower bound (seconds) of ``Plan.layer_time`` of every plan with options ``opts`` (``P_intra
    > 1``), head shape ``shape`` (``plan.shape``) and ``local_tokens`` (``plan.local_tokens``),
    whatever its SAP and chunk count: the least over the valid counts of ``pipelined_time`` with the
    all-to-alls alone — no SAP seconds, round latency, launches or slowdown beside them. Each of
    those only adds: ``pipelined_time`` is a longest path over the side stream and the chunks,
    non-decreasing in a chunk's SAP seconds (as ``choose_head_chunks_timed``'s zero bound reads it)
    and in the slowdown it adds to them. ``compile_plan`` skips the one-all-to-all plan (``P × 1``)
    when this is no lower than a plan already compiled (``flatten.a2a_cannot_win``): at fineweb
    64K / P 8 it is 2.34 ms against that plan's 2.8-3.1 ms and the SAP plans' 1.6-2.2 ms."""
    sides = _a2a_sides(shape, opts.intra_size, local_tokens, hw)
    link = _a2a_link_of(opts, hw)
    return min(_pipelined_on(sides, c, link, shape.num_kv_heads) for c in valid_head_chunks(shape.num_heads, shape.num_kv_heads))


def _kernel_share(pt: PhaseTime) -> float:
    """Of a SAP phase's estimated seconds, the share its kernels run (the slowest rank's compute
    per stage, summed: the rest is waiting on transfers, which NCCL's contention does not stretch)."""
    total = pt.total - pt.launch
    return min(1.0, float(pt.compute.sum()) / total) if total > 0 else 1.0


def _a2a_link_of(opts: "PlanOptions", hw: Hardware) -> tuple[float, float]:
    """(bandwidth, latency) of the intra all-to-all of a plan with options ``opts`` on ``hw``."""
    link = intra_link(opts)
    return hw.a2a_bandwidth(link), hw.latency(link)


def _pipelined(plan: "Plan", phases: dict[Phase, PipelinePhase], chunks: int) -> float:
    return _pipelined_on(phases, chunks, _a2a_link_of(plan.options, plan.hardware), plan.shape.num_kv_heads)


def _pipelined_on(phases: dict[Phase, PipelinePhase], chunks: int, link: tuple[float, float], kv_heads: int) -> float:
    """Forward + backward ``pipelined_time`` of ``phases`` at ``chunks`` q head chunks over the
    all-to-all ``link`` (bandwidth, latency), ``kv_heads`` kv heads per rank."""
    bw, lat = link
    kv = kv_head_chunks(chunks, kv_heads)
    return sum(pipelined_time(ph, chunks, bw, lat, kv) for ph in phases.values())


def head_chunk_estimates(plan: "Plan") -> dict[int, float]:
    """Estimated forward + backward seconds of the intra all-to-all pipelined with SAP, per valid
    chunk count (``C = 1``: the all-to-alls before and after SAP fully exposed); every count
    priced in full (the choice, :func:`choose_head_chunks`, skips hopeless ones)."""
    if plan.intra_size == 1:
        return {1: plan.chosen.time}
    base = _base_phases(plan)
    return {c: _pipelined(plan, _phases_at(plan, base, c), c) for c in valid_head_chunks(plan.shape.num_heads, plan.shape.num_kv_heads)}


def head_chunk_estimate(plan: "Plan", chunks: int) -> float:
    """``head_chunk_estimates(plan)[chunks]``, pricing that count only."""
    if plan.intra_size == 1:
        return plan.chosen.time
    return _pipelined(plan, pipeline_phases(plan, chunks), chunks)


def choose_head_chunks_timed(plan: "Plan") -> tuple[int, float]:
    """The valid count of least :func:`head_chunk_estimates` (ties: fewer chunks; a count must beat
    the best so far by more than 1e-9 relative, in ascending order) and its estimate (the
    layout choice's layer time, ``Plan.layer_time``), without pricing every count
    in full: a count whose lower bound already fails that test cannot be chosen, so it is skipped.
    A count's bound is the pipeline price (``pipelined_time``, non-decreasing in ``chunk_sap_s``) at a ``chunk_sap_s`` no
    larger than the true one: first 0 (a chunk's SAP takes no negative time: its path runs
    through every stage of a rank, launches included), then :func:`chunk_sap_floor`; shaved by
    1e-9. Only a count that survives both is re-priced (:func:`chunk_phase_times`). At 1,024 GPUs
    (8 × 128, slimpajama, GQA 64:8: one kv head per rank, C = 2, 4, 8 all share it and all lose)
    the zero bound skips C = 4 and 8 at 1M and 2M, the floor (5–22% below the price) the rest
    but C = 2 at 4M (floor 6.77 ms, C = 1 7.10 ms, C = 2 7.15 ms), which is re-priced."""
    base = _base_phases(plan)
    best, best_t = 1, _pipelined(plan, base, 1)
    for c in sorted(valid_head_chunks(plan.shape.num_heads, plan.shape.num_kv_heads)):
        if c == 1:
            continue
        bar = best_t * (1 - 1e-9)
        if _repriced(plan, c):
            zero = {Phase.FWD: 0.0, Phase.BWD: 0.0}
            if _pipelined(plan, _with_chunk_sap(base, zero), c) * (1 - 1e-9) >= bar:
                continue
            f, b = chunk_sap_floor(plan, c)
            if _pipelined(plan, _with_chunk_sap(base, {Phase.FWD: f, Phase.BWD: b}), c) * (1 - 1e-9) >= bar:
                continue
        t = _pipelined(plan, _phases_at(plan, base, c), c)
        if t < bar:
            best, best_t = c, t
    return best, best_t


def choose_head_chunks(plan: "Plan") -> int:
    """The count of :func:`choose_head_chunks_timed`."""
    return choose_head_chunks_timed(plan)[0]


def resolve_head_chunks(plan: "Plan") -> int:
    """The chunk count ``plan`` runs with (``Plan.head_chunks``; see the module docstring)."""
    forced = plan.options.head_chunks
    if forced is not None:
        return int(forced)
    if plan.intra_size == 1:  # pure SAP: no all-to-all to pipeline
        return 1
    return plan.head_chunk_choice[0]


def layer_estimate(plan: "Plan") -> float:
    """Estimated seconds of the whole HSAP layer of ``plan`` at the count it runs with
    (``plan.head_chunks``): SAP alone at ``P_intra = 1``; else the intra all-to-all pipelined with
    SAP (:func:`head_chunk_estimate`), read from the choice when it chose the count (the same
    computation: ``Plan.layer_time`` keeps it, so the layout search never prices a count twice)."""
    if plan.intra_size == 1:
        return plan.chosen.time
    if plan.options.head_chunks is not None:
        return head_chunk_estimate(plan, plan.head_chunks)
    return plan.head_chunk_choice[1]

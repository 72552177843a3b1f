"""The intra all-to-all pipelined around SAP when the heads run in head chunks (docs/design.md
§4): ``pipelined_time`` replays the runtime's issue order of the side stream's all-to-alls against
the chunks' SAP with the kernels' slowdown beside them (``plan/chunks.py`` chooses the count with
it). A chunk's SAP seconds come from the plan's estimate (``plan/estimate.py``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelinePhase", "pipelined_time"]


@dataclass(frozen=True, slots=True)
class PipelinePhase:
    """One phase of an HSAP layer as ``pipelined_time`` prices it (all of a rank's heads).

    ``sap_s``: the plan's SAP estimate (``PhaseTime.total``), of which ``latency_s`` are round
    latencies; ``launch_s``: its kernel launches (``KernelCurve.launch_s`` each, not in ``sap_s``) —
    latencies and launches are paid again by every head chunk; ``in_bytes`` / ``out_bytes``: bytes
    one rank sends in the all-to-alls before / after SAP (forward q, k, v / o; backward dO / dq,
    dk, dv), of which ``kv_in_bytes`` / ``kv_out_bytes`` are the kv tensors (k, v / dk, dv);
    ``in_calls`` / ``out_calls``: how many ``all_to_all_single`` calls each chunk issues on each
    side, ``kv_*_calls`` of them the kv tensors'. ``chunk_sap_s``: one chunk's SAP seconds
    without launches when the caller priced it at the chunk's shape (q chunks sharing a kv chunk:
    ``plan/chunks.chunk_phase_times``); None: ``(sap_s − latency_s)/C + latency_s``."""

    sap_s: float
    latency_s: float
    launch_s: float
    in_bytes: int
    out_bytes: int
    in_calls: int
    out_calls: int
    in_copy_s: float = 0.0  # HBM rearranges around the all-to-alls before / after SAP, all chunks together
    out_copy_s: float = 0.0
    kv_in_bytes: int = 0
    kv_out_bytes: int = 0
    kv_in_calls: int = 0
    kv_out_calls: int = 0
    chunk_sap_s: float | None = None
    overlap_slowdown: float = 0.0  # SAP kernels beside the side stream's all-to-all run 1 + this slower
    kernel_share: float = 1.0  # of SAP's seconds, the kernels' (what the slowdown stretches; the rest waits)


def _side(total: int, kv: int, copy_s: float, calls: int, kv_calls: int, bw: float, lat: float, chunks: int,
          kv_chunks: int, with_kv: bool) -> float:
    """Seconds of one chunk's all-to-alls on one side: the q part (``1/C`` of its bytes and copies),
    plus the kv part (``1/Ckv``) when this chunk carries it. Copies are linear in bytes."""
    copy = copy_s / total if total else 0.0
    t = (total - kv) * (1 / bw + copy) / chunks + (calls - kv_calls) * lat
    return t + (kv * (1 / bw + copy) / kv_chunks + kv_calls * lat if with_kv else 0.0)


def pipelined_time(ph: PipelinePhase, chunks: int, bw: float, call_latency: float, kv_chunks: int | None = None) -> float:
    """Seconds of one phase with the heads in ``chunks`` q chunks and ``kv_chunks`` kv chunks
    (``Ckv``, default ``C``; docs/design.md §4).

    Per chunk ``k`` (1-based; ``m = C/Ckv`` q chunks per kv chunk): all-to-all in ``A_k`` = the q
    part ``(q bytes / bw + copies)/C`` + its calls' latencies, plus the kv part ``(kv bytes / bw +
    copies)/Ckv`` + its latencies when ``k`` is a kv chunk's first (``(k−1) mod m = 0``; forward
    k, v); return ``R_k`` likewise, its kv part (backward dk, dv) when ``k`` is a kv chunk's last
    (``k mod m = 0``). ``bw``: ``Hardware.a2a_bandwidth``; copies: ``Hardware.a2a_copy_time``.
    SAP ``S = (sap_s − latency_s)/C + latency_s + launch_s`` (compute and P2P scale with the heads;
    latencies and launches do not), or ``chunk_sap_s + launch_s`` when given (kv-side P2P does not
    shrink with ``C``). The all-to-alls of one intra group run one after another on a side stream,
    in the runtime's issue order (``runtime/hsap.py``): ``A_1`` first; at the start of SAP ``k``,
    ``A_{k+1}`` then ``R_{k−1}``; ``R_C`` after the last SAP. SAP ``k`` starts once ``A_k`` has
    landed and SAP ``k−1`` ended, and the part of it that overlaps side-stream work runs ``1 +
    overlap_slowdown`` times slower (NCCL's kernels hold SMs and HBM): the simulator's schedule
    (``sim/hsap.py``, ``sim/engine.py``), replayed here in O(C²). It used to be the lockstep
    ``A_1 + Σ_k max(S, A_{k+1} + R_{k−1}) + R_C`` without contention: on the 167 benchmark batches
    est/sim 0.961–1.016 (MagiAttention median 0.980) → 0.982–1.027 (0.999) with this alone, 8
    plans simulating 0.3–1.9% faster (head-chunk counts); docs/design.md §2.2 for the rest of that
    change. ``C = 1`` is ``A + S + R`` (nothing overlaps). A rank
    sends ``(P−1)/P`` of its tensor and receives as much (full-duplex links), so its bytes sent
    over ``bw`` is the transfer time.
    """
    if chunks < 1:
        raise ValueError(f"{chunks=} must be >= 1")
    kv = chunks if kv_chunks is None else kv_chunks
    if kv < 1 or chunks % kv:
        raise ValueError(f"{kv_chunks=} must divide {chunks=}")
    m = chunks // kv
    a = [_side(ph.in_bytes, ph.kv_in_bytes, ph.in_copy_s, ph.in_calls, ph.kv_in_calls, bw, call_latency, chunks, kv,
               k % m == 0) for k in range(chunks)]  # fmt: skip
    r = [_side(ph.out_bytes, ph.kv_out_bytes, ph.out_copy_s, ph.out_calls, ph.kv_out_calls, bw, call_latency, chunks, kv,
               (k + 1) % m == 0) for k in range(chunks)]  # fmt: skip
    sap = (ph.sap_s - ph.latency_s) / chunks + ph.latency_s if ph.chunk_sap_s is None else ph.chunk_sap_s
    s = sap + ph.launch_s
    if chunks == 1:
        return a[0] + s + r[0]
    # the runtime's schedule: the side stream serves the all-to-alls in issue order (chunk 1's in
    # first; at the start of chunk k's SAP chunk k+1's in, then chunk k-1's return), SAP k starts
    # once its all-to-all landed and SAP k-1 ended, and the part of SAP that overlaps side-stream
    # work runs 1 + overlap_slowdown times slower (sim/engine.py's first-order form)
    sigma = ph.overlap_slowdown
    side: list[tuple[float, float]] = []
    free = 0.0

    def issue(t: float, dur: float) -> float:
        nonlocal free
        start = free if free > t else t
        free = start + dur
        side.append((start, free))
        return free

    landed = issue(0.0, a[0])
    t = 0.0
    for k in range(chunks):
        t = landed if landed > t else t
        if k + 1 < chunks:
            landed = issue(t, a[k + 1])
        if k:
            issue(t, r[k - 1])
        secs = s
        if sigma > 0:
            secs += sigma * ph.kernel_share * sum(max(0.0, min(e, t + s) - max(b, t)) for b, e in side if e > t)
        t += secs
    end = issue(t, r[-1])
    return end if end > t else t

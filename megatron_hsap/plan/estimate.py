"""The estimated time of a staged plan and its lower bounds (docs/design.md §4).

Per phase and stage ``k``: the slowest rank's ``max(compute of stage k, transfer of round k)``
plus the round's latency when the round moves anything (round ``k`` overlaps stage ``k``; the last
round returns results with nothing to hide behind). A rank's transfer time in a round is
max(bytes sent, bytes received) / bandwidth (full-duplex links).

``quick_price`` computes the same number straight from staged blocks (no messages, no slots) so
the planner can price many candidate stagings and generate code for the winner only.

``pipelined_time`` prices the intra all-to-all around SAP when the heads run in chunks
(``plan/chunks.py`` chooses the count with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.codegen import Message
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Unit, Wire
from megatron_hsap.plan.placement import Prices
from megatron_hsap.plan.schedule import Staging
from megatron_hsap.plan.units import WorkUnit

__all__ = ["PhaseTime", "phase_time", "quick_price", "price_staging", "necessary_traffic", "lower_bounds",
           "PipelinePhase", "pipelined_time"]


@dataclass(frozen=True, slots=True)
class PhaseTime:
    total: float
    compute: np.ndarray  # [stages + 1] slowest rank's compute per stage
    transfer: np.ndarray  # [stages + 1] slowest rank's transfer per round
    latency: float  # sum of round latencies
    work: np.ndarray  # [P] pairs per rank
    sent: np.ndarray  # [P] bytes
    recv: np.ndarray  # [P] bytes


def _total(comp: np.ndarray, sent: np.ndarray, recv: np.ndarray, bw: float, latency: float) -> tuple[float, float]:
    """(phase seconds, latency seconds) from [P, rounds] compute seconds and bytes."""
    xfer = np.maximum(sent, recv) / bw
    per_stage = np.maximum(comp, xfer).max(axis=0)
    lat = float((sent.sum(axis=0) > 0).sum() * latency)
    return float(per_stage.sum()) + lat, lat


def phase_time(units: list[Unit], msgs: list[Message] | tuple[Message, ...], size: int, sec_per_pair: float, bw: float, latency: float) -> PhaseTime:
    stages = 1 + max((u.stage for u in units), default=0)
    comp = np.zeros((size, stages + 1))
    work = np.zeros(size, dtype=np.int64)
    for u in units:
        w = u.work
        comp[u.rank, u.stage] += w * sec_per_pair
        work[u.rank] += w
    sent = np.zeros((size, stages + 1))
    recv = np.zeros((size, stages + 1))
    for m in msgs:
        sent[m.src, m.round] += m.nbytes
        recv[m.dst, m.round] += m.nbytes
    total, lat = _total(comp, sent, recv, bw, latency)
    return PhaseTime(
        total=total,
        compute=comp.max(axis=0),
        transfer=(np.maximum(sent, recv) / bw).max(axis=0),
        latency=lat,
        work=work,
        sent=sent.sum(axis=1),
        recv=recv.sum(axis=1),
    )


def _traffic(units, size: int, n: int, pr: Prices) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bytes sent/received per [rank, round], forward and backward, of staged remote ``units``
    (inputs deduplicated per rank, stage and range, as ``codegen.phase_messages`` does)."""
    sf = np.zeros((size, n))
    rf = np.zeros((size, n))
    sb = np.zeros((size, n))
    rb = np.zeros((size, n))
    seen: set[tuple] = set()
    # per side: (tag, input bytes fwd, input bytes bwd, result bytes fwd, result bytes bwd) per token;
    # q travels with do/lse/delta in backward and returns o+lse / dq; kv returns dkv in backward
    q_side = (0, pr.q, pr.q_bwd, pr.o_lse, pr.dq)
    kv_side = (1, pr.kv, pr.kv, 0.0, pr.dkv)
    for u in units:
        r, k = u.rank, u.stage
        for owner, rng, (tag, f_in, b_in, f_out, b_out) in ((u.q_owner, u.q, q_side), (u.kv_owner, u.kv, kv_side)):
            if r == owner:
                continue
            n = rng.stop - rng.start
            key = (r, k, owner, tag, rng.start, rng.stop)
            if key not in seen:  # an input is sent once per rank, stage and range
                seen.add(key)
                sf[owner, k - 1] += n * f_in
                rf[r, k - 1] += n * f_in
                sb[owner, k - 1] += n * b_in
                rb[r, k - 1] += n * b_in
            sf[r, k + 1] += n * f_out
            rf[owner, k + 1] += n * f_out
            sb[r, k + 1] += n * b_out
            rb[owner, k + 1] += n * b_out
    return sf, rf, sb, rb


def quick_price(units: list[Unit], size: int, pr: Prices, latency: float) -> tuple[float, float]:
    """(forward, backward) estimated seconds of staged ``units``; equals ``phase_time`` over the
    messages ``codegen.phase_messages`` would emit."""
    n = 2 + max((u.stage for u in units), default=0)
    work = np.zeros((size, n))
    for u in units:
        work[u.rank, u.stage] += u.work
    sf, rf, sb, rb = _traffic([u for u in units if not u.is_local], size, n, pr)
    fwd, _ = _total(work * pr.sec_fwd, sf, rf, pr.bw, latency)
    bwd, _ = _total(work * pr.sec_bwd, sb, rb, pr.bw, latency)
    return fwd, bwd


def price_staging(st: Staging, size: int, pr: Prices, latency: float) -> float:
    """Forward + backward estimated seconds of a staging, its local blocks counted by budget
    (pouring them splits at row granularity, which moves a stage's work by at most one row)."""
    n = st.stages + 1
    work = np.zeros((size, n))
    work[:, : st.stages] = st.remote_work + st.local_budget
    sf, rf, sb, rb = _traffic(st.remote, size, n, pr)
    fwd, _ = _total(work * pr.sec_fwd, sf, rf, pr.bw, latency)
    bwd, _ = _total(work * pr.sec_bwd, sb, rb, pr.bw, latency)
    return fwd + bwd


def necessary_traffic(units: list[WorkUnit], shape: HeadShape) -> tuple[int, int]:
    """Forward and backward bytes that must move with no balancing at all (docs/design.md §4)."""
    b = shape.token_bytes
    fwd = bwd = 0
    kv_f, q_f = b(Wire.KV), b(Wire.Q) + b(Wire.O) + b(Wire.LSE)
    kv_b = b(Wire.KV) + b(Wire.DKV)
    q_b = b(Wire.Q) + b(Wire.DO) + b(Wire.LSE) + b(Wire.DELTA) + b(Wire.DQ)
    for u in units:
        if u.q_owner == u.kv_owner:
            continue
        nq, nk = len(u.q), len(u.kv)
        fwd += min(nk * kv_f, nq * q_f)
        bwd += min(nk * kv_b, nq * q_b)
    return fwd, bwd


def compute_bound(total_work: int, size: int, sec_fwd: float, sec_bwd: float) -> float:
    """Seconds of forward + backward attention with the work spread perfectly and no traffic
    (the compute lower bound of every plan, whatever its layout)."""
    return total_work * (sec_fwd + sec_bwd) / size


def lower_bounds(total_work: int, nec_fwd: int, nec_bwd: int, size: int, shape: HeadShape, hw: Hardware, link: LinkClass) -> dict[str, float]:
    """Compute and traffic lower bounds, forward + backward, in seconds."""
    compute = compute_bound(total_work, size, shape.fwd_flops_per_pair / hw.attn_fwd_flops, shape.bwd_flops_per_pair / hw.attn_bwd_flops)
    traffic = (nec_fwd + nec_bwd) / (size * hw.bandwidth(link))
    return {"compute_s": compute, "traffic_s": traffic, "bound_s": max(compute, traffic)}


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePhase:
    """One phase of an HSAP layer as ``pipelined_time`` prices it (all of a rank's heads).

    ``sap_s``: the plan's SAP estimate (``PhaseTime.total``), of which ``latency_s`` are round
    latencies; ``launch_s``: its kernel launches (``KernelCurve.launch_s`` each, not in ``sap_s``) —
    latencies and launches are paid again by every head chunk; ``in_bytes`` / ``out_bytes``: bytes one rank sends in the all-to-alls before / after SAP
    (forward q, k, v / o; backward dO / dq, dk, dv); ``in_calls`` / ``out_calls``: how many
    ``all_to_all_single`` calls each chunk issues on each side."""

    sap_s: float
    latency_s: float
    launch_s: float
    in_bytes: int
    out_bytes: int
    in_calls: int
    out_calls: int


def pipelined_time(ph: PipelinePhase, chunks: int, bw: float, call_latency: float) -> float:
    """Seconds of one phase with the heads in ``chunks`` equal chunks (docs/design.md §4).

    Per chunk: all-to-all in ``A = in_bytes / (C·bw) + in_calls·latency``, return ``R`` likewise,
    SAP ``S = (sap_s − latency_s) / C + latency_s + launch_s`` (compute and P2P scale with the
    heads; latencies and launches do not). The all-to-alls of one intra group run one after another; while SAP computes
    chunk ``k`` the group carries chunk ``k+1``'s all-to-all and chunk ``k−1``'s return:
    ``A + Σ_k max(S, [k < C]·A + [k > 1]·R) + R``. ``C = 1`` is ``A + S + R`` (nothing hidden).
    A rank sends ``(P−1)/P`` of its tensor and receives as much (full-duplex links), so its bytes
    sent over ``bw`` is the transfer time.
    """
    if chunks < 1:
        raise ValueError(f"{chunks=} must be >= 1")
    a = ph.in_bytes / chunks / bw + ph.in_calls * call_latency
    r = ph.out_bytes / chunks / bw + ph.out_calls * call_latency
    s = (ph.sap_s - ph.latency_s) / chunks + ph.latency_s + ph.launch_s
    return a + r + sum(max(s, (a if k < chunks else 0.0) + (r if k > 1 else 0.0)) for k in range(1, chunks + 1))

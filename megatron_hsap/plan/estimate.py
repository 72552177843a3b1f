"""The estimated time of a staged plan and its lower bounds (DESIGN §4).

Per phase and stage ``k``: the slowest rank's ``max(compute of stage k, transfer of round k)``
plus the round's latency (round ``k`` overlaps stage ``k``; the last round returns results with
nothing to hide behind). A rank's transfer time in a round is max(bytes sent, bytes received) /
bandwidth (full-duplex links).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.codegen import Message
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Unit
from megatron_hsap.plan.units import WorkUnit

__all__ = ["PhaseTime", "phase_time", "necessary_traffic", "lower_bounds"]


@dataclass(frozen=True, slots=True)
class PhaseTime:
    total: float
    compute: np.ndarray  # [stages + 1] slowest rank's compute per stage
    transfer: np.ndarray  # [stages + 1] slowest rank's transfer per round
    latency: float  # sum of round latencies
    work: np.ndarray  # [P] pairs per rank
    sent: np.ndarray  # [P] bytes
    recv: np.ndarray  # [P] bytes


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
    xfer = np.maximum(sent, recv) / bw
    per_stage = np.maximum(comp, xfer).max(axis=0)
    active = (sent.sum(axis=0) > 0).astype(float)
    lat = float((active * latency).sum())
    return PhaseTime(
        total=float(per_stage.sum() + lat),
        compute=comp.max(axis=0),
        transfer=xfer.max(axis=0),
        latency=lat,
        work=work,
        sent=sent.sum(axis=1),
        recv=recv.sum(axis=1),
    )


def necessary_traffic(units: list[WorkUnit], shape: HeadShape) -> tuple[int, int]:
    """Forward and backward bytes that must move with no balancing at all (DESIGN §4)."""
    from megatron_hsap.plan.ir import Wire

    b = shape.token_bytes
    fwd = bwd = 0
    for u in units:
        if u.q_owner == u.kv_owner:
            continue
        nq, nk = len(u.q), len(u.kv)
        fwd += min(nk * b(Wire.KV), nq * (b(Wire.Q) + b(Wire.O) + b(Wire.LSE)))
        bwd += min(
            nk * (b(Wire.KV) + b(Wire.DKV)),
            nq * (b(Wire.Q) + b(Wire.DO) + b(Wire.LSE) + b(Wire.DELTA) + b(Wire.DQ)),
        )
    return fwd, bwd


def lower_bounds(total_work: int, nec_fwd: int, nec_bwd: int, size: int, shape: HeadShape, hw: Hardware, link: LinkClass) -> dict[str, float]:
    """Compute and traffic lower bounds, forward + backward, in seconds."""
    compute = total_work * (shape.fwd_flops_per_pair / hw.attn_fwd_flops + shape.bwd_flops_per_pair / hw.attn_bwd_flops) / size
    traffic = (nec_fwd + nec_bwd) / (size * hw.bandwidth(link))
    return {"compute_s": compute, "traffic_s": traffic, "bound_s": max(compute, traffic)}

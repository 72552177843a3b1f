"""Lower bounds of every plan of a batch (docs/design.md §4): the traffic that must move with no
balancing at all, the compute with the work spread perfectly (flat, at the kernel's peak, or every
document whole at its own shape's rate), and the floor no staging of a placement is priced below.
The layout search prunes with them (``plan.py``, ``priced.py``) and ``PlanStats`` reports them;
the estimate itself lives in ``plan/estimate.py``.
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.units import WorkUnit


def necessary_traffic(units: list[WorkUnit], shape: HeadShape, node: tuple[int, ...] = ()) -> tuple[int, int, int]:
    """Forward and backward bytes that must move with no balancing at all (docs/design.md §4), and
    how many of them (both phases) join ranks on different nodes (``node``: each inter rank's node,
    ``CostRates.node``; ``()``: all of them)."""
    b = shape.token_bytes
    fwd = bwd = cross = 0
    kv_f, q_f = b(Wire.KV), b(Wire.Q) + b(Wire.O) + b(Wire.LSE)
    kv_b = b(Wire.KV) + b(Wire.DKV)
    q_b = b(Wire.Q) + b(Wire.DO) + b(Wire.LSE) + b(Wire.DELTA) + b(Wire.DQ)
    for u in units:
        if u.q_owner == u.kv_owner:
            continue
        nq, nk = len(u.q), len(u.kv)
        f, g = min(nk * kv_f, nq * q_f), min(nk * kv_b, nq * q_b)
        fwd, bwd = fwd + f, bwd + g
        if not node or node[u.q_owner] != node[u.kv_owner]:
            cross += f + g
    return fwd, bwd, cross


def compute_bound(total_work: int, size: int, sec_fwd: float, sec_bwd: float) -> float:
    """Seconds of forward + backward attention with the work spread perfectly and no traffic
    (the compute lower bound of every plan, whatever its layout)."""
    return total_work * (sec_fwd + sec_bwd) / size


def price_floor(rank_work: np.ndarray, rates: CostRates) -> float:
    """Seconds no staging of a placement with ``rank_work`` pairs per rank is priced below by
    ``price_staging`` (so no plan built from it): each phase's path runs through every stage of a
    rank (``rank_path``: ``t(k + 1) ≥ t(k) + compute(k)``), whose compute is at least its kernel
    seconds (launches, merges and the slowdown beside transfers only add), and a kernel runs at
    most at its peak rate (efficiency ≤ 1); flat prices without a kernel. Shaved by 1e-9 for
    the summation order of the stages' sums."""
    k = rates.kernel
    if k is None:
        per = rates.sec_fwd + rates.sec_bwd
    else:
        assert rates.overlap_slowdown >= 0, rates.overlap_slowdown
        per = rates.fpp_fwd / k.fwd_peak + rates.fpp_bwd / k.bwd_peak
    return float(np.max(rank_work, initial=0.0)) * per * (1 - 1e-9)


def placement_floor(placement: object, rates: CostRates) -> float:
    """``price_floor`` of a placement's per-rank work (``Placement.work``): below every staging of
    it, so the candidate search skips it and the layout search settles on it without staging."""
    return price_floor(np.asarray(placement.work, dtype=np.float64), rates)  # type: ignore[attr-defined]


def ideal_compute(doc_lengths: np.ndarray, doc_work: np.ndarray, size: int, rates: CostRates) -> float:
    """Seconds of forward + backward attention with every document whole at the kernel's rate for
    its own shape and the work spread perfectly over ``size`` ranks, no traffic, no launches
    (the compute bound the layout rule compares with; flat rates when ``rates`` has no kernel)."""
    work = np.asarray(doc_work, dtype=np.float64)
    if rates.kernel is None:
        return compute_bound(int(work.sum()), size, rates.sec_fwd, rates.sec_bwd)
    n = np.asarray(doc_lengths, dtype=np.float64)
    keep = work > 0
    n, work = n[keep], work[keep]
    k = rates.kernel
    t = (work * rates.fpp_fwd / k.rate(n, n, Phase.FWD, rates.group, work)).sum() + (work * rates.fpp_bwd / k.rate(n, n, Phase.BWD, rates.group, work)).sum()
    return float(t) / size


def lower_bounds(total_work: int, nec_fwd: int, nec_bwd: int, size: int, shape: HeadShape, hw: Hardware, link: LinkClass,
                 nec_cross: int | None = None) -> dict[str, float]:
    """Compute and traffic lower bounds, forward + backward, in seconds (compute at the kernel
    model's peak rate, traffic at the plan's link bandwidth).

    ``nec_cross`` (``necessary_traffic``'s third figure, given when the inter ranks span nodes):
    pairs sharing a node move at NVLink rate beside the NIC (the estimate prices them so), so the
    bound is the larger of the cross-node bytes over the NICs and all bytes over both ports."""
    # at the kernel's asymptotic peak (efficiency 1): no block shape runs faster, so no estimate is below it
    compute = compute_bound(total_work, size, shape.fwd_flops_per_pair / hw.kernel.fwd_peak, shape.bwd_flops_per_pair / hw.kernel.bwd_peak)
    # a rank's round takes at least its bytes sent over its port(s): summed over ranks and rounds,
    # at least the bytes over every rank's bandwidth together
    bw = hw.bandwidth(link)
    if nec_cross is None:
        traffic = (nec_fwd + nec_bwd) / (size * bw)
    else:
        traffic = max(nec_cross / (size * bw), (nec_fwd + nec_bwd) / (size * (bw + hw.nvlink_bw)))
    return {"compute_s": compute, "traffic_s": traffic, "bound_s": max(compute, traffic)}

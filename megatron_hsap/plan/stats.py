"""Plan quality figures (docs/design.md §4): work, imbalance, bytes, rounds, pool use, bounds, efficiency."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_hsap.plan.bounds import ideal_compute, lower_bounds, necessary_traffic
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.costs import FP32_BYTES, HeadShape
from megatron_hsap.plan.ir import Compute, Wire
from megatron_hsap.plan.options import inter_rank_nodes, kv_head_chunks, kv_heads_per_rank

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["PlanStats", "plan_stats", "peak_bytes"]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Quality figures of one plan (docs/design.md §4 defines each). Times in seconds, bytes forward
    + backward unless named ``_fwd``/``_bwd``, work in (q, k) pairs; ``*_per_rank`` per inter rank.
    ``bytes_*`` are one SAP pass at full heads: with head chunks that share a kv chunk the kv side
    travels ``C/Ckv`` times (``chunks.chunked_p2p_bytes`` counts what the executors send).
    ``as_dict()`` is the JSON form (lists for the per-rank tuples), in this field order."""

    num_tokens: int
    padded_tokens: int
    num_docs: int
    inter_size: int
    intra_size: int
    link: str  # LinkClass value
    hardware: str  # Hardware.name
    layout: str  # "contiguous" or "balanced"
    window_size: tuple[int, int] | None
    head_chunks: int
    placement: str  # ChosenCandidate.name
    work_per_rank: tuple[int, ...]
    total_work: int
    imbalance: float  # max work / mean work
    owner_imbalance: float  # the same for the q owners (the paper's layout before placement)
    bytes_sent_per_rank: tuple[int, ...]
    bytes_recv_per_rank: tuple[int, ...]
    bytes_fwd: int
    bytes_bwd: int
    bytes_total: int
    necessary_bytes: int
    bytes_over_necessary: float
    rounds_fwd: int
    rounds_bwd: int
    pool_capacity_bytes: int
    pool_peak_bytes: int
    pool_peak_per_rank: tuple[int, ...]
    pool_tokens: int
    pool_use: float
    stages: int
    compute_items: int
    remote_items: int
    messages_fwd: int
    messages_bwd: int
    estimated_time_s: float
    fwd_time_s: float
    bwd_time_s: float
    owner_computes_time_s: float
    candidates: dict[str, float]  # candidate name -> estimated time
    compute_bound_s: float
    traffic_bound_s: float
    lower_bound_s: float
    efficiency: float  # lower_bound_s / estimated_time_s
    compute_efficiency: float  # compute_bound_s / estimated_time_s
    # every document whole at its own shape's kernel rate, perfectly spread, no traffic, no
    # launches (bounds.ideal_compute: the layout rule's bound and issue 14's "ideal")
    kernel_ideal_s: float
    kernel_efficiency: float  # kernel_ideal_s / estimated_time_s
    compute_dominated: bool  # traffic bound at most half the compute bound
    # (P_intra, P_inter) of the groups a flattened 1 x P plan runs on (plan/flatten.py), else None
    flattened_from: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """A fresh dict of every field (per-rank tuples as lists, ``candidates`` copied)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("work_per_rank", "bytes_sent_per_rank", "bytes_recv_per_rank", "pool_peak_per_rank"):
            out[k] = list(out[k])
        out["candidates"] = dict(out["candidates"])
        return out


def plan_stats(plan: "Plan") -> PlanStats:
    """Quality figures of ``plan`` (``PlanStats``; docs/design.md §4 for each definition)."""
    c = plan.chosen
    size = plan.inter_size
    work = c.fwd_time.work
    total = plan.batch.total_work(plan.options.window)
    mean = total / size
    node = inter_rank_nodes(plan.options, plan.link)
    nec_f, nec_b, nec_x = necessary_traffic(list(plan.work_units), plan.shape, node)
    bounds = lower_bounds(total, nec_f, nec_b, size, plan.shape, plan.hardware, plan.link, nec_x if node else None)
    rates = CostRates.of(plan.shape, plan.hardware, plan.hardware.bandwidth(plan.link))
    ideal = ideal_compute(np.diff(plan.batch.doc_starts), plan.batch.doc_work(plan.options.window), size, rates)
    est = c.time
    owner_work = np.zeros(size, dtype=np.int64)
    for u in plan.work_units:
        owner_work[u.q_owner] += u.work
    sent = c.fwd_time.sent + c.bwd_time.sent
    recv = c.fwd_time.recv + c.bwd_time.recv
    peaks = np.maximum(np.asarray(c.fwd.pool_peak), np.asarray(c.bwd.pool_peak))
    items = sum(len(ins.items) for prog in c.fwd.programs for ins in prog.instrs if isinstance(ins, Compute))
    remote = sum(1 for u in c.units if not u.is_local)
    return PlanStats(
        num_tokens=plan.num_tokens,
        padded_tokens=plan.padded_tokens,
        num_docs=plan.batch.num_docs,
        inter_size=size,
        intra_size=plan.intra_size,
        flattened_from=plan.options.flattened_from,
        link=plan.link.value,
        hardware=plan.hardware.name,
        layout=plan.layout.name,
        window_size=plan.options.window_size,
        head_chunks=plan.head_chunks,
        placement=c.name,
        work_per_rank=tuple(work.tolist()),
        total_work=total,
        imbalance=float(work.max() / mean) if mean else 1.0,
        owner_imbalance=float(owner_work.max() / mean) if mean else 1.0,
        bytes_sent_per_rank=tuple(sent.tolist()),
        bytes_recv_per_rank=tuple(recv.tolist()),
        bytes_fwd=int(c.fwd_time.sent.sum()),
        bytes_bwd=int(c.bwd_time.sent.sum()),
        bytes_total=int(sent.sum()),
        necessary_bytes=nec_f + nec_b,
        bytes_over_necessary=float(sent.sum() / (nec_f + nec_b)) if nec_f + nec_b else (0.0 if sent.sum() == 0 else float("inf")),
        rounds_fwd=c.fwd.rounds,
        rounds_bwd=c.bwd.rounds,
        pool_capacity_bytes=plan.pool_capacity,
        pool_peak_bytes=int(peaks.max()),
        pool_peak_per_rank=tuple(peaks.tolist()),
        pool_tokens=int(plan.pool_capacity // plan.shape.chunk_token_bytes),
        pool_use=float(peaks.max() / plan.pool_capacity) if plan.pool_capacity else 0.0,
        stages=c.fwd.rounds - 1,
        compute_items=items,
        remote_items=remote,
        messages_fwd=len(c.fwd.messages),
        messages_bwd=len(c.bwd.messages),
        estimated_time_s=est,
        fwd_time_s=c.fwd_time.total,
        bwd_time_s=c.bwd_time.total,
        owner_computes_time_s=plan.owner_time,
        candidates=dict(plan.alternatives),
        compute_bound_s=bounds["compute_s"],
        traffic_bound_s=bounds["traffic_s"],
        lower_bound_s=bounds["bound_s"],
        efficiency=bounds["bound_s"] / est if est else 1.0,
        compute_efficiency=bounds["compute_s"] / est if est else 1.0,
        kernel_ideal_s=ideal,
        kernel_efficiency=ideal / est if est else 1.0,
        compute_dominated=bounds["traffic_s"] <= 0.5 * bounds["compute_s"],
    )


def peak_bytes(plan: "Plan", *, num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
               head_dim_v: int | None = None, dtype_bytes: int | None = None) -> dict[str, int]:
    """Bytes HSAP holds per CP rank beyond the layer's own q/k/v/o: the receive pool, the
    all-to-all outputs (the whole inter chunk for H/P_intra heads) and fp32 accumulators.
    Head counts default to the plan's (global per-TP-rank counts; divided by P_intra here).

    The accumulators are one SAP pass at full heads, plus, where the plan's head chunks share a
    kv chunk (``Ckv < C``, ``plan/chunks.py``), the backward's running fp32 sum of the current kv
    chunk's dk, dv (``runtime/hsap.py``): held beside the next q chunk's own gradients until the
    kv chunk's last q chunk returns it — the whole inter chunk's rows × ``hkv/Ckv`` kv heads ×
    ``(d_qk + d_v)`` × 4 bytes."""
    o = plan.options
    heads, d = num_heads or o.num_heads, head_dim or o.head_dim
    act = HeadShape(num_heads=heads // o.intra_size,
                    num_kv_heads=kv_heads_per_rank(heads, num_kv_heads or o.num_kv_heads or o.num_heads, o.intra_size),
                    head_dim=d, head_dim_v=head_dim_v or o.head_dim_v or d, dtype_bytes=dtype_bytes or o.dtype_bytes)
    fp32 = replace(act, dtype_bytes=FP32_BYTES)  # the accumulators' rows (HeadShape.token_bytes: one home)
    chunk = plan.chunk_tokens
    scale = act.chunk_token_bytes / plan.shape.chunk_token_bytes
    pool = int(plan.pool_capacity * scale)
    a2a = chunk * (act.token_bytes(Wire.Q) + act.token_bytes(Wire.KV) + act.token_bytes(Wire.O)) if o.intra_size > 1 else 0
    acc = chunk * (fp32.token_bytes(Wire.O) + fp32.token_bytes(Wire.LSE))  # fp32 output + lse accumulators (forward)
    grads = chunk * (fp32.token_bytes(Wire.DQ) + fp32.token_bytes(Wire.DKV))  # fp32 dq, dk, dv accumulators (backward)
    c = plan.head_chunks
    kv_chunks = kv_head_chunks(c, act.num_kv_heads)
    if kv_chunks < c:  # shared kv: one kv chunk's fp32 dk, dv summed over its q chunks
        grads += chunk * replace(fp32, num_kv_heads=act.num_kv_heads // kv_chunks).token_bytes(Wire.DKV)
    return {"pool": pool, "all_to_all": a2a, "accumulators": max(acc, grads), "total": pool + a2a + max(acc, grads)}


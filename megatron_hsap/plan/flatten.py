"""Flattening (docs/design.md §2.1 **Flattening**): a ``P_intra × P_inter`` batch planned on a
one-level topology of the same ``P = P_intra·P_inter`` CP ranks when that is estimated faster:
``1 × P`` (pure SAP, no all-to-all) or ``P × 1`` (one all-to-all over all P ranks, Ulysses, and
every block local).

Why: the intra all-to-all moves (P_intra−1)/P_intra of every token's q, k, v and o whatever the
batch. On packed short documents SAP over the same GPUs keeps each document whole on one rank and
moves almost nothing (Table 4, LLaMA-2-7B on 8 A100s, fineweb 64K, mean of 10 batches: 6.64 ms of
attention at 8x1, 3.80 at 1x8). The other way round, a long document split over P ranks pays SAP's
partial-result merges and small-block kernels, while one all-to-all over the same NVLink leaves
every rank whole documents on P_intra-th of the heads (Table 4, one 16K document: 1x8 ran 0.91×
TE's all-to-all CP, 8x1 1.04×). A user picks the topology for the job, not for every batch.

``flatten`` (``PlanOptions``): "never" keeps the configured topology; "auto" (the default) also
compiles the one-level plans other than the configured one when the CP group sits inside one node
(P2P then runs over the same NVLink as the all-to-all: ``options.link_of`` of the configured plan
is NVLink; ``P × 1`` only when its heads split evenly, ``options.kv_heads_per_rank``), and keeps
the lowest estimated layer time (``Plan.layer_time``: SAP plus the all-to-all pipelined with it,
``plan/chunks.py``), compared in integer picoseconds like the layout choice (``balanced._ps``) so
every rank keeps the same plan; ties keep the configured plan, then ``1 × P``. Not when
``head_chunks`` is forced: that pins the configured all-to-all. "always" keeps the ``1 × P`` plan
and "all-to-all" the ``P × 1`` plan (tests, replays; with a forced ``head_chunks`` either is refused,
``options.check_head_chunks``, rather than the count dropped). On Table 4 every point then leads the best
document-aware baseline (``results/table4.md``).

A flattened plan's options say ``intra_size, inter_size = 1, P`` or ``P, 1`` and ``flattened_from
= (P_intra, P_inter)``: it runs on the CP group (``runtime/groups.HSAPGroups.cp``, group rank = CP
rank = its one-level rank), and batch sharding reads its ``local_token_indices`` like any plan's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.balanced import _ps
from megatron_hsap.plan.chunks import a2a_layer_floor
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.options import PlanOptions, kv_heads_per_rank, link_of

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["flat_topologies", "flat_options", "choose_topology", "a2a_cannot_win", "flattened_what"]


def _heads_split(opts: PlanOptions, p: int) -> bool:
    """Whether an all-to-all over ``p`` ranks can split ``opts``' heads (``kv_heads_per_rank``)."""
    try:
        kv_heads_per_rank(opts.num_heads, opts.num_kv_heads or opts.num_heads, p)
    except ConfigError:
        return False
    return True


def flat_topologies(opts: PlanOptions) -> tuple[tuple[int, int], ...]:
    """The one-level ``(P_intra, P_inter)`` topologies ``compile_plan`` compiles a batch on besides
    (or, forced, instead of) the configured one, in tie-break order: ``(1, P)``, then ``(P, 1)``.

    Raises :class:`ConfigError` when ``flatten="all-to-all"`` asks for a ``P × 1`` plan whose
    heads cannot split over ``P`` ranks."""
    p = opts.intra_size * opts.inter_size
    sap, a2a = (1, p), (p, 1)
    if opts.flatten == "never" or p == 1:
        return ()
    if opts.flatten == "always":
        return (sap,) if opts.intra_size > 1 else ()
    if opts.flatten == "all-to-all":
        if opts.inter_size == 1:
            return ()
        kv_heads_per_rank(opts.num_heads, opts.num_kv_heads or opts.num_heads, p)  # raises, naming the heads
        return (a2a,)
    # "auto": inside one node, and not when the caller pinned the all-to-all's head chunks
    if opts.head_chunks is not None or link_of(opts) is not LinkClass.NVLINK:
        return ()
    out = [sap] if opts.intra_size > 1 else []
    if opts.inter_size > 1 and _heads_split(opts, p):
        out.append(a2a)
    return tuple(out)


def flat_options(opts: PlanOptions, topology: tuple[int, int]) -> PlanOptions:
    """The options of ``opts``' batch on the one-level ``topology`` (``(1, P)`` or ``(P, 1)``): the
    same model, layout, link and pool; head chunks chosen by the planner; ``flattened_from`` names
    the configured groups."""
    return replace(opts, intra_size=topology[0], inter_size=topology[1], head_chunks=None, flatten="never",
                   flattened_from=(opts.intra_size, opts.inter_size)).validate()


def choose_topology(configured: "Plan", *flat: "Plan") -> "Plan":
    """The plan ``flatten="auto"`` keeps: the lowest estimated layer time, in integer picoseconds
    (ties: the first given, the configured plan)."""
    best = configured
    for p in flat:
        if _ps(p.layer_time) < _ps(best.layer_time):
            best = p
    return best


def a2a_cannot_win(opts: PlanOptions, shape: HeadShape, local_tokens: int, hardware: Hardware, best_layer_s: float) -> bool:
    """Whether the one-all-to-all plan (``P × 1``: ``opts`` with ``inter_size == 1``, head shape
    ``shape``, ``local_tokens`` per rank) cannot be kept against a plan of layer time
    ``best_layer_s`` already compiled, by ``chunks.a2a_layer_floor`` (its all-to-alls alone) in
    ``choose_topology``'s integer picoseconds: then ``compile_plan`` does not compile it (the
    same plan is kept; fineweb 64K / P 8: ~4 of ~54 ms per compile)."""
    if opts.inter_size != 1 or opts.intra_size == 1:
        return False
    return _ps(a2a_layer_floor(opts, shape, local_tokens, hardware)) >= _ps(best_layer_s)


def flattened_what(plan: "Plan") -> str:
    """How error messages name a flattened plan: ``"the plan runs as pure SAP over all P CP ranks
    (flattened from AxB, plan/flatten.py)"`` (or as one all-to-all over them)."""
    a, b = plan.options.flattened_from  # type: ignore[misc]
    how = "pure SAP" if plan.intra_size == 1 else "one all-to-all (Ulysses)"
    return f"the plan runs as {how} over all {plan.cp_size} CP ranks (flattened from {a}x{b}, plan/flatten.py)"

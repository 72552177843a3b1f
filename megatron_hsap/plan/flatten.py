"""Flattening (docs/design.md §2.1 **Flattening**): a ``P_intra × P_inter`` batch planned as pure SAP
over all ``P = P_intra·P_inter`` CP ranks, when that is estimated faster.

Why: the intra all-to-all moves 7/8 of every token's q, k, v and o at ``P_intra`` 8, whatever
the batch. On packed short documents SAP over the same GPUs keeps each document whole on one
rank and moves almost nothing. Measured in simulation (Table 4, LLaMA-2-7B on 8 A100s, fineweb
64K, mean of 10 batches): 6.64 ms of attention at 8x1, 3.80 at 1x8. A user picks ``P_intra`` for
the long documents of the job, not for every batch.

``flatten`` (``PlanOptions``): "never" keeps the configured topology; "auto" (the default) also
compiles the ``1 × P`` plan when the CP group sits inside one node (its P2P then runs over the
same NVLink as the all-to-all: ``options.link_of`` of the configured plan is NVLink) and keeps
whichever has the lower estimated layer time (``Plan.layer_time``: SAP plus the all-to-all pipelined with it,
``plan/chunks.py``), compared in integer picoseconds like the layout choice (``balanced._ps``) so
every rank keeps the same plan (not when ``head_chunks`` is forced: that pins the all-to-all);
"always" keeps the ``1 × P`` plan. On Table 4 it runs 3–10 of 10 packed batches per
``P_intra > 1`` point flattened, and every such point then leads the best document-aware
baseline (``results/table4.md``).

A flattened plan's options say ``intra_size = 1``, ``inter_size = P`` and ``flattened_from =
(P_intra, P_inter)``: it runs on the CP group (``runtime/groups.HSAPGroups.cp``, group rank = CP
rank = its inter rank), and batch sharding reads its ``local_token_indices`` like any plan's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.plan.balanced import _ps
from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.plan.options import PlanOptions, link_of

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["flattens", "flat_options", "choose_topology", "flattened_what"]


def flattens(opts: PlanOptions) -> bool:
    """Whether ``compile_plan`` compiles the ``1 × P`` plan of a batch under ``opts`` too (or only)."""
    if opts.intra_size == 1 or opts.flatten == "never":
        return False
    if opts.flatten == "always":
        return True
    # "auto": inside one node, and not when the caller pinned the all-to-all's head chunks
    return opts.head_chunks is None and link_of(opts) is LinkClass.NVLINK


def flat_options(opts: PlanOptions) -> PlanOptions:
    """The ``1 × P`` options of a ``P_intra × P_inter`` batch: the same model, layout, link and
    pool; no head chunks (no all-to-all to pipeline); ``flattened_from`` names the groups."""
    return replace(opts, intra_size=1, inter_size=opts.intra_size * opts.inter_size, head_chunks=None,
                   flatten="never", flattened_from=(opts.intra_size, opts.inter_size)).validate()


def choose_topology(hsap: "Plan", flat: "Plan") -> "Plan":
    """The plan ``flatten="auto"`` keeps: ``flat`` when its estimated layer time is below the
    configured plan's (ties: the configured one)."""
    return flat if _ps(flat.layer_time) < _ps(hsap.layer_time) else hsap


def flattened_what(plan: "Plan") -> str:
    """How error messages name a flattened plan: ``"the plan runs as pure SAP over all P CP ranks
    (flattened from AxB, plan/flatten.py)"``."""
    a, b = plan.options.flattened_from  # type: ignore[misc]
    return f"the plan runs as pure SAP over all {plan.cp_size} CP ranks (flattened from {a}x{b}, plan/flatten.py)"

"""Shared inputs of the compile-time shortcut tests (``test_compile_speed_equal*.py``): one small
head shape, and a compiled plan with the cost rates its compile used."""

from __future__ import annotations

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.options import inter_rank_nodes
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.schedule import BlocksByRank, StagingError, stage, stage_shapes
from megatron_hsap.plan.workloads import pack_batches

SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def plan_and_rates(workload: str, T: int, inter: int, seed: int, **kw):
    clear_plan_cache()
    cu = pack_batches(workload, T, seed + 1, 0)[seed]
    plan = compile_plan(cu, inter, **SMALL, **kw)
    hw, link = plan.hardware, plan.link
    rates = CostRates.of(plan.shape, hw, hw.bandwidth(link), inter_rank_nodes(plan.options, link),
                         plan.layout.segment_starts(), hw.flow_bandwidth(link, inter))  # as compile_plan builds them
    return plan, rates


def split_and_stagings(plan, rates, budget: float | None = None):
    """The chosen plan's blocks as one split (every block back at stage 0) and every staging the
    planner could price for it (each stage shape) under ``budget`` (default: the plan's)."""
    from megatron_hsap.plan.plan import _BUDGET_FRACTION

    if budget is None:
        budget = plan.pool_capacity * _BUDGET_FRACTION
    split = BlocksByRank.of([u.at_stage(0) for u in plan.chosen.units], plan.options.inter_size)
    out = []
    for shp in stage_shapes(split, rates, budget):
        try:
            out.append(stage(split, rates, shp, budget))
        except StagingError:
            continue
    return split, out

"""Shared inputs of the compile-time shortcut tests (``test_compile_speed_equal*.py``): one small
head shape, and a compiled plan with the cost rates its compile used."""

from __future__ import annotations

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.options import inter_rank_nodes
from megatron_hsap.plan.placement import CostRates
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

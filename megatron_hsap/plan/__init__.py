"""The SAP planner (pure Python + numpy; never imports torch). See docs/design.md §2.1."""

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.plan import Plan, PlanOptions, clear_plan_cache, compile_plan

__all__ = ["compile_plan", "clear_plan_cache", "Plan", "PlanOptions", "HeadShape"]

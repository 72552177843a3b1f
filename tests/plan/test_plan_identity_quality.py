"""``tests.plan.plan_identity``'s records carry the plan's estimated layer time, and ``compare``'s
quality lines count and rank its moves (the tool that judges a planner rule meant to change plans)."""

from __future__ import annotations

import math

from megatron_hsap.plan import clear_plan_cache, compile_plan
from tests.plan.plan_identity import _one, quality


def _rec(layer: float | None) -> list:
    head = ["hash", "0.001", "balanced", "owner-computes", 1]
    return head + ([repr(layer)] if layer is not None else []) + [[1, 2], 0.01]


def test_a_record_carries_the_plans_layer_time() -> None:
    cu = [0, 3000, 5000, 8192]
    name, got = _one(("bench tiny", cu, 4, dict(num_heads=8, num_kv_heads=2, head_dim=64)))
    clear_plan_cache()
    p = compile_plan(cu, 4, num_heads=8, num_kv_heads=2, head_dim=64)
    assert name == "bench tiny" and float(got[5]) == p.layer_time and got[2:5] == [p.layout.name, p.chosen.name, p.head_chunks]


def test_quality_counts_moves_past_the_band_and_the_geometric_mean() -> None:
    old = {"bench a": _rec(1.0), "bench b": _rec(2.0), "bench c": _rec(4.0), "bench d": _rec(1.0),
           "grid x": _rec(1.0), "grid old-format": _rec(None), "grid failed": ["PoolSizeError: ...", [0, 0], 0.1],
           "scale cut": _rec(1.0)}
    new = {"bench a": _rec(0.9), "bench b": _rec(2.2), "bench c": _rec(4.01), "bench d": _rec(1.0),
           "grid x": _rec(1.0), "grid old-format": _rec(3.0), "grid failed": _rec(1.0), "scale cut": _rec(9.0)}
    lines = quality(old, new, cut=["scale cut"])
    assert len(lines) == 2  # bench and grid; the cut scale plan is left out, so is its set
    gm = math.exp((math.log(0.9) + math.log(1.1) + math.log(4.01 / 4)) / 4)
    assert lines[0].startswith("quality bench: 4 plans, 1 better / 1 worse by > 0.5%")  # 4.01/4 is inside the band
    assert f"geometric mean new/old {gm:.4f}" in lines[0] and "worst 1.1000 (bench b)" in lines[0]
    assert lines[1] == "quality grid: 1 plan, 0 better / 0 worse by > 0.5%, geometric mean new/old 1.0000"

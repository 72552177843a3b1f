"""The plan-quality compile-time table (``bench/plan_quality.py``, issue 14 item 5): it states each
budget point's verdict from the measured median, never from a guess. No wall-clock assert here:
the budgets are measured by ``megatron-hsap plan-quality --compile-times-only``."""

from __future__ import annotations

from megatron_hsap.bench import plan_quality


def _rows(median_64k: float, median_1m: float) -> list[tuple]:
    rows = []
    for (T, P), med in zip(plan_quality.COMPILE_BUDGETS, (median_64k, median_1m)):
        for method, value in (("hsap", med / 3), ("hsap-kept", med)):
            base = (plan_quality.SOURCE + "_compile", "fineweb", T, 1, P, "nvlink", "32/8", -1, method)
            rows += [base + ("compile_time_median", value, "s"), base + ("compile_time_single_median", 1.5 * value, "s"),
                     base + ("compile_time_max", 2 * value, "s"),
                     base + ("compile_cpu_time_median", value / 2, "s"), base + ("cache_hit_time_median", 1e-5, "s")]
    return rows


def test_budgets_are_the_issue_s() -> None:
    assert plan_quality.COMPILE_BUDGETS == {(64 * 1024, 8): 0.020, (1 << 20, 64): 0.200}
    assert plan_quality.HEADS[plan_quality.COMPILE_HEADS] == (32, 8)


def test_compile_table_verdicts_follow_the_medians() -> None:
    lines = plan_quality.compile_markdown(_rows(0.019, 0.250))
    assert "heads 32/8, d 128" in lines[0] and "CPU time" in lines[0]
    kept = [ln for ln in lines if "balanced, the default" in ln]
    assert len(kept) == 2
    assert "| 64K | 8 | 19.0 | 28.5 / 38.0 | 9.5 | 0.010 | 20 (met) |" in kept[0]  # the verdict on the least of the repeats
    assert "| 1M | 64 | 250.0 | 375.0 / 500.0 | 125.0 | 0.010 | 200 (MISSED) |" in kept[1]
    contiguous = [ln for ln in lines if "| contiguous |" in ln]
    assert len(contiguous) == 2 and all(ln.endswith("|  |") for ln in contiguous)  # no budget for the paper's layout
    assert plan_quality.compile_markdown([]) == []
    # the full table carries it too
    assert "\n".join(lines) in plan_quality.markdown(_rows(0.019, 0.250))

"""The stage-shape census tool (``tests/plan/shape_census.py``, docs/compile_time.md): its loss per
family and its seeding count on hand-made searches with known answers, and its recording on one
real compile (every staging of a search built-priced, exactly one picked, the plan unchanged)."""

from __future__ import annotations

import math

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.workloads import pack_batches
from tests.plan import shape_census
from tests.plan.plan_regression_cases import ir_hash

# (stages, end weight, ring fill, doubles), staged price, built price, picked
_A = [((3, 0.5, False, 0), 1.0, 1.10, False), ((3, 0.5, True, 0), 1.0, 1.00, True), ((4, 0.5, False, 3), 1.2, 1.21, False)]
_B = [((2, 1.0, False, 0), 2.0, 2.00, True), ((3, 1.0, False, 0), 2.1, 2.50, False)]


def test_census_losses_per_family():
    lines = shape_census.census([_A, _B])
    assert lines[0] == "2 every-shape searches, 5 stagings"
    rows = {ln.split(" | ")[0].lstrip("| "): ln.split(" | ")[1:] for ln in lines[3:]}
    # without ring fill, search A keeps 1.10 at best: 10% slower; B has no ring shape
    assert rows["ring fill"] == ["4 / 5", "1", "1", "10.0% |"]
    # without the two-stage shape B keeps 2.50 (25%); A has none
    assert rows["two stages"] == ["4 / 5", "1", "1", "25.0% |"]
    # end weight 1 outside two stages: only B's 3-stage shape, which did not win
    assert rows["end weight 1 (not two stages)"] == ["4 / 5", "0", "0", "0.0% |"]
    # without end weight 0.5 search A has no shape left
    assert rows["end weight 0.5"] == ["2 / 5", "1", "1", "every shape of some search |"]


def test_seeded_counts_the_previous_winner():
    # A's winner (3, 0.5, ring) is offered by the next search too and wins there; B does not offer it
    again = [((3, 0.5, True, 0), 1.0, 1.0, True), ((3, 0.5, False, 0), 1.0, 1.2, False)]
    assert shape_census.seeded([[_A, again, _B]]) == (
        "the previous search's winning shape won the next search in 1 of 2 (1 did not offer it)")


def test_records_a_real_compile():
    cu = [int(x) for x in pack_batches("fineweb", 1 << 16, 1, 3)[0]]
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, hardware="a100")
    clear_plan_cache()
    want = ir_hash(compile_plan(cu, 8, **kw))
    import megatron_hsap.plan.candidates as candidates

    stage, fastest = candidates.stage, candidates._fastest
    try:
        shape_census._watch()
        name, searches = shape_census._one(("x", cu, 8, kw))
        clear_plan_cache()
        assert ir_hash(compile_plan(cu, 8, **kw)) == want  # recording changes no plan
    finally:
        candidates.stage, candidates._fastest = stage, fastest
    assert name == "x" and searches
    for rows in searches:
        assert sum(p for *_, p in rows) == 1
        assert all(s is not None and math.isfinite(b) and b > 0 for s, _, b, _ in rows)
        picked = next(b for *_, b, p in rows if p)
        # the search stops at the first staged price at or above its best built one: every
        # staging priced under the pick was compared, and none builds faster
        assert all(b >= picked * (1 - 1e-12) for _, t, b, _ in rows if t < picked)

"""Plans do not change by accident (issue 17 item 6): the IR hash of every fixed batch in
``plan_regression_cases.CASES`` (several workloads, P_inter 2..64, both layouts, windows, GQA,
intra groups, fixed placements, a small pool, padding) equals the hash recorded in
``tests/fixtures/plan_hashes.json``.

A planner speed-up must leave every hash as it is. When plans change ON PURPOSE, regenerate the
fixture with ``.venv/bin/python -m tests.plan.plan_regression_cases --write`` and say so in the
commit. The 1M-token and P_inter-64 points are slow-marked; the default part takes a few seconds.
"""

from __future__ import annotations

import pytest

from megatron_hsap.plan import clear_plan_cache, compile_plan
from tests.plan.plan_regression_cases import CASES, Case, compute, cu_digest, ir_hash, load_fixture

FIXED = load_fixture()


def test_fixture_covers_every_case() -> None:
    assert sorted(FIXED) == sorted(c.name for c in CASES)
    assert len({c.name for c in CASES}) == len(CASES)
    # the cases differ: a hash that ignored the programs would collide across them
    assert len({FIXED[c.name]["ir"] for c in CASES}) >= len(CASES) - 3


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_plan_ir_hash_unchanged(case: Case) -> None:
    want = FIXED[case.name]
    got = compute(case)
    assert got["cu_seqlens"] == want["cu_seqlens"], (
        f"{case.name}: the batch itself changed (plan/workloads.py sampling), not the planner"
    )
    assert got["ir"] == want["ir"], (
        f"{case.name}: the compiled plan changed; if intended, regenerate tests/fixtures/plan_hashes.json "
        "(python -m tests.plan.plan_regression_cases --write)"
    )


def test_ir_hash_sees_every_instruction_kind() -> None:
    """The hash moves when a slot offset, a stage, a round's op order or the layout moves."""
    case = next(c for c in CASES if c.name == "fineweb-64K-P8-contig")
    cu = case.cu_seqlens()
    assert cu_digest(cu) == FIXED[case.name]["cu_seqlens"]
    clear_plan_cache()
    plan = compile_plan(cu, case.inter, case.intra, **case.compile_options)
    base = ir_hash(plan)
    assert base == ir_hash(compile_plan(cu, case.inter, case.intra, **case.compile_options))  # deterministic
    other = compile_plan(cu, case.inter, case.intra, **{**case.compile_options, "pool_bytes": plan.pool_capacity * 2})
    assert ir_hash(other) != base  # same programs, other pool: capacity enters the hash
    shifted = compile_plan(cu[:-1].tolist() + [int(cu[-2]) + 8, int(cu[-1])], case.inter, case.intra, **case.compile_options)
    assert ir_hash(shifted) != base  # one document boundary moved

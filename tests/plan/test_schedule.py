"""plan/schedule.py: staging respects the round dependencies — a block whose inputs travel is
never in stage 0 (its inputs arrive in round ``stage − 1``), every input message is posted in the
round before the stage that reads it and every result message in the round after the stage that
made it — and ``stage`` cuts a placement into pieces that tile its blocks' pairs exactly, each
inside the stage range, with each rank's per-stage remote pool use within the budget
(docs/design.md §2.1 step 3). ``StageShape.weights`` is ``(α, 1, …, 1, α)``.

Reference: block masks built here; the dependency check matches each message to the placed
blocks of the compiled plan."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.cuts import footprint
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.placement import min_traffic, region_distflash
from megatron_hsap.plan.rebalance import balance
from megatron_hsap.plan.schedule import BlocksByRank, StageShape, default_shape, stage, stage_shapes
from tests.plan.test_placement import PR, pairs, setup

INPUTS = {Phase.FWD: {Wire.Q, Wire.KV}, Phase.BWD: {Wire.Q, Wire.KV, Wire.DO, Wire.LSE, Wire.DELTA}}


def test_stage_shape_weights() -> None:
    assert StageShape(1, 0.5).weights.tolist() == [1.0]
    assert StageShape(2, 0.5).weights.tolist() == [0.5, 1.0]
    assert StageShape(5, 0.25).weights.tolist() == [0.25, 1, 1, 1, 0.25]
    assert list(StageShape(5, 0.25).middle) == [1, 2, 3]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4),
       st.sampled_from(["contiguous", "balanced"]), st.sampled_from([4096, 16384]))
def test_compiled_stages_respect_round_dependencies(lengths, inter, layout, pool) -> None:
    cu = list(np.concatenate([[0], np.cumsum(lengths)]).astype(int))
    plan = compile_plan(cu, inter, num_heads=4, num_kv_heads=2, head_dim=16, layout=layout, pool_bytes=pool)
    units = plan.units()
    S = plan.stats().stages
    for u in units:
        assert 0 <= u.stage < S
        if not (u.rank == u.q_owner == u.kv_owner):
            assert u.stage >= 1, f"{u} needs travelling inputs but is in stage 0"
    by_rank = defaultdict(list)
    for u in units:
        by_rank[u.rank].append(u)
    for phase in Phase:
        for m in plan.raw_messages(phase):
            if m.wire in INPUTS[phase]:  # an input: read at stage round + 1 by a block on dst
                side = (lambda u: (u.kv_owner, u.kv)) if m.wire is Wire.KV else (lambda u: (u.q_owner, u.q))
                assert any(u.stage == m.round + 1 and side(u) == (m.src, m.tokens) for u in by_rank[m.dst]), m
            else:  # a result: made at stage round − 1 by a block on src
                side = (lambda u: (u.kv_owner, u.kv)) if m.wire is Wire.DKV else (lambda u: (u.q_owner, u.q))
                assert any(u.stage == m.round - 1 and side(u) == (m.dst, m.tokens) for u in by_rank[m.src]), m


@pytest.mark.parametrize("lengths,inter", [([256], 4), ([100, 60, 96], 4), ([200, 56], 2)])
@pytest.mark.parametrize("budget_rows", [4, 16, 64])
def test_stage_tiles_the_placement_within_the_pool_budget(lengths, inter, budget_rows) -> None:
    batch, wunits = setup(lengths, inter, "contiguous")
    T = batch.padded_tokens
    budget = budget_rows * (PR.q_bwd + PR.dq + PR.kv + PR.dkv)
    for start in (min_traffic, region_distflash):
        placed = balance(start(wunits, inter, PR), traffic_budget=1.2).placed()
        split = BlocksByRank.of(placed, inter)
        shapes = stage_shapes(split, PR, budget)
        assert default_shape(shapes) in shapes
        for shape in shapes[:3]:
            staged = stage(split, PR, shape, budget)
            got = np.zeros((T, T), dtype=np.int64)
            use = defaultdict(float)
            for u in staged.units():
                assert 0 <= u.stage < staged.stages
                got += pairs(T, u.q, u.kv, u.causal)
                if not (u.rank == u.q_owner == u.kv_owner):
                    assert u.stage >= 1
                    use[(u.rank, u.stage)] += footprint(u, PR)
            want = sum(pairs(T, u.q, u.kv, u.causal).astype(np.int64) for u in placed)
            assert (got == want).all()  # nothing lost or doubled by the cuts
            # why 1e-9: float sums of integer byte counts; a real overflow is at least one row
            assert all(v <= budget * (1 + 1e-9) for v in use.values()), max(use.values())

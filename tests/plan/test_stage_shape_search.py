"""The every-shape search's doubled shapes (plan/schedule.stage_shapes, plan/candidates._stagings):
a shape doubling another's middle stages is staged only while that base shape is priced within
``_DOUBLED_MARGIN`` of the best; the search must ship the plans of the unpruned search.

Counts and plan hashes only (no timing). The reference is the same search with the prune off
(``_DOUBLED_MARGIN`` infinite): every shape staged, as before the rule."""

from __future__ import annotations

import numpy as np
import pytest

import megatron_hsap.plan.candidates as candidates
from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import HARDWARE, LinkClass
from megatron_hsap.plan.layout import Batch, contiguous_layout
from megatron_hsap.plan.placement import CostRates, owner_computes
from megatron_hsap.plan.schedule import BlocksByRank, stage_shapes
from megatron_hsap.plan.units import build_units
from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim.estimate_accuracy import cases
from megatron_hsap.sim.methods import full_shape
from tests.plan.plan_regression_cases import ir_hash

GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128, hardware="a100")


def _owner_split() -> tuple[BlocksByRank, CostRates]:
    """Owner-computes' blocks of a fineweb 64K batch on the contiguous layout over 8 inter ranks
    (InfiniBand, A100, GQA 32/8), and its rates."""
    hw = HARDWARE["a100"]
    rates = CostRates.of(HeadShape(num_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128), hw, hw.bandwidth(LinkClass.INFINIBAND))
    batch = Batch.build(pack_batches("fineweb", 1 << 16, 1, 3)[0], 8)
    _, units = build_units(batch, contiguous_layout(batch, 8, 1))
    return BlocksByRank.of(owner_computes(units, 8, rates).placed(), 8), rates


def _record_searches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[object], list[object], dict[object, float]]]:
    """Every every-shape search ``_stagings`` runs: ``(shapes offered, shapes staged in order,
    staged price of each)``."""
    searches: list[tuple[list[object], list[object], dict[object, float]]] = []
    real_stage, real_price, real_shapes, real_stagings = (candidates.stage, candidates.price_staging,
                                                         candidates.stage_shapes, candidates._stagings)
    current: list[tuple[list[object], list[object], dict[object, float]]] = []
    shape_of: dict[int, object] = {}

    # (the layout prune's lazy stagings, plan._loses, run outside any ``_stagings`` call: not recorded)
    def stage_shapes(*args):
        got = real_shapes(*args)
        if current:
            current[-1][0].extend(got)
        return got

    def stage(split, rates, shp, budget):
        st = real_stage(split, rates, shp, budget)
        if current:
            current[-1][1].append(shp)
            shape_of[id(st)] = shp
        return st

    def price(st, *args):
        t = real_price(st, *args)
        if current and id(st) in shape_of:
            current[-1][2][shape_of[id(st)]] = t
        return t

    def stagings(split, rates, latency, budget, *, explore=True):
        current.append(([], [], {}))
        try:
            return real_stagings(split, rates, latency, budget, explore=explore)
        finally:
            got = current.pop()
            if explore:
                searches.append(got)

    monkeypatch.setattr(candidates, "stage_shapes", stage_shapes)
    monkeypatch.setattr(candidates, "stage", stage)
    monkeypatch.setattr(candidates, "price_staging", price)
    monkeypatch.setattr(candidates, "_stagings", stagings)
    return searches


def test_a_doubled_shape_is_staged_only_while_its_base_is_near_the_best(monkeypatch: pytest.MonkeyPatch) -> None:
    # fineweb 1M over 64 inter ranks (a compile-budget batch): owner-computes' every-shape search
    # offers 11 shapes, three of them doubling a base priced 7-17% behind the best
    searches = _record_searches(monkeypatch)
    clear_plan_cache()
    compile_plan(pack_batches("fineweb", 1 << 20, 5, 12345)[4], 64, **GQA)
    assert searches
    skipped = 0
    for offered, tried, price in searches:
        fewest = min(s.stages for s in offered)
        order = [s for s in offered if s.stages == fewest] + [s for s in offered if s.stages > fewest]
        assert [s for s in order if s in tried] == tried  # staged in the search's order
        for i, shp in enumerate(order):
            if not shp.doubles:
                assert shp in tried  # only doubled shapes are ever left out
                continue
            base = next(s for s in order[:i] if (s.stages, s.end_weight, s.ring_fill) == (shp.doubles, shp.end_weight, False))
            best = min(price[s] for s in order[:i] if s in price)
            near = price[base] <= best * (1 + candidates._DOUBLED_MARGIN) or not candidates._skippable(shp)
            assert (shp in tried) == near, (shp, price[base], best)
            skipped += not near
    assert skipped >= 3  # not vacuous: the rule skipped shapes on this batch


def test_doubled_shapes_name_the_shape_they_double() -> None:
    split, rates = _owner_split()
    shapes = stage_shapes(split, rates, 1e9)
    doubled = [s for s in shapes if s.doubles]
    assert doubled
    for s in doubled:
        base = next(b for b in shapes if (b.stages, b.end_weight, b.ring_fill, b.doubles) == (s.doubles, s.end_weight, False, 0))
        assert s.stages - 2 == 2 * (base.stages - 2)
        assert any(r.ring_fill and (r.stages, r.end_weight) == (base.stages, base.end_weight) for r in shapes)


def _benchmark_plans(which: list[object], budget_points: tuple[tuple[int, int], ...]) -> list[str]:
    out = []
    for c in which:
        shape = full_shape(*c.heads)
        clear_plan_cache()
        out.append(ir_hash(compile_plan(np.asarray(c.cu), c.inter, c.intra, num_heads=shape.num_heads,
                                        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype_bytes=shape.dtype_bytes,
                                        hardware=c.hardware, **dict(c.options))))
    for T, P in budget_points:
        for cu in pack_batches("fineweb", T, 5, 12345):
            clear_plan_cache()
            out.append(ir_hash(compile_plan(cu, P, **GQA)))
    return out


def _same_plans_as_the_unpruned_search(monkeypatch: pytest.MonkeyPatch, which: list[object], budget_points) -> None:
    pruned = _benchmark_plans(which, budget_points)
    monkeypatch.setattr(candidates, "_DOUBLED_MARGIN", float("inf"))
    assert _benchmark_plans(which, budget_points) == pruned


@pytest.mark.parametrize("base_behind, staged", [(0.02, True), (0.05, False)])
def test_a_doubled_shape_wins_when_staged_and_is_skipped_when_its_base_is_far_behind(
        monkeypatch: pytest.MonkeyPatch, base_behind: float, staged: bool) -> None:
    # synthetic prices on a real split: every shape 1.0 but the rule's doubled shapes (base of two or
    # more middle stages) 0.9, the cheapest, and their bases 1 + base_behind. Within the margin such
    # a shape is staged and leads the search; past it, it is never staged -- the heuristic's risk,
    # taken because on every benchmark batch no plan depended on a doubled shape (docs/design.md
    # §2.1). Shapes doubling one middle stage are staged either way
    split, rates = _owner_split()
    shapes = stage_shapes(split, rates, 1e9)
    ruled = [s for s in shapes if candidates._skippable(s)]
    exempt = [s for s in shapes if s.doubles and s not in ruled]
    assert ruled and exempt  # the batch has both kinds
    bases = {(s.doubles, s.end_weight) for s in ruled}
    real_stage = candidates.stage
    shape_of: dict[int, object] = {}

    def stage(split, rates, shp, budget):
        st = real_stage(split, rates, shp, budget)
        shape_of[id(st)] = shp
        return st

    def price(st, *args):
        shp = shape_of[id(st)]
        if shp in ruled:
            return 0.9
        return 1.0 + base_behind if not shp.ring_fill and (shp.stages, shp.end_weight) in bases else 1.0

    monkeypatch.setattr(candidates, "stage", stage)
    monkeypatch.setattr(candidates, "price_staging", price)
    got = candidates._stagings(split, rates, 0.0, 1e9)
    tried = {shape_of[id(st)] for _, st in got}
    assert all((s in tried) == staged for s in ruled)
    assert all(s in tried for s in exempt)
    if staged:
        assert got[0][0] == 0.9 and shape_of[id(got[0][1])] in ruled


def test_one_middle_stage_doubled_to_two_is_always_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,024 GPUs (8 x 128, slimpajama 1M, MagiAttention's heads 64/8 on the H100 model: the scale
    # run's balanced layout): the shape doubling one middle stage to two is the fastest, 8.6% under
    # its base, which prices 3.6% behind the best staged before it. The shipped rule stages it and
    # ships the unpruned plan; without the exemption the plan is estimated 2.2% slower
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import hsap_plan

    cu = pack_batches("slimpajama", 1 << 20, 1, 0)[0]

    def plan():
        clear_plan_cache()
        return hsap_plan(cu, hw=sim_hardware("h100-fa3"), intra=8, inter=128, shape=full_shape(64, 8),
                         plan_options={"layout": "balanced", "layout_fallback": False})

    shipped = plan()
    monkeypatch.setattr(candidates, "_DOUBLED_MARGIN", float("inf"))
    unpruned = plan()
    assert ir_hash(shipped) == ir_hash(unpruned)
    monkeypatch.setattr(candidates, "_DOUBLED_MARGIN", 0.03)
    monkeypatch.setattr(candidates, "_DOUBLED_FROM", 1)
    without = plan()
    assert without.chosen.time > unpruned.chosen.time * 1.02  # not vacuous: the exemption decides this plan


@pytest.mark.slow
def test_pruned_search_ships_the_unpruned_plans_on_every_benchmark_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # the 167 Table 2 / Table 4 / MagiAttention batches (sim/estimate_accuracy) and both budget
    # points: a guard on the rule's premise. Measured when it was added: no plan of these batches,
    # of the 39 regression fixtures or of 176 random batches changed even with every doubled shape
    # skipped, so this fails only once a planner change makes a skipped shape win
    _same_plans_as_the_unpruned_search(monkeypatch, cases("all"), ((1 << 16, 8), (1 << 20, 64)))

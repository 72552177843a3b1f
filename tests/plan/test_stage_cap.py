"""The stage cap (plan/schedule.stage_cap, docs/design.md §2.1 step 3): no staging takes more
stages than it, whatever ``pool_bytes`` asks; a batch whose every candidate would need more is
refused before any staging with a ``PoolSizeError`` naming a pool that could hold it, and a
windowed or ``flatten="auto"`` compile keeps the plan that fits when another one would not.

Before the cap, a pool far below the default cut the work into thousands of stages (a 227K-token
batch at 8x16 under a 1 MiB pool: 3,448 stages, 23,887 blocks in one staging, 490 s and 5.4 GB to
compile; docs/enable.md §7.4). The tests count stages, stagings and refusals, never seconds.

Reference: the stage counts are read off every ``StagedBlocks`` the compile makes; the pool
bound is checked against the uncut footprints summed here."""

from __future__ import annotations

import re

import pytest

from megatron_hsap.errors import ConfigError, PoolSizeError
from megatron_hsap.plan import candidates, clear_plan_cache, compile_plan, schedule
from megatron_hsap.plan.cuts import footprint
from megatron_hsap.plan.placement import plan_rates
from megatron_hsap.plan.schedule import BlocksByRank, StagingError, stage, stage_cap, stage_shapes

DOC = [0, 16384]  # one document over 4 inter ranks: the last one fetches 3 chunks of kv
HEADS = dict(num_heads=8, num_kv_heads=8, head_dim=64, flatten="never")
SMALL = 1 << 16  # 64 KiB, 512x below this batch's default pool (32 MiB)


@pytest.fixture
def stagings(monkeypatch):
    """Every staging a compile makes (its stage count) and every refusal of the cap: a
    ``_cut_remote`` past it, or no shape offered (``stage_shapes``: the footprints alone fill it)."""
    seen: dict[str, list] = {"stages": [], "refused": []}
    stage_fn, cut_fn, shapes_fn = schedule._stage, schedule._cut_remote, candidates.stage_shapes

    def counted_stage(*args):
        st = stage_fn(*args)
        seen["stages"].append(st.stages)
        return st

    def counted_cut(*args):
        try:
            return cut_fn(*args)
        except StagingError as e:
            seen["refused"].append(e)
            raise

    def counted_shapes(*args):
        got = shapes_fn(*args)
        if not got:
            seen["refused"].append("no shape")
        return got

    monkeypatch.setattr(schedule, "_stage", counted_stage)
    monkeypatch.setattr(candidates, "stage_shapes", counted_shapes)
    monkeypatch.setattr(schedule, "_cut_remote", counted_cut)
    clear_plan_cache()
    yield seen
    clear_plan_cache()


def test_cap_covers_every_work_balance_shape() -> None:
    # stage_shapes' work-balance shapes reach 2 * max(8, 2P) middle stages plus two end stages
    for size in (1, 2, 4, 8, 16, 64, 128):
        assert stage_cap(size) >= 2 * max(8, 2 * size) + 2
    assert stage_cap(4) == 130 and stage_cap(16) == 130 and stage_cap(64) == 514


def test_small_pool_plan_stays_under_the_cap(stagings) -> None:
    # a 128-token window moves little: the pool binds, the cap refuses the finest cuts, and the
    # plan that comes out fits both
    plan = compile_plan(DOC, 4, window_size=(128, 0), pool_bytes=SMALL, **HEADS)
    plan.verify()
    cap = 130  # stage_cap(4), spelled out: the test must fail if the cap lifts
    assert stagings["stages"] and max(stagings["stages"]) <= cap
    assert stagings["refused"], "the pool never pressed the cap: the test lost its point"
    s = plan.stats()
    assert s.stages <= cap
    assert s.pool_peak_bytes <= plan.pool_capacity == SMALL


def test_stage_refuses_past_the_cap() -> None:
    plan = compile_plan(DOC, 4, **HEADS)  # the default pool: a few stages of large remote blocks
    rates = plan_rates(plan.shape, plan.hardware, plan.link, plan.options, plan.layout.segment_starts())
    split = BlocksByRank.of(list(plan.chosen.units), 4)  # (its staged blocks: the remote ones still travel)
    held = max(sum(footprint(u, rates) for u in rem) for rem in split.remote)
    cap = stage_cap(4)
    # a budget the uncut footprints overfill within the cap: no shape is offered at all
    assert stage_shapes(split, rates, held / (cap - 2) * 0.99) == []
    # shapes offered past the cap (``max_stages``): cutting stops at the cap all the same
    budget = held / (cap - 2) / 2
    shapes = stage_shapes(split, rates, budget, max_stages=4 * cap)
    assert shapes and max(s.stages for s in shapes) > cap
    for shp in shapes:
        with pytest.raises(StagingError, match="more than 128 middle stages"):
            stage(split, rates, shp, budget)


def test_pool_too_small_is_refused_before_any_staging(stagings) -> None:
    with pytest.raises(PoolSizeError) as e:
        compile_plan(DOC, 4, pool_bytes=SMALL, **HEADS)
    assert isinstance(e.value, ConfigError)
    assert stagings["stages"] == [], "refused by the footprint bound, nothing staged"
    msg = str(e.value)
    assert f"pool_bytes={SMALL} is too small" in msg and "--hsap-pool-bytes" in msg and "more than 130 stages" in msg
    need = int(re.search(r"at least (\d+) bytes", msg).group(1))
    default = int(re.search(r"default: (\d+) bytes", msg).group(1))
    assert SMALL < need < default
    # the named pool is a lower bound: below it the batch is refused too, the default compiles
    with pytest.raises(PoolSizeError):
        compile_plan(DOC, 4, pool_bytes=int(need * 0.9), **HEADS)
    plan = compile_plan(DOC, 4, pool_bytes=default, **HEADS)
    assert plan.stats().stages <= stage_cap(4)


def test_windowed_plan_kept_when_the_full_plan_is_refused() -> None:
    # a window is never estimated slower than its batch's full plan clipped (no_slower_than_full);
    # here the full plan cannot be compiled under the pool, so the windowed plan stands alone
    clear_plan_cache()
    with pytest.raises(PoolSizeError):
        compile_plan(DOC, 4, pool_bytes=SMALL, **HEADS)
    plan = compile_plan(DOC, 4, window_size=(128, 0), pool_bytes=SMALL, **HEADS)
    assert not any("full plan clipped" in n for n in plan.alternatives)


def test_flatten_auto_keeps_the_topology_that_fits() -> None:
    # 2x2 inside a node: the configured SAP plan and the one-level SAP plan need more stages than
    # the cap under this pool, the one-level all-to-all (4 x 1) moves nothing through it
    kw = dict(HEADS, flatten="auto", link="nvlink", pool_bytes=SMALL)
    clear_plan_cache()
    plan = compile_plan(DOC, 2, 2, **kw)
    assert (plan.intra_size, plan.inter_size) == (4, 1)
    assert plan.options.flattened_from == (2, 2)
    with pytest.raises(PoolSizeError, match="inter_size=2"):
        compile_plan(DOC, 2, 2, **dict(kw, flatten="never"))
    with pytest.raises(PoolSizeError, match="flattened from 2x2"):
        compile_plan(DOC, 2, 2, **dict(kw, flatten="always"))


@pytest.mark.parametrize("pool", [1 << 16, 1 << 20])
def test_fuzz_batch_compiles_under_a_small_pool(stagings, pool) -> None:
    # the planner fuzz's case: 227,113 tokens in 4 documents at 8x16, 64/32 heads of 64, a 1K
    # window. Before the cap: 1 MiB took 490 s and 5.4 GB (3,448 stages in one staging), 64 KiB ran
    # out of a 6 GB limit. Now both compile (1.8 s and 1.9 s measured) and every staging is capped
    cu = [0, 109614, 147835, 206573, 227113]
    plan = compile_plan(cu, 16, 8, num_heads=64, num_kv_heads=32, head_dim=64, window_size=(1024, 0), flatten="never",
                        head_chunks=1, pool_bytes=pool)
    assert max(stagings["stages"]) <= 130  # stage_cap(16)
    s = plan.stats()
    assert s.stages <= 130 and s.pool_peak_bytes <= pool
    plan.verify()

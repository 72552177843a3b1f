"""The compile-time pricing shortcuts (issue 14 item 5) change no number: each fast path equals
the plain computation it replaced, exactly (``==`` on floats: the planner's choices compare these).
The construction shortcuts: ``test_compile_speed_equal.py``.

References: a per-block Python loop over the staged blocks for the bytes per rank and round
(``traffic.staged_traffic``); the tuple construction for ``_arrays``; freshly built groups and
splits for the memoised ones (``BlockGroups.shared``, ``stage``/``price_staging``'s memo,
``phase_time``'s rows memo, ``_local_rates``); the numpy forms for the Python loops that price
small stagings (``_staged_traffic_py``, ``_block_costs_py``, ``path_seconds_py``,
``_price_small``), a fresh computation for ``price_staging``'s content memo and one pass over
all ranks for the per-rank local-rates memo."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.estimate import (BlockGroups, _arrays, _local_rates_of, block_costs, phase_time, price_staging)
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.plan import _BUDGET_FRACTION
from megatron_hsap.plan.schedule import BlocksByRank, default_shape, stage, stage_shapes
from megatron_hsap.plan.traffic import same_node, staged_traffic
from megatron_hsap.plan.workloads import pack_batches
from tests.plan.speed_equal_cases import SMALL
from tests.plan.speed_equal_cases import plan_and_rates as _plan_and_rates
from tests.plan.speed_equal_cases import split_and_stagings


CASES = [("fineweb", 8192, 4, 0, {}), ("sharegpt", 8192, 16, 1, {}),  # 16 inter ranks: InfiniBand, 8 per node
         ("ultrachat", 16384, 8, 2, {"layout": "contiguous"})]


@pytest.mark.parametrize("window", [None, (300, 0)])
def test_arrays_equals_the_tuple_construction(window) -> None:
    plan, _ = _plan_and_rates("fineweb", 131072, 8, 0, window_size=window)
    units = list(plan.chosen.units)
    assert len(units) > 96  # both forms: the column form above 96 blocks, cached ``work`` up to it
    for part in (units, units[:96], units[-7:]):
        ref = np.array([(u.rank, u.stage, u.q.start, u.q.stop, u.kv.start, u.kv.stop, u.work, u.causal, u.q_owner,
                         u.kv_owner) for u in part], dtype=np.int64)
        a = _arrays(part)
        assert a.dtype == np.int64 and a.flags.writeable and a.shape == (len(part), 10) and np.array_equal(a, ref)
    assert _arrays([]).shape == (0, 10)


def _traffic_by_loop(units, size: int, n: int, rates: CostRates):
    """[4 rows: sent fwd, recv fwd, sent bwd, recv bwd][link][rank][round] bytes and each phase's
    set of exchanging (round, r, p) both ways and bytes per send (round, src, dst, link), one block
    at a time (inputs once per rank, stage and range; results once per block)."""
    same = same_node(rates, size)
    t = np.zeros((4, 2, size, n))
    pairs: list[set] = [set(), set()]
    sends: list[dict] = [{}, {}]
    seen = set()
    for u in units:
        for owner, toks, f_in, b_in, f_out, b_out in ((u.q_owner, u.q, rates.q, rates.q_bwd, rates.o_lse, rates.dq),
                                                      (u.kv_owner, u.kv, rates.kv, rates.kv, 0.0, rates.dkv)):
            if owner == u.rank:
                continue
            link = int(same[u.rank, owner]) if same is not None else 0
            nt = toks.stop - toks.start
            k_in, k_out = (u.stage - 1) % n, u.stage + 1
            key = (u.rank, u.stage, owner, toks.start, toks.stop)
            moves = [] if key in seen else [(k_in, owner, u.rank, f_in, b_in)]
            seen.add(key)
            moves.append((k_out, u.rank, owner, f_out, b_out))
            for k, src, dst, fb, bb in moves:
                for ph, per in ((0, fb), (1, bb)):
                    if per:
                        t[2 * ph, link, src, k] += nt * per
                        t[2 * ph + 1, link, dst, k] += nt * per
                        pairs[ph] |= {(k, src, dst), (k, dst, src)}
                        sends[ph][(k, src, dst, link)] = sends[ph].get((k, src, dst, link), 0.0) + nt * per
    return (t if same is not None else t[:, 0]), pairs, sends


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES)
def test_staged_traffic_equals_a_loop_over_blocks(workload, T, inter, seed, kw) -> None:
    plan, rates = _plan_and_rates(workload, T, inter, seed, **kw)
    units = [u for u in plan.chosen.units if not u.is_local]
    if not units:
        pytest.skip("no remote block on this batch")
    n = 2 + max(u.stage for u in units)
    ref, ref_pairs, ref_sends = _traffic_by_loop(units, inter, n, rates)
    for ph, tr in enumerate(staged_traffic(_arrays(units), inter, n, rates)):
        assert np.array_equal(tr.sent, ref[2 * ph]) and np.array_equal(tr.recv, ref[2 * ph + 1])
        # why exact: whole bytes, exact sums in any order
        assert dict(zip(map(tuple, tr.flows.tolist()), tr.nbytes.tolist())) == ref_sends[ph]
        assert set(map(tuple, tr.pairs.tolist())) == ref_pairs[ph]
        assert list(map(tuple, tr.pairs.tolist())) == sorted(ref_pairs[ph])


@pytest.mark.parametrize("workload,T,inter,seed,kw", CASES)
def test_memoised_pricing_equals_fresh(workload, T, inter, seed, kw) -> None:
    plan, rates = _plan_and_rates(workload, T, inter, seed, **kw)
    units = list(plan.chosen.units)
    a = _arrays(units)
    n = 2 + int(a[:, 1].max())
    # block costs: the second phase reuses the groups' shared launch grids and indices
    g = BlockGroups.of(a, inter, n, rates)
    for phase in (Phase.FWD, Phase.BWD, Phase.FWD):
        got, fresh = block_costs(a, inter, n, rates, phase, g), block_costs(a, inter, n, rates, phase)
        for x, y in zip((got.kernel, got.fixed, got.launch, got.after), (fresh.kernel, fresh.fixed, fresh.launch, fresh.after)):
            assert np.array_equal(x, y)
    assert len(g.shared) == 1
    # phase_time: rows memoised for the last list, never reused for another one
    msgs = plan.raw_messages("fwd")
    first = phase_time(units, msgs, inter, rates.sec_fwd, rates.bw, plan.hardware.latency(plan.link), rates=rates, phase="fwd")
    again = phase_time(list(units), msgs, inter, rates.sec_fwd, rates.bw, plan.hardware.latency(plan.link), rates=rates, phase="fwd")
    assert first.total == again.total and np.array_equal(first.compute, again.compute) and np.array_equal(first.work, again.work)
    moved = [u.at_stage(u.stage) for u in units[:-1]]  # another list (one block fewer): recomputed
    other = phase_time(moved, msgs, inter, rates.sec_fwd, rates.bw, plan.hardware.latency(plan.link), rates=rates, phase="fwd")
    assert other.work.sum() == first.work.sum() - units[-1].work
    # stage and price_staging: the same object and price again; equal to a fresh split's
    latency = plan.hardware.latency(plan.link)
    budget = plan.pool_capacity * _BUDGET_FRACTION
    placed = [u.at_stage(0) for u in units]
    split = BlocksByRank.of(placed, inter)
    for shp in stage_shapes(split, rates, budget):
        try:
            st = stage(split, rates, shp, budget)
        except Exception:  # a shape that cannot hold the split: the planner skips it too
            continue
        assert stage(split, rates, shp, budget) is st
        t = price_staging(st, inter, rates, latency)
        assert price_staging(st, inter, rates, latency) == t
        fresh_split = BlocksByRank.of(placed, inter)
        assert price_staging(stage(fresh_split, rates, shp, budget), inter, rates, latency) == t
    assert default_shape(stage_shapes(split, rates, budget)) in stage_shapes(split, rates, budget)


def test_local_rates_of_both_phases_equal_one_phase_each() -> None:
    plan, rates = _plan_and_rates("fineweb", 8192, 4, 0, layout="contiguous")
    placed = [u.at_stage(0) for u in plan.chosen.units]
    split = BlocksByRank.of(placed, 4)
    st = stage(split, rates, default_shape(stage_shapes(split, rates, 1e12)), 1e12)
    both = _local_rates_of(st, 4, rates)
    locs = [u for loc in st.local for u in loc]
    a = _arrays(locs)
    a[:, 1] = 0
    w = np.bincount(a[:, 0], weights=a[:, 6], minlength=4)
    for phase in (Phase.FWD, Phase.BWD):
        bc = block_costs(a, 4, 1, rates, phase, BlockGroups.of(a, 4, 1))
        spp, fixed = both[phase]
        has = w > 0
        assert np.array_equal(spp[has], bc.kernel[has, 0] / w[has]) and np.array_equal(fixed, bc.fixed[:, 0] - bc.launch)


# the Python-loop paths for small stagings (issue 14 item 5) against the numpy forms they stand
# in for: every stage shape of a chosen plan's placement, on an A100 (FA2: no grid or GQA terms)
# and an H100 (FA3: CTA grid, GQA dK/dV atomics, packed GQA), on one node and over InfiniBand
# (NVLink pairs: two link classes)
SMALL_CASES = [("fineweb", 8192, 4, 0, {"hardware": "a100"}), ("fineweb", 8192, 8, 0, {"hardware": "h100"}),
               ("sharegpt", 8192, 16, 1, {"hardware": "h100"}), ("ultrachat", 16384, 8, 2, {"layout": "contiguous"})]


def _stagings(plan, rates):
    """Every staging the planner could price for the chosen plan's blocks (each stage shape)."""
    return split_and_stagings(plan, rates)[1]


def _numpy_paths(monkeypatch) -> None:
    import megatron_hsap.plan.block_costs as bcm
    import megatron_hsap.plan.estimate as est
    import megatron_hsap.plan.traffic as trm

    monkeypatch.setattr(bcm, "_PY_ROWS", -1)
    monkeypatch.setattr(trm, "_PY_ROWS", -1)
    monkeypatch.setattr(est, "_PY_CELLS", -1)


@pytest.mark.parametrize("workload,T,inter,seed,kw", SMALL_CASES)
def test_small_staging_loops_equal_the_numpy_forms(workload, T, inter, seed, kw, monkeypatch) -> None:
    import megatron_hsap.plan.block_costs as bcm
    from megatron_hsap.plan.block_costs import _block_costs_py, _may_gather
    from megatron_hsap.plan.rank_path import path_seconds, path_seconds_py
    from megatron_hsap.plan.traffic import _staged_traffic_py

    plan, rates = _plan_and_rates(workload, T, inter, seed, **kw)
    latency = plan.hardware.latency(plan.link)
    sts = [st for st in _stagings(plan, rates) if st.remote]
    assert rates.kernel is not None
    assert any(len(st.remote) <= 96 and inter * (st.stages + 1) <= 256 for st in sts)  # the planner runs the loops here
    fast = []
    for st in sts:
        a, n = _arrays(st.remote), st.stages + 1
        with monkeypatch.context() as m:
            if _may_gather(a):  # block_costs_pair prices these with numpy (checked below); the loop
                # is the numpy form without gathered calls
                m.setattr(bcm, "_gatherable", lambda x: np.zeros(len(x), dtype=bool))
            g = BlockGroups.of(a, inter, n, rates)
            ref_bc = (block_costs(a, inter, n, rates, Phase.FWD, g), block_costs(a, inter, n, rates, Phase.BWD, g))
        for ref, got in zip(ref_bc, _block_costs_py(a, inter, n, rates)):
            for f in ("kernel", "fixed", "launch", "after"):
                x, y = getattr(ref, f), getattr(got, f)
                assert x.shape == y.shape and np.array_equal(x, y), f
        with monkeypatch.context() as m:
            import megatron_hsap.plan.traffic as trm
            m.setattr(trm, "_PY_ROWS", -1)
            ref_tr = staged_traffic(a, inter, n, rates)
        for ref, got in zip(ref_tr, _staged_traffic_py(a, inter, n, rates)):
            assert ref.sent.shape == got.sent.shape and np.array_equal(ref.sent, got.sent) and np.array_equal(ref.recv, got.recv)
            assert got.pairs.dtype == np.int64 and np.array_equal(ref.pairs, got.pairs)
            assert got.flows.dtype == np.int64 and np.array_equal(ref.flows, got.flows) and np.array_equal(ref.nbytes, got.nbytes)
            comp = np.arange(inter * n, dtype=np.float64).reshape(inter, n) * 1e-5 + 3e-4
            after = np.full((inter, n), 2e-6)
            bws = (rates.bw, rates.nvl_bw)
            for aft in (None, after):  # over InfiniBand with the per-flow cap (rates.flow_bw; inf under NVLink)
                assert path_seconds(comp, aft, ref.flows, ref.nbytes, bws, latency, rates.flow_bw) == path_seconds_py(
                    comp.tolist(), None if aft is None else aft.tolist(), ref.flows.tolist(), ref.nbytes.tolist(), bws, latency,
                    rates.flow_bw)
        fast.append(price_staging(replace(st, memo=None, memo_key=None), inter, rates, latency))
    with monkeypatch.context() as m:
        _numpy_paths(m)
        plain = [price_staging(replace(st, memo=None, memo_key=None), inter, rates, latency) for st in sts]
    assert fast == plain  # each staging's price, bit for bit


def test_small_paths_give_the_same_plans(monkeypatch) -> None:
    """A whole compile with the loops and with numpy only: the same plan and estimates."""
    from megatron_hsap.plan.fingerprint import plan_hash

    cu = pack_batches("fineweb", 16384, 2, 3)[1]
    clear_plan_cache()
    fast = compile_plan(cu, 8, **SMALL, hardware="h100")
    with monkeypatch.context() as m:
        _numpy_paths(m)
        clear_plan_cache()
        plain = compile_plan(cu, 8, **SMALL, hardware="h100")
    clear_plan_cache()
    assert plan_hash(fast) == plan_hash(plain) and fast.chosen.time == plain.chosen.time and fast.owner_time == plain.owner_time


def test_an_equal_staging_reuses_its_price() -> None:
    """``price_staging``'s content memo: a staging equal to one priced before (other objects, the
    same rows and budgets) gets the price a fresh computation gives; a different one does not."""
    plan, rates = _plan_and_rates("fineweb", 8192, 8, 0, hardware="h100")
    latency = plan.hardware.latency(plan.link)
    st = next(s for s in _stagings(plan, rates) if s.remote)
    t = price_staging(st, 8, rates, latency)
    twin = replace(st, remote=tuple(u.at_stage(u.stage) for u in st.remote), local_budget=st.local_budget.copy())
    assert twin.remote == st.remote and all(x is not y for x, y in zip(twin.remote, st.remote))
    assert price_staging(twin, 8, rates, latency) == t == price_staging(replace(st, memo=None, memo_key=None), 8, rates, latency)
    bumped = st.local_budget.copy()
    bumped[bumped > 0] *= 1.5  # more local work per stage: a slower staging
    other = replace(st, local_budget=bumped, remote_work=st.remote_work)
    assert price_staging(other, 8, rates, latency) == price_staging(replace(other, memo=None, memo_key=None), 8, rates, latency) > t


def test_local_rates_per_rank_memo_equals_one_pass_over_all_ranks() -> None:
    """``_local_rates_of`` memoises each rank's numbers across splits; they equal one pass over
    every rank's local blocks at once (``_local_rates_batch``), for splits sharing some blocks."""
    import megatron_hsap.plan.estimate as est

    plan, rates = _plan_and_rates("fineweb", 8192, 8, 0, layout="contiguous")
    placed = [u.at_stage(0) for u in plan.chosen.units]
    rates.local_memo.clear()
    first = BlocksByRank.of(placed, 8)
    # a second split: rank 0's first local block cut in two (new objects), every other block shared
    r0 = [u for u in placed if u.rank == 0 and u.is_local][0]
    from megatron_hsap.plan.cuts import split_rows
    x, y = split_rows(r0, r0.q.start + len(r0.q) // 2)
    second = BlocksByRank.of([v for u in placed for v in ((x, y) if u is r0 else (u,))], 8)
    for split in (first, second, first):
        st = stage(split, rates, default_shape(stage_shapes(split, rates, 1e12)), 1e12)
        got = est._local_rates_of(st, 8, rates)
        ref = est._local_rates_batch([u for loc in st.local for u in loc], 8, rates)
        for phase in (Phase.FWD, Phase.BWD):
            has = np.array([bool(loc) for loc in st.local])
            assert np.array_equal(got[phase][0][has], ref[phase][0][has]) and np.array_equal(got[phase][1], ref[phase][1])
    assert len(rates.local_memo) == 9  # 8 ranks + rank 0 again

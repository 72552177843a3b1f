"""The compile-time shortcuts (issue 14 item 5) change no number: each fast path equals the plain
computation it replaced, exactly (``==`` on floats: the planner's choices compare these).

References: the dataclass constructors and ``dataclasses.replace``; a per-block Python loop over
the staged blocks for the bytes per rank and round (``traffic.staged_traffic``); freshly built
groups and splits for the memoised ones (``BlockGroups.shared``, ``stage``/``price_staging``'s
memo, ``phase_time``'s rows memo, ``_local_rates``); the numpy forms for the Python loops that
price small stagings (``_staged_traffic_py``, ``_block_costs_py``, ``path_seconds_py``,
``_price_small``), a fresh computation for ``price_staging``'s content memo and one pass over
all ranks for the per-rank local-rates memo. Plans of whole batches are covered by
``tests/plan/plan_regression_cases.py --check`` (plan hashes of fixed batches)."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.estimate import (BlockGroups, _arrays, _local_rates_of, block_costs, phase_time, price_staging)
from megatron_hsap.plan.ir import (ComputeItem, Phase, Send, TokenRange, Unit, Wire, new_compute_item, new_send, new_unit,
                                   positional_builder)
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.options import inter_rank_nodes
from megatron_hsap.plan.plan import _link_of, _BUDGET_FRACTION
from megatron_hsap.plan.schedule import BlocksByRank, StagingError, default_shape, stage, stage_shapes
from megatron_hsap.plan.traffic import same_node, staged_traffic
from megatron_hsap.plan.units import WorkUnit
from megatron_hsap.plan.window import banded_pairs
from megatron_hsap.plan.workloads import pack_batches

SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def _plan_and_rates(workload: str, T: int, inter: int, seed: int, **kw):
    clear_plan_cache()
    cu = pack_batches(workload, T, seed + 1, 0)[seed]
    plan = compile_plan(cu, inter, **SMALL, **kw)
    hw, link = plan.hardware, plan.link
    rates = CostRates.of(plan.shape, hw, hw.bandwidth(link), inter_rank_nodes(plan.options, link),
                         plan.layout.segment_starts(), hw.flow_bandwidth(link, inter))  # as compile_plan builds them
    return plan, rates


CASES = [("fineweb", 8192, 4, 0, {}), ("sharegpt", 8192, 16, 1, {}),  # 16 inter ranks: InfiniBand, 8 per node
         ("ultrachat", 16384, 8, 2, {"layout": "contiguous"})]


def test_unit_builders_equal_the_dataclass_constructors() -> None:
    r = TokenRange
    u = Unit(3, r(10, 20), r(0, 20), True, 1, 2, 0, 4, 7)
    assert u.at_stage(5) == Unit(3, r(10, 20), r(0, 20), True, 1, 2, 0, 5, 7)
    assert repr(u.at_stage(5)) == repr(replace(u, stage=5))
    v = new_unit(3, r(10, 20), r(0, 20), True, 1, 2, 0, 4, 7, -1)
    assert v == u and hash(v) == hash(u) and [getattr(v, f.name) for f in fields(Unit)] == [getattr(u, f.name) for f in fields(Unit)]
    s = Send(Wire.KV, r(0, 8), 3, 512, None)
    assert new_send(Wire.KV, r(0, 8), 3, 512, None) == s
    new_range = positional_builder(TokenRange)
    assert new_range(3, 9) == TokenRange(3, 9)
    with pytest.raises(ValueError):  # the builder still runs the class' __post_init__ checks
        new_range(9, 3)
    item = new_compute_item(r(10, 20), r(0, 20), True, ((Wire.Q, None),), ((Wire.O, None),), -1)
    assert item == ComputeItem(r(10, 20), r(0, 20), True, ((Wire.Q, None),), ((Wire.O, None),), -1)
    with pytest.raises(ValueError):
        new_compute_item(r(10, 20), r(0, 30), True, (), (), -1)  # causal needs kv.stop == q.stop


def test_cached_work_equals_banded_pairs_and_follows_replace() -> None:
    r = TokenRange
    for qs, qe, ks, ke, causal, left in [(10, 20, 0, 20, True, -1), (30, 40, 0, 12, False, -1), (50, 64, 20, 64, True, 9)]:
        u = Unit(0, r(qs, qe), r(ks, ke), causal, 0, 1, 0, 0, left)
        assert u.work == banded_pairs(qs, qe, ks, ke, left) == u.work  # computed, then cached
        assert u.at_stage(3).work == u.work  # carried over: the same rows
        w = replace(u, q=r(qs + 1, qe))  # new rows: the cache is not carried over
        assert w.work == banded_pairs(qs + 1, qe, ks, ke, left)
        wu = WorkUnit(0, r(qs, qe), r(ks, ke), causal, 0, 1, "A1", left)
        assert wu.work == u.work and wu == replace(wu)


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


@pytest.mark.parametrize("window", [None, (700, 0)])
def test_whole_head_rows_work_equals_the_cached_work(window) -> None:
    """``rebalance.balance`` reads a whole head's pairs as the work unit's cached ``work``."""
    from megatron_hsap.plan.placement import owner_computes

    kw = {} if window is None else {"window_size": window}
    plan, rates = _plan_and_rates("fineweb", 8192, 4, 0, **kw)
    units = list(plan.work_units)
    pl = owner_computes(units, 4, rates)
    assert units and all(pl.rows_work(i, u.q.start, u.q.stop) == float(u.work) for i, u in enumerate(units))
    assert any(u.window >= 0 for u in units) == (window is not None)


# the Python-loop paths for small stagings (issue 14 item 5) against the numpy forms they stand
# in for: every stage shape of a chosen plan's placement, on an A100 (FA2: no grid or GQA terms)
# and an H100 (FA3: CTA grid, GQA dK/dV atomics, packed GQA), on one node and over InfiniBand
# (NVLink pairs: two link classes)
SMALL_CASES = [("fineweb", 8192, 4, 0, {"hardware": "a100"}), ("fineweb", 8192, 8, 0, {"hardware": "h100"}),
               ("sharegpt", 8192, 16, 1, {"hardware": "h100"}), ("ultrachat", 16384, 8, 2, {"layout": "contiguous"})]


def _stagings(plan, rates):
    """Every staging the planner could price for the chosen plan's blocks (each stage shape)."""
    budget = plan.pool_capacity * _BUDGET_FRACTION
    split = BlocksByRank.of([u.at_stage(0) for u in plan.chosen.units], plan.options.inter_size)
    out = []
    for shp in stage_shapes(split, rates, budget):
        try:
            out.append(stage(split, rates, shp, budget))
        except StagingError:
            continue
    return out


def _numpy_paths(monkeypatch) -> None:
    import megatron_hsap.plan.block_costs as bcm
    import megatron_hsap.plan.estimate as est
    import megatron_hsap.plan.traffic as trm

    monkeypatch.setattr(bcm, "_PY_ROWS", -1)
    monkeypatch.setattr(trm, "_PY_ROWS", -1)
    monkeypatch.setattr(est, "_PY_CELLS", -1)


@pytest.mark.parametrize("workload,T,inter,seed,kw", SMALL_CASES)
def test_small_staging_loops_equal_the_numpy_forms(workload, T, inter, seed, kw, monkeypatch) -> None:
    from megatron_hsap.plan.block_costs import _block_costs_py
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
        g = BlockGroups.of(a, inter, n, rates)
        for ref, got in zip((block_costs(a, inter, n, rates, Phase.FWD, g), block_costs(a, inter, n, rates, Phase.BWD, g)),
                            _block_costs_py(a, inter, n, rates)):
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


def _variants_in_full(batch, size: int, token_cost: float, window: int):
    """``balanced_layout``'s choice with every greedy variant run to its end (the plain selection)."""
    from megatron_hsap.plan import balanced as B

    chunk = batch.padded_tokens // size
    starts, lengths = batch.doc_starts, np.diff(batch.doc_starts)
    work = batch.doc_work(window).astype(float)
    tau = float(work.sum()) / size
    must = np.clip(np.ceil(lengths / chunk), 1, size).astype(np.int64)
    plain = np.clip(np.maximum(np.ceil(work / tau) if tau else 1, must), 1, size).astype(np.int64)
    dense = B._split_counts(lengths, work, size, chunk) if size > 1 else plain
    splits = [must]
    for k_of in (plain, dense):
        if not any(np.array_equal(k_of, x) for x in splits):
            splits.append(k_of)
    variants = []
    for k_of, projected in [*((k, False) for k in splits), (None, False), (None, True)]:
        held, cost = B._assign(starts, lengths, work, k_of, size, chunk, projected, token_cost, window)
        variants.append((float(cost.max()), sum(map(len, held)), held))
    low = min(v[0] for v in variants)
    held = min((v for v in variants if v[0] <= low * 1.005), key=lambda v: (v[1], v[0]))[2]
    return [sorted(h) for h in held]


@pytest.mark.parametrize("workload, T, size, token_cost, window", [
    ("fineweb", 1 << 16, 8, 0.0, -1), ("fineweb", 1 << 16, 8, 300.0, -1), ("sharegpt", 1 << 17, 16, 40.0, -1),
    ("slimpajama", 1 << 18, 32, 120.0, -1), ("fineweb", 1 << 17, 16, 80.0, 4096)])
def test_abandoned_layout_variants_keep_the_same_layout(workload, T, size, token_cost, window, monkeypatch) -> None:
    """A variant stopped once a rank costs more than 1.005 × the cheapest finished one (and the
    most-split-first order) keeps the layout every variant run in full keeps; the inputs stop some."""
    from megatron_hsap.plan import balanced as B
    from megatron_hsap.plan.layout import Batch

    stopped = []
    assign = B._assign

    def counting(*a, **k):
        try:
            return assign(*a, **k)
        except B._Abandoned:
            stopped.append(a[3] is None)
            raise

    monkeypatch.setattr(B, "_assign", counting)
    for seed in range(3):
        batch = Batch.build(pack_batches(workload, T, seed + 1, 0)[seed], size * 8)
        layout = B.balanced_layout(batch, size, 8, token_cost, window)
        got = [sorted((s.tokens.start, s.tokens.stop) for s in segs) for segs in layout.segments]
        ref = _variants_in_full(batch, size, token_cost, window)
        merged = []
        for h in ref:  # neighbours on one rank merged, as balanced_layout's segments are
            m: list[list[int]] = []
            for a, b in h:
                if m and m[-1][1] == a:
                    m[-1][1] = b
                else:
                    m.append([a, b])
            merged.append([tuple(x) for x in m])
        assert got == merged
    assert stopped, "the inputs must exercise the early stop"


def _build_units_plain(batch, layout, window: int):
    """The construction ``build_units`` replaced: ``np.searchsorted`` per segment, keyword
    constructors, ``pattern_of`` and ``clip_unit`` per block, work left to ``causal_work``."""
    from megatron_hsap.plan.units import Piece, clip_unit, pattern_of

    pieces = []
    starts = batch.doc_starts
    for rank, segs in enumerate(layout.segments):
        for s in segs:
            a, b = s.tokens.start, s.tokens.stop
            d = int(np.searchsorted(starts, a, side="right") - 1)
            while a < b:
                end = min(b, int(starts[d + 1]))
                pieces.append(Piece(d, TokenRange(a, end), rank, s.local_start + (a - s.tokens.start)))
                a, d = end, d + 1
    pieces.sort(key=lambda p: p.tokens.start)
    by_doc: dict[int, list] = {}
    for p in pieces:
        by_doc.setdefault(p.doc, []).append(p)
    units = []
    for doc in sorted(by_doc):
        plist = by_doc[doc]
        for qi, qp in enumerate(plist):
            for kp in plist[: qi + 1]:
                if window >= 0 and qp.tokens.start - window >= kp.tokens.stop:
                    continue
                causal = kp is qp
                u = clip_unit(WorkUnit(doc, qp.tokens, kp.tokens, causal, qp.owner, kp.owner,
                                       pattern_of(qp.tokens, kp.tokens, causal, layout.chunk_tokens), window), window)
                if u is not None:
                    units.append(u)
    return pieces, units


@pytest.mark.parametrize("window", [-1, 2048])
@pytest.mark.parametrize("layout_name", ["contiguous", "balanced"])
def test_build_units_equals_the_plain_construction(layout_name, window) -> None:
    """``build_units``'s fast path: the same pieces and blocks (fields, order) as the plain
    construction, and each block's preset work equal to ``causal_work`` computed afresh."""
    from megatron_hsap.plan.balanced import balanced_layout
    from megatron_hsap.plan.layout import Batch, contiguous_layout
    from megatron_hsap.plan.units import build_units, causal_work

    for workload, T, size in [("fineweb", 1 << 16, 8), ("sharegpt", 1 << 17, 16), ("slimpajama", 1 << 18, 32)]:
        batch = Batch.build(pack_batches(workload, T, 1, 0)[0], size * 4)
        layout = (contiguous_layout(batch, size, 4) if layout_name == "contiguous"
                  else balanced_layout(batch, size, 4, 50.0, window))
        pieces, units = build_units(batch, layout, window)
        ref_pieces, ref_units = _build_units_plain(batch, layout, window)
        assert pieces == ref_pieces and units == ref_units
        assert [u.work for u in units] == [causal_work(u.q, u.kv, u.causal, u.window) for u in ref_units]
        assert len({u.pattern for u in units}) >= 2


def test_start_sums_equal_the_per_block_form() -> None:
    """``placement._start_sums`` (one pass, memoised on the compile's rates for the three starts)
    equals adding each block's work and ``kv_side`` traffic per block with ``_plus``, bit for bit;
    a fresh copy each call (a start's updates never reach the next one)."""
    from megatron_hsap.plan import placement as PL
    from megatron_hsap.plan.balanced import balanced_layout
    from megatron_hsap.plan.layout import Batch
    from megatron_hsap.plan.units import build_units

    plan, rates = _plan_and_rates("sharegpt", 1 << 17, 16, 0)
    batch = plan.batch
    for layout in (balanced_layout(batch, 16, 1, 50.0), None):
        units = build_units(batch, layout)[1] if layout else build_units(batch, plan.layout)[1]
        work, traffic = [0.0] * 16, [PL._ZERO] * 16
        for u in units:
            work[u.q_owner] += u.work
        for u in units:
            if u.q_owner != u.kv_owner:
                kv = rates.kv_side(u.kv.stop - u.kv.start)
                traffic[u.kv_owner] = PL._plus(traffic[u.kv_owner], kv)
                traffic[u.q_owner] = PL._plus(traffic[u.q_owner], PL._mirror(kv))
        for _ in range(2):
            pl = PL.owner_computes(units, 16, rates)
            assert pl.work == work and pl.traffic == traffic
            assert all((a is PL._ZERO) == (b is PL._ZERO) for a, b in zip(pl.traffic, traffic))
            pl.work[0] += 1.0  # a start's own changes stay its own
        assert any(t is not PL._ZERO for t in traffic)
    assert len(rates.start_memo) == 2


def test_placement_copies_share_band_lists_safely() -> None:
    """``Placement.copy`` shares the per-block band lists (values: replaced, never changed in
    place): rebalancing copies of a start leaves the start's lists as they were, and gives what a
    rebalance of a deep copy gives."""
    from megatron_hsap.plan.placement import Placement, owner_computes, region_distflash
    from megatron_hsap.plan.rebalance import balance
    from megatron_hsap.plan.units import build_units

    plan, rates = _plan_and_rates("sharegpt", 1 << 17, 16, 0, layout="contiguous")
    units = build_units(plan.batch, plan.layout)[1]
    moved = 0
    for start in (owner_computes(units, 16, rates), region_distflash(units, 16, rates)):
        snap = [list(b) for b in start.bands]
        state = (list(start.home), list(start.work), list(start.traffic))
        for beta in (1.0, 0.25):
            got = balance(start, traffic_budget=beta)
            deep = Placement(start.name, units, rates, 16, list(start.work), list(start.traffic), list(start.home),
                             [list(b) for b in start.bands], start.base)
            ref = balance(deep, traffic_budget=beta)
            assert (got.home, got.bands, got.work, got.traffic) == (ref.home, ref.bands, ref.work, ref.traffic)
            moved += got.bands != start.bands
        assert start.bands == snap and (start.home, start.work, start.traffic) == state
    assert moved

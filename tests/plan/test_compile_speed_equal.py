"""The compile-time shortcuts in building the plan's objects (issue 14 item 5) change no value:
each fast path equals the plain construction it replaced, exactly. The pricing shortcuts:
``test_compile_speed_equal_pricing.py``.

References: the dataclass constructors and ``dataclasses.replace`` (IR builders, cached work);
``banded_pairs`` for each block's work; every greedy variant of ``balanced_layout`` run to its
end; the per-segment, per-block construction ``build_units`` replaced; the per-block sums of a
placement's start; deep copies for ``Placement.copy``'s shared band lists. Plans of whole batches
are covered by ``tests/plan/plan_regression_cases.py --check`` (plan hashes of fixed batches)."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from megatron_hsap.plan.ir import ComputeItem, Send, TokenRange, Unit, Wire, new_compute_item, new_send, new_unit, positional_builder
from megatron_hsap.plan.units import WorkUnit
from megatron_hsap.plan.window import banded_pairs
from megatron_hsap.plan.workloads import pack_batches
from tests.plan.speed_equal_cases import plan_and_rates as _plan_and_rates


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
    per-document-LPT-first order) keeps the layout every variant run in full keeps; the inputs stop some."""
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

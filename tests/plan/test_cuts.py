"""plan/cuts.py: every cut (``split_rows``, ``split_cols``, ``grid_tiles``, ``cut_fitting_part``) returns
pieces that tile their unit's (q, k) pairs exactly — no pair lost or doubled — and keep its
document, owners, rank and stage; ``cut_fitting_part``'s part respects its work and pool-byte limits
(docs/design.md §2.1 step 3).

Reference: each unit's pair set is materialised as a boolean [T, T] mask here; pool bytes are
re-derived from ``CostRates`` (q rows: q+do+lse+delta in, dq out; kv rows: kv in, dkv out)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.cuts import (cut_fitting_part, cut_fitting_part_room, footprint, grid_tiles, needs_tiles, split_cols, split_rows,
                                     tiles_below)
from megatron_hsap.plan.hardware import HARDWARE, LinkClass
from megatron_hsap.plan.ir import TokenRange, Unit
from megatron_hsap.plan.placement import CostRates

N = 96
SHAPE = HeadShape(num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16)
HW = HARDWARE["h100"]
PR = CostRates.of(SHAPE, HW, HW.bandwidth(LinkClass.INFINIBAND))


def mask(u: Unit) -> np.ndarray:
    m = np.zeros((N, N), dtype=bool)
    m[u.q.start : u.q.stop, u.kv.start : u.kv.stop] = True
    return m & np.tril(np.ones((N, N), dtype=bool)) if u.causal else m


def bytes_of(u: Unit) -> float:
    fq, fk = PR.q_bwd + PR.dq, PR.kv + PR.dkv
    return (len(u.q) * fq if u.rank != u.q_owner else 0.0) + (len(u.kv) * fk if u.rank != u.kv_owner else 0.0)


def assert_tiles(u: Unit, parts: list[Unit]) -> None:
    total = np.zeros((N, N), dtype=np.int64)
    for p in parts:
        assert (p.doc, p.q_owner, p.kv_owner, p.rank, p.stage) == (u.doc, u.q_owner, u.kv_owner, u.rank, u.stage)
        assert p.work == int(mask(p).sum()) > 0
        total += mask(p)
    assert (total == mask(u)).all()


@st.composite
def units(draw) -> Unit:
    causal = draw(st.booleans())
    if causal:
        qe = draw(st.integers(2, N))
        qs = draw(st.integers(0, qe - 1))
        ks = draw(st.integers(0, qs))
        q, kv = TokenRange(qs, qe), TokenRange(ks, qe)
    else:
        ke = draw(st.integers(1, N - 1))
        ks = draw(st.integers(0, ke - 1))
        qs = draw(st.integers(ke, N - 1))
        q, kv = TokenRange(qs, draw(st.integers(qs + 1, N))), TokenRange(ks, ke)
    qo, ko, r = draw(st.sampled_from([(0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 1, 2)]))
    return Unit(0, q, kv, causal, qo, ko, r, stage=draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None)
@given(units(), st.data())
def test_splits_tile_their_unit(u: Unit, data) -> None:
    assert footprint(u, PR) == bytes_of(u)
    if len(u.q) >= 2:
        assert_tiles(u, list(split_rows(u, data.draw(st.integers(u.q.start + 1, u.q.stop - 1)))))
    if not u.causal and len(u.kv) >= 2:
        assert_tiles(u, list(split_cols(u, data.draw(st.integers(u.kv.start + 1, u.kv.stop - 1)))))


@settings(max_examples=60, deadline=None)
@given(units(), st.floats(1, 3000), st.floats(0.5, 60))
def test_cut_fitting_part_respects_work_and_room_and_tiles(u: Unit, work: float, room_rows: float) -> None:
    room = room_rows * (PR.q_bwd + PR.dq)
    part, rest = cut_fitting_part(u, work, room, PR)
    if part is None:
        assert rest == [u]
        return
    assert_tiles(u, [part, *rest])
    assert part.work <= work  # never more pairs than asked
    assert footprint(part, PR) <= room  # never more pool bytes than the room


@settings(max_examples=40, deadline=None)
@given(units(), st.floats(10, 4000), st.floats(2, 40))
def test_grid_tiles_tile_and_fit_the_budget(u: Unit, share: float, budget_rows: float) -> None:
    budget = budget_rows * (PR.q_bwd + PR.dq)
    tiles = grid_tiles(u, share, budget, PR)
    assert_tiles(u, tiles)
    if not needs_tiles(u, budget, PR):
        assert tiles == [u]
    elif not u.causal:  # rectangle tiles are sized so both inputs fit (one row and one column at least)
        one = (PR.q_bwd + PR.dq) + (PR.kv + PR.dkv)
        assert all(footprint(t, PR) <= max(budget, one) for t in tiles)


@settings(max_examples=80, deadline=None)
@given(units(), st.floats(1, 3000), st.floats(0.5, 60), st.floats(0, 1))
def test_the_room_a_cut_needs_gives_the_same_cut(u: Unit, work: float, room_rows: float, f: float) -> None:
    # cut_fitting_part_room's least room: any room from it up to the one asked cuts alike (what a
    # pool-overflow restaging under a smaller budget relies on to reuse a staging's cuts)
    room = room_rows * (PR.q_bwd + PR.dq)
    part, rest, need = cut_fitting_part_room(u, work, room, PR)
    assert (part, rest) == cut_fitting_part(u, work, room, PR)
    if part is None:
        assert need == -math.inf
        assert cut_fitting_part(u, work, room * f, PR)[0] is None  # why: a smaller room fits no row either
        return
    assert footprint(part, PR) <= need <= room  # why: the part's own bytes must fit
    for smaller in (need, need + (room - need) * f):
        assert cut_fitting_part(u, work, smaller, PR) == (part, rest)
    below = math.nextafter(need, -math.inf)
    if need > footprint(part, PR) or part is not u:
        return  # (the bytes did not bound this cut exactly at its footprint)
    assert cut_fitting_part(u, work, below, PR) != (part, rest)  # why: the whole block no longer fits


@settings(max_examples=60, deadline=None)
@given(units())
def test_tiles_below_is_where_tiling_starts(u: Unit) -> None:
    t = tiles_below(u, PR)
    if t == -math.inf:
        assert not needs_tiles(u, 1e-9, PR)
        return
    assert not needs_tiles(u, t, PR) and needs_tiles(u, math.nextafter(t, -math.inf), PR)

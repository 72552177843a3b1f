"""plan/placement.py: every starting placement (owner-computes, min-traffic, region-distflash)
places each block's rows on the block's q owner or kv owner, its placed pieces tile the block's
(q, k) pairs exactly, ``rows_work`` equals the brute-force pair count of any row band, the
per-rank work equals the placed pieces' work, and bytes sent equal bytes received per phase
(docs/design.md §2.1 step 2).

Reference: boolean masks of each block's pairs; owner-computes' traffic re-derived by hand
(the q owner fetches kv rows in both phases and returns dkv)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.balanced import balanced_layout
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import HARDWARE, LinkClass
from megatron_hsap.plan.ir import Wire
from megatron_hsap.plan.layout import Batch, contiguous_layout
from megatron_hsap.plan.placement import CostRates, min_traffic, owner_computes, region_distflash
from megatron_hsap.plan.units import build_units

SHAPE = HeadShape(num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16)
HW = HARDWARE["h100"]
PR = CostRates.of(SHAPE, HW, HW.bandwidth(LinkClass.INFINIBAND))
STARTS = (owner_computes, min_traffic, region_distflash)


def pairs(padded: int, q, kv, causal: bool) -> np.ndarray:
    m = np.zeros((padded, padded), dtype=bool)
    m[q.start : q.stop, kv.start : kv.stop] = True
    return m & np.tril(np.ones_like(m)) if causal else m


def setup(lengths, inter, which):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    batch = Batch.build(cu, inter)
    layout = contiguous_layout(batch, inter, 1) if which == "contiguous" else balanced_layout(batch, inter, 1)
    return batch, build_units(batch, layout)[1]


def check_placement(pl, batch, units, *, helpers: bool) -> None:
    T = batch.padded_tokens
    want = np.zeros((T, T), dtype=np.int64)
    for u in units:
        want += pairs(T, u.q, u.kv, u.causal)
    got = np.zeros((T, T), dtype=np.int64)
    work = np.zeros(pl.size)
    for p in pl.placed():
        m = pairs(T, p.q, p.kv, p.causal)
        assert p.work == int(m.sum())
        got += m
        work[p.rank] += p.work
        if not helpers:
            assert p.rank in (p.q_owner, p.kv_owner), p
    assert (got == want).all()  # the placed pieces tile the blocks: nothing lost, nothing twice
    assert np.array_equal(work, np.asarray(pl.work))  # exact: integer pair counts held in floats
    t = np.asarray(pl.traffic).reshape(pl.size, 4)
    # exact: sums of integer multiples of integer byte prices, far below 2**53
    assert t[:, 0].sum() == t[:, 1].sum() and t[:, 2].sum() == t[:, 3].sum()


cases = st.tuples(st.lists(st.integers(1, 80), min_size=1, max_size=5), st.integers(2, 4),
                  st.sampled_from(["contiguous", "balanced"]))


@settings(max_examples=20, deadline=None)
@given(cases)
def test_starting_placements_tile_and_keep_owners(case) -> None:
    batch, units = setup(*case)
    for start in STARTS:
        check_placement(start(units, case[1], PR), batch, units, helpers=False)


@settings(max_examples=20, deadline=None)
@given(cases, st.data())
def test_rows_work_is_the_brute_force_count_of_a_band(case, data) -> None:
    batch, units = setup(*case)
    pl = owner_computes(units, case[1], PR)
    for i, u in enumerate(units):
        x = data.draw(st.integers(u.q.start, u.q.stop))
        y = data.draw(st.integers(x, u.q.stop))
        band = pairs(batch.padded_tokens, u.q, u.kv, u.causal)[x:y]
        assert pl.rows_work(i, x, y) == int(band.sum())
        assert pl.rows_work(i, u.q.start, x) + pl.rows_work(i, x, u.q.stop) == u.work


def test_owner_computes_traffic_by_hand() -> None:
    # one document over 4 ranks of 16 tokens (contiguous): the q owner of each cross block fetches its kv
    batch, units = setup([64], 4, "contiguous")
    pl = owner_computes(units, 4, PR)
    kv, dkv = SHAPE.token_bytes(Wire.KV), SHAPE.token_bytes(Wire.DKV)
    assert kv == 2 * (16 + 16) * 2 and dkv == 2 * (16 + 16) * 4  # the wire formats of docs/design.md §4
    # rank r uses the kv of every earlier rank (r blocks of 16 rows) and serves 3 - r later ranks
    for r in range(4):
        sf, rf, sb, rb = pl.traffic[r]
        assert (sf, rf) == ((3 - r) * 16 * kv, r * 16 * kv)
        assert (sb, rb) == ((3 - r) * 16 * kv + r * 16 * dkv, r * 16 * kv + (3 - r) * 16 * dkv)
    assert pl.work == [sum(q + 1 for q in range(16 * r, 16 * (r + 1))) for r in range(4)]  # row q sees q + 1 keys
    assert [p.rank for p in pl.placed()] == [u.q_owner for u in units]


def test_region_distflash_moves_the_far_blocks_to_the_kv_owner() -> None:
    batch, units = setup([64], 4, "contiguous")
    pl = region_distflash(units, 4, PR)
    for p in pl.placed():
        dist = 2 * abs(p.q_owner - p.kv_owner)
        if dist > 4:
            assert p.rank == p.kv_owner
        elif dist < 4:
            assert p.rank == p.q_owner
    check_placement(pl, batch, units, helpers=False)

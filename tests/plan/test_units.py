"""plan/units.py: every causal (q, k) pair of every document lies in exactly one work unit, no
unit holds a pair across documents or above the diagonal, and ``WorkUnit.work`` equals the
brute-force count of its pairs (docs/design.md §2.1 step 1).

Reference: the T'×T' causal mask of the padded batch built here from ``cu_seqlens`` alone
(padding to a multiple of ``P_inter`` is one extra causal document, docs/design.md §1)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.balanced import balanced_layout
from megatron_hsap.plan.ir import TokenRange
from megatron_hsap.plan.layout import Batch, contiguous_layout
from megatron_hsap.plan.units import build_units, causal_work, pattern_of


def mask_of(cu: list[int], padded: int) -> np.ndarray:
    """[T', T'] bool: row q sees key k (same document, k <= q); the padding is one document."""
    bounds = sorted(set(cu) | {padded})
    doc = np.searchsorted(np.asarray(bounds), np.arange(padded), side="right")
    q = np.arange(padded)[:, None]
    k = np.arange(padded)[None, :]
    return (doc[:, None] == doc[None, :]) & (k <= q)


def block_mask(padded: int, q: TokenRange, kv: TokenRange, causal: bool) -> np.ndarray:
    m = np.zeros((padded, padded), dtype=bool)
    m[q.start : q.stop, kv.start : kv.stop] = True
    if causal:
        m &= np.tril(np.ones((padded, padded), dtype=bool))
    return m


packings = st.tuples(
    st.lists(st.integers(0, 70), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
    st.integers(1, 4),
    st.sampled_from(["contiguous", "balanced"]),
)


@settings(max_examples=25, deadline=None)
@given(packings)
def test_units_tile_every_documents_causal_mask_once(case) -> None:
    lengths, inter, which = case
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    batch = Batch.build(cu, inter)
    layout = contiguous_layout(batch, inter, 1) if which == "contiguous" else balanced_layout(batch, inter, 1)
    pieces, units = build_units(batch, layout)
    ref = mask_of(cu, batch.padded_tokens)
    count = np.zeros(ref.shape, dtype=np.int64)
    for u in units:
        m = block_mask(batch.padded_tokens, u.q, u.kv, u.causal)
        assert u.work == int(m.sum()) > 0  # no empty block is materialised
        assert not (m & ~ref).any(), f"unit {u} covers a masked pair"
        count += m
    assert (count == ref.astype(np.int64)).all()  # every unmasked pair exactly once
    # pieces: each token in exactly one piece, owned by the rank whose segment holds it
    held = np.zeros(batch.padded_tokens, dtype=np.int64)
    for p in pieces:
        held[p.tokens.start : p.tokens.stop] += 1
        seg_rank = [r for r, segs in enumerate(layout.segments)
                    for s in segs if s.tokens.start <= p.tokens.start and p.tokens.stop <= s.tokens.stop]
        assert seg_rank == [p.owner]
    assert (held == 1).all()
    # q_owner / kv_owner are the ranks holding those rows
    owner = {t: p.owner for p in pieces for t in range(p.tokens.start, p.tokens.stop)}
    for u in units:
        assert {owner[t] for t in range(u.q.start, u.q.stop)} == {u.q_owner}
        assert {owner[t] for t in range(u.kv.start, u.kv.stop)} == {u.kv_owner}


def test_causal_work_matches_brute_force_on_every_small_block() -> None:
    for qs in range(0, 6):
        for qe in range(qs + 1, 7):
            assert causal_work(TokenRange(qs, qe), TokenRange(0, qe), True) == int(
                block_mask(8, TokenRange(qs, qe), TokenRange(0, qe), True).sum())
            for ke in range(1, qs + 1):
                for ks in range(0, ke):
                    assert causal_work(TokenRange(qs, qe), TokenRange(ks, ke), False) == (qe - qs) * (ke - ks)


def test_pattern_names_follow_the_papers_figure3_rule() -> None:
    chunk = 8
    whole, part = TokenRange(8, 16), TokenRange(8, 12)
    kv_whole, kv_part = TokenRange(0, 8), TokenRange(4, 8)
    assert pattern_of(whole, whole, True, chunk) == "A1"
    assert pattern_of(whole, kv_whole, False, chunk) == "A2"
    assert pattern_of(whole, kv_part, False, chunk) == "A3"
    assert pattern_of(part, kv_whole, False, chunk) == "A4"
    assert pattern_of(part, kv_part, False, chunk) == "A5"

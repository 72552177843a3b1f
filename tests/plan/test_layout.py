"""plan/layout.py (and the balanced layout it validates): every layout holds each padded token
exactly once (the mapping global token -> (CP rank, local row) is a permutation), every inter
rank holds the same number of tokens, contiguous layouts hold consecutive chunks, and every CP
rank holds ``T'/P`` tokens (docs/design.md §1).

Reference: the permutation is re-derived from ``local_token_indices`` of every CP rank and
compared with ``np.arange(T')``; the contiguous chunks are computed here from ``T'``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.plan.balanced import balanced_layout
from megatron_hsap.plan.ir import Segment, TokenRange
from megatron_hsap.plan.layout import Batch, Layout, contiguous_layout, normalize_cu_seqlens, segment_pieces, validate_layout

cases = st.tuples(
    st.lists(st.integers(0, 90), min_size=1, max_size=7).filter(lambda ls: sum(ls) > 0),
    st.integers(1, 4),
    st.sampled_from([1, 2]),
)


@settings(max_examples=25, deadline=None)
@given(cases)
def test_layouts_are_equal_size_permutations(case) -> None:
    lengths, inter, intra = case
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    batch = Batch.build(cu, inter * intra)
    T = sum(lengths)
    padded = -(-T // (inter * intra)) * (inter * intra)
    assert (batch.num_tokens, batch.padded_tokens) == (T, padded)
    for layout in (contiguous_layout(batch, inter, intra), balanced_layout(batch, inter, intra)):
        validate_layout(layout, padded)
        ids = [layout.local_token_indices(c) for c in range(inter * intra)]
        assert {len(x) for x in ids} == {padded // (inter * intra)}
        assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(padded))  # a permutation
        owner, local = layout.owner_array(padded)
        for c, x in enumerate(ids):  # owner_array agrees with local_token_indices
            i, j = divmod(c, intra)
            assert (owner[x] == i).all()
            assert np.array_equal(local[x], np.arange(j * len(x), (j + 1) * len(x)))
    cont = contiguous_layout(batch, inter, intra)
    L = padded // inter
    for i in range(inter):
        assert np.array_equal(np.concatenate([cont.local_token_indices(i * intra + j) for j in range(intra)]),
                              np.arange(i * L, (i + 1) * L))


@settings(max_examples=20, deadline=None)
@given(cases)
def test_segment_pieces_split_exactly_at_document_boundaries(case) -> None:
    lengths, inter, intra = case
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    batch = Batch.build(cu, inter * intra)
    bounds = sorted(set(cu) | {batch.padded_tokens})
    doc_of = np.searchsorted(np.asarray(bounds), np.arange(batch.padded_tokens), side="right") - 1
    for segs in balanced_layout(batch, inter, intra).segments:
        pieces = segment_pieces(batch, segs)
        assert sum(len(r) for _, r, _ in pieces) == sum(len(s.tokens) for s in segs)
        for doc, rng, local in pieces:
            assert set(doc_of[rng.start : rng.stop].tolist()) == {doc}  # one document each
            seg = next(s for s in segs if s.tokens.start <= rng.start and rng.stop <= s.tokens.stop)
            assert local == seg.local_start + rng.start - seg.tokens.start


def test_doc_work_is_the_brute_force_pair_count() -> None:
    batch = Batch.build([0, 3, 3, 10, 11], 4)  # an empty document and one of length 1, padded to 12
    assert batch.num_docs == 4  # [0,3) [3,10) [10,11) and the padding [11,12)
    want = [sum(1 for q in range(n) for k in range(q + 1)) for n in (3, 7, 1, 1)]
    assert batch.doc_work().tolist() == want
    w = 2
    assert batch.doc_work(w).tolist() == [sum(1 for q in range(n) for k in range(q + 1) if q - k <= w) for n in (3, 7, 1, 1)]


@pytest.mark.parametrize("bad", [[], [0], [1, 4], [0, 4, 3], [0, -1], [0, 0], [0, 2.5], [[0, 1]]])
def test_bad_cu_seqlens_raise_batch_error(bad) -> None:
    with pytest.raises(BatchError):
        normalize_cu_seqlens(bad)


def test_validate_layout_rejects_a_token_held_twice() -> None:
    segs = ((Segment(TokenRange(0, 4), 0),), (Segment(TokenRange(2, 6), 0),))
    with pytest.raises(ConfigError, match="exactly once"):
        validate_layout(Layout("bad", segs, 4, 1), 8)
    with pytest.raises(ConfigError, match="cp_rank"):
        contiguous_layout(Batch.build([0, 8], 2), 2, 1).local_token_indices(2)


def test_validate_layout_tiling_check_equals_a_token_count() -> None:
    """``validate_layout``'s sorted-tiling test of "every token exactly once" accepts and rejects
    exactly the layouts a per-token count (``seen[s:e] += 1``, all ones) does: random segments
    with gaps, overlaps, repeats, empty and past-the-end segments."""
    rng = np.random.default_rng(7)
    verdicts = {True: 0, False: 0}
    for _ in range(400):
        padded = int(rng.integers(1, 24))
        cuts = sorted({0, padded, *rng.integers(0, padded + 1, int(rng.integers(0, 5))).tolist()})
        spans = [(a, b) for a, b in zip(cuts, cuts[1:])]
        for _ in range(int(rng.integers(0, 3))):  # break it: drop, repeat, move, widen past the end
            kind = int(rng.integers(0, 4))
            if kind == 0 and spans:
                spans.pop(int(rng.integers(0, len(spans))))
            elif kind == 1 and spans:
                spans.append(spans[int(rng.integers(0, len(spans)))])
            elif kind == 2:
                a = int(rng.integers(0, padded + 1))
                spans.append((a, a + int(rng.integers(0, 3))))
            else:
                spans.append((padded, padded + int(rng.integers(1, 3))))
        rows = sum(b - a for a, b in spans)
        segs, row = [], 0
        for a, b in spans:  # all on one rank, dense local rows
            segs.append(Segment(TokenRange(a, b), row))
            row += b - a
        seen = np.zeros(padded, dtype=np.int64)
        for a, b in spans:
            seen[a:b] += 1
        expected = bool((seen == 1).all())
        try:
            validate_layout(Layout("t", (tuple(segs),), rows, 1), padded)
            got = True
        except ConfigError:
            got = False
        assert got == expected, (padded, spans)
        verdicts[got] += 1
    assert min(verdicts.values()) > 50


def test_segment_pieces_equals_a_per_token_document_lookup() -> None:
    """``segment_pieces`` (bisect on the document starts, a segment inside one document kept
    whole) cuts each segment exactly where a per-token ``doc_of`` changes, empty segments
    holding nothing; with and without the caller's ``starts`` list."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(1, 40))
        cu = sorted({0, n, *rng.integers(0, n + 1, int(rng.integers(0, 6))).tolist()})
        batch = Batch.build(cu, 1)
        cuts = sorted({0, n, *rng.integers(0, n + 1, int(rng.integers(0, 6))).tolist()})
        segs, row = [], 0
        for a, b in [*zip(cuts, cuts[1:]), (n // 2, n // 2)]:
            segs.append(Segment(TokenRange(a, b), row))
            row += b - a
        ref = []
        for s in segs:
            for t in range(s.tokens.start, s.tokens.stop):
                d, local = batch.doc_of(t), s.local_start + t - s.tokens.start
                if ref and ref[-1][0] == d and ref[-1][1].stop == t and ref[-1][3] is s:
                    ref[-1] = (d, TokenRange(ref[-1][1].start, t + 1), ref[-1][2], s)
                else:
                    ref.append((d, TokenRange(t, t + 1), local, s))
        ref = [r[:3] for r in ref]
        assert segment_pieces(batch, segs) == ref
        assert segment_pieces(batch, segs, batch.doc_starts.tolist()) == ref

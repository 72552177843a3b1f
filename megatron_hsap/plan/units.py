"""Work units (docs/design.md §2.1 step 1): document pieces per rank and the non-empty blocks between them.

A *piece* is the part of one document held by one rank in one segment. For two pieces ``p`` (q
side) and ``k`` (kv side) of the same document, the block is causal when ``p is k`` (the diagonal,
pattern A1), a dense rectangle when ``k`` lies before ``p`` (A2–A5), and empty otherwise — empty
blocks are never materialised, so they cost nothing. Under a sliding window (``plan/window.py``)
blocks are clipped to the band and those wholly outside it are empty too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_hsap.plan.ir import TokenRange, pickle_by_fields, positional_builder
from megatron_hsap.plan.layout import Batch, Layout, segment_pieces
from megatron_hsap.plan.window import NO_WINDOW, banded_pairs, clip_block, staircase_pairs

__all__ = ["Piece", "WorkUnit", "build_units", "causal_work", "pattern_of", "clip_unit"]


def causal_work(q: TokenRange, kv: TokenRange, causal: bool, window: int = NO_WINDOW) -> int:
    """Unmasked pairs of a block (see ``ComputeItem.work``; ``causal`` is implied by the ranges)."""
    return banded_pairs(q.start, q.stop, kv.start, kv.stop, window)


def clip_unit(u, window: int):
    """``u`` (a ``WorkUnit`` or ``ir.Unit``) cut to its banded pairs, or None when none is left
    (``plan/window.py``'s ``clip_block``); unchanged without a window."""
    if window < 0:
        return u
    got = clip_block(u.q.start, u.q.stop, u.kv.start, u.kv.stop, u.causal, window)
    if got is None:
        return None
    qs, qe, ks, ke = got
    if (qs, qe, ks, ke) == (u.q.start, u.q.stop, u.kv.start, u.kv.stop):
        return u
    return replace(u, q=TokenRange(qs, qe), kv=TokenRange(ks, ke))


@dataclass(frozen=True, slots=True)
class Piece:
    doc: int
    tokens: TokenRange
    owner: int
    local_start: int


@dataclass(frozen=True, slots=True)
class WorkUnit:
    """An unplaced block: q rows of ``q_owner`` × kv rows of ``kv_owner``, one document."""

    doc: int
    q: TokenRange
    kv: TokenRange
    causal: bool
    q_owner: int
    kv_owner: int
    pattern: str
    window: int = NO_WINDOW
    # ``work`` once computed (-1: not yet): every placement start and rebalance reads it per block;
    # not part of the unit's identity (equality, hash, repr)
    _work: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def work(self) -> int:
        w = self._work
        if w < 0:
            w = causal_work(self.q, self.kv, self.causal, self.window)
            object.__setattr__(self, "_work", w)  # a cache of a pure function of frozen fields
        return w


pickle_by_fields(Piece)
pickle_by_fields(WorkUnit)


_new_work_unit = positional_builder(WorkUnit)  # every field, ``_work`` last: ~2x the keyword ``__init__``


_CROSS_PATTERNS = {(True, True): "A2", (True, False): "A3", (False, True): "A4", (False, False): "A5"}


def pattern_of(q: TokenRange, kv: TokenRange, causal: bool, chunk: int) -> str:
    """The paper's A1–A5 names (Figure 3): A1 diagonal; cross blocks by whether the q rows / kv
    columns fill their whole chunk: A2 both, A3 rows whole (cross-up), A4 columns whole
    (cross-right), A5 neither (cross-corner)."""
    if causal:
        return "A1"
    return _CROSS_PATTERNS[(len(q) == chunk, len(kv) == chunk)]


_new_piece = positional_builder(Piece)


def build_units(batch: Batch, layout: Layout, window: int = NO_WINDOW) -> tuple[list[Piece], list[WorkUnit]]:
    """All pieces and all non-empty blocks, in (doc, q start, kv start) order; under a window
    each block is clipped to the band (``clip_unit``) and blocks beyond it are left out.

    (Hot at 10^4–10^5 blocks per compile: document starts as a Python list for ``bisect``,
    ``positional_builder`` constructions, each piece's range, owner and whole-chunk flag read once
    — ``pattern_of``'s rule, the same objects; tests/plan/test_compile_speed_equal.py checks them
    against the plain construction.)"""
    starts = batch.doc_starts.tolist()
    pieces: list[Piece] = []
    for rank, segs in enumerate(layout.segments):
        for doc, rng, local in segment_pieces(batch, segs, starts):
            pieces.append(_new_piece(doc, rng, rank, local))
    pieces.sort(key=lambda p: p.tokens.start)
    units: list[WorkUnit] = []
    by_doc: dict[int, list[tuple[TokenRange, int, bool]]] = {}
    chunk = layout.chunk_tokens
    for p in pieces:
        t = p.tokens
        n = t.stop - t.start
        by_doc.setdefault(p.doc, []).append((t, p.owner, n == chunk, n))
    new, patterns, append = _new_work_unit, _CROSS_PATTERNS, units.append
    for doc in sorted(by_doc):
        plist = by_doc[doc]
        for qi, (qt, qo, qwhole, qn) in enumerate(plist):
            if window < 0:
                # ``WorkUnit(doc, q, kv, causal, q_owner, kv_owner, pattern, window)`` with its work
                # (``causal_work``'s closed forms: every earlier piece's keys lie before the rows,
                # a rectangle; the diagonal is a triangle, staircase_pairs(n))
                for kt, ko, kwhole, kn in plist[:qi]:
                    append(new(doc, qt, kt, False, qo, ko, patterns[(qwhole, kwhole)], window, qn * kn))
                append(new(doc, qt, qt, True, qo, qo, "A1", window, staircase_pairs(qn)))
                continue
            for ki in range(qi + 1):
                kt, ko, kwhole, _ = plist[ki]
                if qt.start - window >= kt.stop:
                    continue  # every key older than every row's window: an empty block
                causal = ki == qi
                unit = clip_unit(new(doc, qt, kt, causal, qo, ko, "A1" if causal else patterns[(qwhole, kwhole)],
                                     window, -1), window)
                if unit is not None:
                    append(unit)
    return pieces, units

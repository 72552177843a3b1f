"""Work units (docs/design.md §2.1 step 1): document pieces per rank and the non-empty blocks between them.

A *piece* is the part of one document held by one rank in one segment. For two pieces ``p`` (q
side) and ``k`` (kv side) of the same document, the block is causal when ``p is k`` (the diagonal,
pattern A1), a dense rectangle when ``k`` lies before ``p`` (A2–A5), and empty otherwise — empty
blocks are never materialised, so they cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hsap.plan.ir import TokenRange
from megatron_hsap.plan.layout import Batch, Layout, segment_pieces

__all__ = ["Piece", "WorkUnit", "build_units", "causal_work", "pattern_of"]


def causal_work(q: TokenRange, kv: TokenRange, causal: bool) -> int:
    """Unmasked pairs of a block (see ``ComputeItem.work``)."""
    nq, nk = len(q), len(kv)
    if not causal:
        return nq * nk
    first = q.start - kv.start + 1
    return nq * first + nq * (nq - 1) // 2


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

    @property
    def work(self) -> int:
        return causal_work(self.q, self.kv, self.causal)


def pattern_of(q: TokenRange, kv: TokenRange, causal: bool, chunk: int) -> str:
    """The paper's A1–A5 names (Figure 3): A1 diagonal; cross blocks by whether the q rows / kv
    columns fill their whole chunk: A2 both, A3 rows whole (cross-up), A4 columns whole
    (cross-right), A5 neither (cross-corner)."""
    if causal:
        return "A1"
    rows_whole = len(q) == chunk
    cols_whole = len(kv) == chunk
    return {(True, True): "A2", (True, False): "A3", (False, True): "A4", (False, False): "A5"}[(rows_whole, cols_whole)]


def build_units(batch: Batch, layout: Layout) -> tuple[list[Piece], list[WorkUnit]]:
    """All pieces and all non-empty blocks, in (doc, q start, kv start) order."""
    pieces: list[Piece] = []
    for rank, segs in enumerate(layout.segments):
        for doc, rng, local in segment_pieces(batch, segs):
            pieces.append(Piece(doc, rng, rank, local))
    pieces.sort(key=lambda p: p.tokens.start)
    units: list[WorkUnit] = []
    by_doc: dict[int, list[Piece]] = {}
    for p in pieces:
        by_doc.setdefault(p.doc, []).append(p)
    chunk = layout.chunk_tokens
    for doc in sorted(by_doc):
        plist = by_doc[doc]
        for qi, qp in enumerate(plist):
            for kp in plist[: qi + 1]:
                causal = kp is qp
                units.append(
                    WorkUnit(
                        doc=doc,
                        q=qp.tokens,
                        kv=kp.tokens,
                        causal=causal,
                        q_owner=qp.owner,
                        kv_owner=kp.owner,
                        pattern=pattern_of(qp.tokens, kp.tokens, causal, chunk),
                    )
                )
    return pieces, units

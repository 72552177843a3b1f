"""The document-aware ``balanced`` layout (beyond the paper): balance exact work before any byte moves.

Every non-attention layer is token-wise, so a micro-batch's tokens may sit on CP ranks in any
order as long as labels, loss mask and positions travel with them (Transformer Engine's zigzag is
one such permutation). This layout chooses the permutation per batch:

1. every inter rank holds exactly ``L = T'/P_inter`` tokens (equal activation memory);
2. documents too long for one rank's share of work (or tokens) are split zigzag-style over ``k``
   ranks: cut into ``2k`` near-equal pieces, rank ``j`` of the ``k`` takes pieces ``j`` and
   ``2k−1−j`` (a head–tail pair) — equal consecutive pieces of one causal document carry unequal
   work, head–tail pairs carry equal work;
3. the remaining documents go whole to the rank with the least work that has room (largest work
   first, LPT);
4. documents that fit nowhere whole are cut to fill the ranks' remaining room exactly, least
   loaded rank first.

Work is counted as the owner-computes work of each piece (the q rows × every earlier key of its
document), which is what the SAP plan starts from; the plan still moves work where the layout alone
cannot balance. Deterministic: ties break by rank index and document order.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from megatron_hsap.plan.ir import Segment, TokenRange
from megatron_hsap.plan.layout import Batch, Layout

__all__ = ["balanced_layout", "piece_work"]


def piece_work(doc_start: int, a: int, b: int) -> int:
    """Owner-computes pairs of rows ``[a, b)`` of a document starting at ``doc_start``."""
    n = b - a
    return n * (a - doc_start + 1) + n * (n - 1) // 2


def _zigzag(start: int, n: int, k: int) -> list[list[tuple[int, int]]]:
    """Head–tail split of ``[start, start+n)`` over k ranks: rank j gets n//k (+1 for the first
    n%k ranks) tokens as head piece j (from the front) and tail piece j (from the back)."""
    shares = [n // k + (1 if j < n % k else 0) for j in range(k)]
    heads = [sh // 2 for sh in shares]
    out, front, back = [], start, start + n
    for sh, h in zip(shares, heads):
        t = sh - h
        out.append([p for p in ((front, front + h), (back - t, back)) if p[1] > p[0]])
        front += h
        back -= t
    return out


def balanced_layout(batch: Batch, inter_size: int, intra_size: int) -> Layout:
    """Document-aware layout of ``batch`` over ``inter_size`` ranks (see the module docstring)."""
    size = inter_size
    chunk = batch.padded_tokens // size
    starts = batch.doc_starts.tolist()
    docs = [(starts[d], starts[d + 1] - starts[d]) for d in range(len(starts) - 1)]
    work = [n * (n + 1) // 2 for _, n in docs]
    tau = sum(work) / size
    room = [chunk] * size
    load = [0] * size
    held: list[list[tuple[int, int]]] = [[] for _ in range(size)]

    def give(r: int, a: int, b: int, doc_start: int) -> None:
        held[r].append((a, b))
        room[r] -= b - a
        load[r] += piece_work(doc_start, a, b)

    order = sorted(range(len(docs)), key=lambda d: (-work[d], d))
    leftovers: list[int] = []
    heap = [(0, r) for r in range(size)]  # (work, rank) of ranks that may take whole documents
    for d in order:
        s, n = docs[d]
        k = max(math.ceil(work[d] / tau) if tau else 1, math.ceil(n / chunk))
        if k >= 2 and size >= 2:
            k = min(k, size)
            ranks = sorted(range(size), key=lambda r: (load[r], r))
            # the k least-loaded ranks that can hold their share; widen k if rooms are short
            fit = [r for r in ranks if room[r] >= -(-n // k)]
            while len(fit) < k and k < size:
                k += 1
                fit = [r for r in ranks if room[r] >= -(-n // k)]
            if len(fit) >= k:
                for r, parts in zip(sorted(fit[:k]), _zigzag(s, n, k)):
                    for a, b in parts:
                        give(r, a, b, s)
                heap = [(load[r], r) for r in range(size)]
                heapq.heapify(heap)
                continue
            leftovers.append(d)
            continue
        # whole document to the least-loaded rank with room (LPT)
        skipped = []
        placed = False
        while heap:
            w, r = heapq.heappop(heap)
            if w != load[r]:
                continue  # stale entry
            if room[r] >= n:
                give(r, s, s + n, s)
                heapq.heappush(heap, (load[r], r))
                placed = True
                break
            skipped.append((w, r))
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            leftovers.append(d)
    # Cut what is left into the remaining rooms, least-loaded ranks first (exact token counts).
    for d in sorted(leftovers, key=lambda d: docs[d][0]):
        s, n = docs[d]
        a = s
        for r in sorted((r for r in range(size) if room[r] > 0), key=lambda r: (load[r], r)):
            if a >= s + n:
                break
            b = min(s + n, a + room[r])
            give(r, a, b, s)
            a = b
        assert a == s + n, "token rooms must absorb every leftover document"
    segments = []
    for r in range(size):
        merged: list[list[int]] = []
        for a, b in sorted(held[r]):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        segs, row = [], 0
        for a, b in merged:
            segs.append(Segment(TokenRange(a, b), row))
            row += b - a
        segments.append(tuple(segs))
    return Layout(name="balanced", segments=tuple(segments), chunk_tokens=chunk, intra_size=intra_size)

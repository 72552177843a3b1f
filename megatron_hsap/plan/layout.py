"""Batch validation and token layouts (docs/design.md §1).

``Batch`` is the normalised, validated description of one packed micro-batch; ``Layout`` says
which global tokens each inter rank holds (as ordered ``Segment``s) and how an inter chunk is
sliced across the ``P_intra`` ranks of its node.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from numbers import Integral
from typing import Sequence

import numpy as np

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.plan.ir import Segment, TokenRange
from megatron_hsap.plan.window import staircase_pairs

__all__ = ["Batch", "Layout", "normalize_cu_seqlens", "contiguous_layout"]


MAX_TOKENS = (1 << 31) - 1  # kernels take int32 cu_seqlens


def normalize_cu_seqlens(cu_seqlens: object) -> tuple[int, ...]:
    """Validate global ``cu_seqlens`` ``[0, l0, l0+l1, ..., T]`` and return it as a tuple of ints.

    Accepts a list/tuple, a numpy array or anything with ``.tolist()`` (a CPU torch tensor).
    Repeated entries (empty documents) are legal; decreasing entries, a first entry other than 0,
    non-integers, negatives, fewer than two entries and ``T == 0`` are not.
    """
    if isinstance(cu_seqlens, np.ndarray) and cu_seqlens.ndim == 1 and cu_seqlens.dtype.kind in "iu":
        values = cu_seqlens.tolist()  # fast path: every entry is an int already
    elif isinstance(cu_seqlens, (list, tuple)) and set(map(type, cu_seqlens)) == {int}:
        values = list(cu_seqlens)
    else:
        values = _to_int_list(cu_seqlens)
    if len(values) < 2:
        raise BatchError(f"cu_seqlens needs at least two entries [0, T], got {values!r}")
    if values[0] != 0:
        raise BatchError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {values[0]}")
    if min(values) < 0:
        pos = values.index(min(values))
        raise BatchError(f"cu_seqlens[{pos}] = {values[pos]} is negative; cumulative lengths are >= 0")
    for pos in range(1, len(values)):
        if values[pos] < values[pos - 1]:
            raise BatchError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{pos - 1}] = {values[pos - 1]} > cu_seqlens[{pos}] = {values[pos]}"
            )
    if values[-1] == 0:
        raise BatchError("cu_seqlens describes an empty batch (T = 0); a micro-batch needs at least one token")
    if values[-1] > MAX_TOKENS:
        raise BatchError(
            f"cu_seqlens[-1] = T = {values[-1]} tokens exceeds {MAX_TOKENS} (2^31 - 1): attention kernels index "
            "tokens with int32; split the micro-batch"
        )
    return tuple(values)


def _to_int_list(cu_seqlens: object) -> list[int]:
    """The slow path of ``normalize_cu_seqlens``: any sequence or tensor, each entry checked."""
    if hasattr(cu_seqlens, "tolist") and not isinstance(cu_seqlens, (list, tuple)):
        dtype = getattr(cu_seqlens, "dtype", None)
        if dtype is not None and ("float" in str(dtype) or "complex" in str(dtype)):
            raise BatchError(f"cu_seqlens must hold integers, got dtype {dtype}; pass an int32/int64 array")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        values = list(cu_seqlens)
    else:
        raise BatchError(f"cu_seqlens must be a sequence of integers, got {type(cu_seqlens).__name__}")
    if not isinstance(values, list) or any(isinstance(v, (list, tuple)) for v in values):
        raise BatchError("cu_seqlens must be one-dimensional: [0, l0, l0+l1, ..., T]")
    for pos, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise BatchError(f"cu_seqlens[{pos}] = {v!r} is not an integer")
    return [int(v) for v in values]


@dataclass(frozen=True, slots=True)
class Batch:
    """A validated packed micro-batch, padded at the end to ``padded_tokens``.

    ``doc_starts`` holds the starts of the non-empty documents plus, if ``padded_tokens >
    num_tokens``, the padding document ``[num_tokens, padded_tokens)``; ``doc_starts[-1]`` is
    ``padded_tokens``. Padding tokens attend causally among themselves only, so every row has a
    finite LSE; they carry no loss.
    """

    cu_seqlens: tuple[int, ...]
    num_tokens: int
    padded_tokens: int
    doc_starts: np.ndarray  # int64 [n_docs + 1]

    @classmethod
    def build(cls, cu_seqlens: object, multiple: int) -> "Batch":
        cu = normalize_cu_seqlens(cu_seqlens)
        total = cu[-1]
        padded = padded_length(total, multiple)
        starts = np.unique(np.asarray(cu, dtype=np.int64))  # drops empty documents
        if padded > total:
            starts = np.append(starts, padded)
        return cls(cu_seqlens=cu, num_tokens=total, padded_tokens=padded, doc_starts=starts)

    @property
    def num_docs(self) -> int:
        return len(self.doc_starts) - 1

    def doc_of(self, token: int) -> int:
        return int(np.searchsorted(self.doc_starts, token, side="right") - 1)

    def doc_range(self, doc: int) -> TokenRange:
        return TokenRange(int(self.doc_starts[doc]), int(self.doc_starts[doc + 1]))

    def doc_work(self, window: int = -1) -> np.ndarray:
        """Unmasked (q, k) pairs per document (int64): n(n+1)/2, or under a sliding ``window`` the
        banded count — ``plan/window.py``'s ``doc_pairs``, vectorised (row i sees min(i+1, window+1)
        keys)."""
        n = np.diff(self.doc_starts).astype(np.int64)
        if window < 0:
            return staircase_pairs(n)
        m = np.minimum(n, window + 1)
        return staircase_pairs(m) + (n - m) * (window + 1)

    def total_work(self, window: int = -1) -> int:
        """Unmasked (q, k) pairs of the whole padded batch (``doc_work`` summed)."""
        return int(self.doc_work(window).sum())


def padded_length(total: int, multiple: int) -> int:
    """``total`` tokens padded at the end to the next multiple of ``multiple`` (``Batch.padded_tokens``)."""
    return -(-total // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Layout:
    """Which tokens each inter rank holds: ``segments[i]`` in local order. Every inter rank holds
    the same number of tokens ``chunk_tokens``; its node's ``intra_size`` ranks hold consecutive
    equal slices of that local order."""

    name: str
    segments: tuple[tuple[Segment, ...], ...]
    chunk_tokens: int
    intra_size: int

    @property
    def inter_size(self) -> int:
        return len(self.segments)

    def local_token_indices(self, cp_rank: int) -> np.ndarray:
        """Global token ids held by CP rank ``cp_rank = i·P_intra + j``, in its local order."""
        if not 0 <= cp_rank < self.inter_size * self.intra_size:
            raise ConfigError(
                f"cp_rank={cp_rank} out of range for a CP group of {self.inter_size * self.intra_size} ranks"
            )
        i, j = divmod(cp_rank, self.intra_size)
        ids = np.concatenate([np.arange(s.tokens.start, s.tokens.stop, dtype=np.int64) for s in self.segments[i]])
        part = self.chunk_tokens // self.intra_size
        return ids[j * part : (j + 1) * part]

    def run_heads(self, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Where CP rank ``cp_rank``'s segments begin inside its slice: ``(global ids, local
        positions)``, int64, in local order — every start of a run of consecutive ids among them
        (a segment continuing its predecessor's ids is listed too), without listing the tokens."""
        i, j = divmod(cp_rank, self.intra_size)
        part = self.chunk_tokens // self.intra_size
        lo, hi = j * part, (j + 1) * part
        heads, where = [], []
        for s in self.segments[i]:
            first, end = max(lo, s.local_start), min(hi, s.local_start + len(s.tokens))
            if first < end:
                heads.append(s.tokens.start + first - s.local_start)
                where.append(first - lo)
        return np.asarray(heads, dtype=np.int64), np.asarray(where, dtype=np.int64)

    def segment_starts(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """(global token start, local row start) of each segment of each inter rank (``CostRates.segments``)."""
        return tuple(tuple((s.tokens.start, s.local_start) for s in segs) for segs in self.segments)

    def owner_array(self, padded_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(owner inter rank, local row) of every global token: two int64 arrays of length T'."""
        owner = np.empty(padded_tokens, dtype=np.int64)
        local = np.empty(padded_tokens, dtype=np.int64)
        for rank, segs in enumerate(self.segments):
            for s in segs:
                owner[s.tokens.start : s.tokens.stop] = rank
                local[s.tokens.start : s.tokens.stop] = np.arange(s.local_start, s.local_start + len(s.tokens))
        return owner, local


def contiguous_layout(batch: Batch, inter_size: int, intra_size: int) -> Layout:
    """The paper's layout: inter rank i holds ``[i·L, (i+1)·L)``, ``L = T'/P_inter``."""
    chunk = batch.padded_tokens // inter_size
    segs = tuple((Segment(TokenRange(i * chunk, (i + 1) * chunk), 0),) for i in range(inter_size))
    return Layout(name="contiguous", segments=segs, chunk_tokens=chunk, intra_size=intra_size)


def validate_layout(layout: Layout, padded_tokens: int) -> None:
    """Every token held exactly once, local rows dense, equal chunk sizes.

    "Exactly once" without a per-token count: the non-empty segments (cut at ``padded_tokens``,
    where a count array's slices end) sorted by start must tile ``[0, padded_tokens)`` — each
    starts where the previous one stops (a gap, an overlap or a token held twice breaks that)."""
    spans: list[tuple[int, int]] = []
    for rank, segs in enumerate(layout.segments):
        row = 0
        for s in segs:
            if s.local_start != row:
                raise ConfigError(f"layout {layout.name}: rank {rank} segment {s} is not at local row {row}")
            a, b = min(s.tokens.start, padded_tokens), min(s.tokens.stop, padded_tokens)
            if b > a:
                spans.append((a, b))
            row += s.tokens.stop - s.tokens.start
        if row != layout.chunk_tokens:
            raise ConfigError(f"layout {layout.name}: rank {rank} holds {row} tokens, expected {layout.chunk_tokens}")
    covered = 0
    for a, b in sorted(spans):
        if a != covered:
            covered = -1  # a gap or an overlap
            break
        covered = b
    if covered != padded_tokens:
        raise ConfigError(f"layout {layout.name}: tokens not held exactly once")


def segment_pieces(batch: Batch, segments: Sequence[Segment], starts: list[int] | None = None) -> list[tuple[int, TokenRange, int]]:
    """Split a rank's segments at document boundaries: (doc, global range, local start) each.
    ``starts``: ``batch.doc_starts.tolist()`` when the caller has it (a caller over every rank
    converts once; ``bisect`` on the list finds what ``np.searchsorted(side="right")`` does)."""
    out: list[tuple[int, TokenRange, int]] = []
    if starts is None:
        starts = batch.doc_starts.tolist()
    for s in segments:
        a, b = s.tokens.start, s.tokens.stop
        if a >= b:
            continue  # an empty segment holds no piece
        d = bisect.bisect_right(starts, a) - 1
        if starts[d + 1] >= b:  # the segment lies in one document: its own (equal) range
            out.append((d, s.tokens, s.local_start))
            continue
        while a < b:
            end = min(b, starts[d + 1])
            out.append((d, TokenRange(a, end), s.local_start + (a - s.tokens.start)))
            a = end
            d += 1
    return out

"""Sliding-window attention as part of the mask (docs/design.md §2.1 step 1, issue 15 item 1).

Convention (flash-attn's ``window_size=(left, right)``): token ``i`` attends to the keys ``j`` of its
own document with ``i - left <= j <= i + right``; ``None`` or ``(-1, -1)`` is no window. HSAP plans
are causal, so ``right`` is 0 (``-1`` is accepted as the same thing under the causal mask) and a
plan's window is the single integer ``left`` (``-1``: unbounded).

Everything the planner, verifier and kernels need from the window is here, on plain integers (no
imports from the rest of the package, so ``ir.py`` can use it):

* :func:`banded_pairs` — THE definition of a block's work (unmasked (q, k) pairs): causal pairs
  ``j <= i`` minus those further than ``left`` back. Units, placement, balance, the layout, the
  estimate and the verifier all count work through it (``units.causal_work`` is its
  ``TokenRange`` spelling, ``ir.Unit.work`` / ``ir.ComputeItem.work`` call it).
* :func:`staircase_pairs` — THE closed form of the causal count: ``n`` consecutive rows whose first
  row sees ``first`` keys, each later row one more. ``banded_pairs``' fast path, the hot loops that
  count rows without building ranges (``balanced.piece_work``, ``Placement.rows_work``,
  ``rows_for_work``, ``Batch.doc_work``) and the simulator's and baselines' vectorised counts
  (``sim/builder.causal_pairs``, ``baselines/flat._causal_pairs``) all use it; it works on ints and
  elementwise on numpy arrays (asserted by ``tests/test_one_home.py``).
* :func:`clip_block` — the smallest block with the same banded pairs: keys older than every row's
  window and rows that see no key of the block are dropped, so no byte moves for them.
* :func:`kernel_window` — a kernel call's ``(left, right)`` relative to its own block (flash-attn
  aligns a block bottom-right), or ``(-1, -1)`` when the block lies wholly inside the window and
  runs as a plain causal / full call.
"""

from __future__ import annotations

from numbers import Integral

from megatron_hsap.errors import ConfigError

__all__ = ["NO_WINDOW", "normalize_window", "window_left", "banded_pairs", "staircase_pairs", "clip_block", "is_banded",
           "kernel_window", "doc_pairs"]

NO_WINDOW = -1


def normalize_window(window_size: object) -> tuple[int, int] | None:
    """``window_size`` as ``None`` (no window) or ``(left, 0)``; raises ``ConfigError`` saying what
    to pass otherwise. ``(-1, -1)`` / ``(-1, 0)`` mean no window (flash-attn)."""
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(x, Integral) and not isinstance(x, bool) for x in window_size):
        raise ConfigError(f"window_size={window_size!r} must be None or a pair of ints (left, right) in flash-attn's "
                          "convention, e.g. (4096, 0) for a causal sliding window of 4096 earlier keys")
    left, right = int(window_size[0]), int(window_size[1])
    if right not in (0, -1):
        raise ConfigError(f"window_size={window_size!r}: right={right} would attend to later keys, but HSAP plans are "
                          "causal; use right=0 (causal models) or -1")
    if left < -1:
        raise ConfigError(f"window_size={window_size!r}: left={left} is negative; use left >= 0 keys or -1 (no window)")
    return None if left == -1 else (left, 0)


def window_left(window_size: tuple[int, int] | None) -> int:
    """The plan's window as one integer (``-1``: none)."""
    return NO_WINDOW if window_size is None else window_size[0]


def staircase_pairs(n, first=1):
    """Causal pairs of ``n`` consecutive rows whose first row sees ``first`` keys and each later
    row one more: ``n·first + n(n−1)/2`` (exact: ``n(n−1)`` is even). Ints give ints; numpy
    arrays (int or float) broadcast elementwise in their dtype. ``first = 1``: a whole causal
    document of ``n`` tokens, ``n(n+1)/2``."""
    return n * first + n * (n - 1) // 2


def _upto(n: int, cap: int) -> int:
    """``sum(clamp(x, 0, cap) for x in range(1, n + 1))`` (module level, not a closure made per
    call: a windowed compile makes ~10^6 of these calls)."""
    if n <= 0:
        return 0
    if n <= cap:
        return staircase_pairs(n)
    return staircase_pairs(cap) + (n - cap) * cap


def _clamped_sum(lo: int, hi: int, cap: int) -> int:
    """``sum(clamp(x, 0, cap) for x in range(lo, hi + 1))`` in O(1)."""
    return _upto(hi, cap) - _upto(lo - 1, cap) if hi >= lo else 0


def _pairs_below(qs: int, qe: int, ks: int, ke: int, c: int) -> int:
    """Pairs (i, j) of the block with ``j <= i - c``."""
    # row i holds clamp(i - c - ks + 1, 0, nk) such keys
    return _clamped_sum(qs - c - ks + 1, qe - c - ks, ke - ks)


def banded_pairs(qs: int, qe: int, ks: int, ke: int, left: int = NO_WINDOW) -> int:
    """Unmasked pairs of the block rows ``[qs, qe)`` × keys ``[ks, ke)`` of one document under the
    causal mask ``j <= i`` and the window ``j >= i - left`` (``left = -1``: none)."""
    if qe <= qs or ke <= ks:
        return 0
    if left < 0:  # no window: the two shapes blocks take, in closed form (the planner's hottest call)
        if ke <= qs:  # every key before every row: a dense rectangle
            return (qe - qs) * (ke - ks)
        if ke == qe and ks <= qs:  # bottom-right aligned diagonal: a rectangle of keys before the rows + a triangle
            return staircase_pairs(qe - qs, qs - ks + 1)
        return _pairs_below(qs, qe, ks, ke, 0)
    causal = _pairs_below(qs, qe, ks, ke, 0)
    return causal - _pairs_below(qs, qe, ks, ke, left + 1)


def doc_pairs(n: int, left: int = NO_WINDOW) -> int:
    """Unmasked pairs of one whole document of ``n`` tokens."""
    return banded_pairs(0, n, 0, n, left)


def clip_block(qs: int, qe: int, ks: int, ke: int, causal: bool, left: int) -> tuple[int, int, int, int] | None:
    """The block cut to its banded pairs: keys older than the first row's window and (rectangles)
    rows past the last key's window removed; ``None`` when no pair is left. A causal block keeps
    ``ke == qe``; every row and every key of the result takes part in at least one pair."""
    if left < 0:
        return (qs, qe, ks, ke)
    ks = max(ks, qs - left)
    if not causal:
        qe = min(qe, ke + left)  # row i sees key ke-1 iff i - left <= ke - 1
    if qe <= qs or ke <= ks:
        return None
    return (qs, qe, ks, ke)


def is_banded(qs: int, qe: int, ks: int, ke: int, left: int) -> bool:
    """Whether the window masks some causal pair of the block (the last row's oldest key lies
    outside it): such a block needs the banded kernel call."""
    return left >= 0 and (qe - 1) - ks > left


def kernel_window(qs: int, qe: int, ks: int, ke: int, causal: bool, left: int) -> tuple[int, int]:
    """flash-attn ``window_size`` for one call over this block: kernels align the q rows to the end
    of the keys (query ``a`` sits at key position ``a + nk - nq``), so the global window ``[i - left,
    i]`` becomes ``(left - (qe - ke), qe - ke)`` relative to the call. ``(-1, -1)`` when the block
    lies wholly inside the window (a plain causal / full call). Needs a clipped block (then the
    relative left is >= 0)."""
    if not is_banded(qs, qe, ks, ke, left):
        return (-1, -1)
    shift = qe - ke  # 0 for a causal block; >= its row count for a rectangle
    rel_left = left - shift
    if rel_left < 0:
        raise ValueError(f"block q[{qs}:{qe}) kv[{ks}:{ke}) has rows that see no key of window {left}: clip it first")
    return (rel_left, shift if not causal else 0)

"""A phase's time as the longest path over each rank's own program (docs/design.md §4).

Every rank runs ``Post(round k) · Compute(stage k) · Wait(round k) · Merge(round k)`` (``plan/codegen.py``)
on its own clock: nothing makes a rank wait at a stage boundary for ranks it does not exchange
with. So rank ``r`` posts round ``k`` at ``t_r(k)`` (the end of its round ``k − 1``), computes
stage ``k`` until ``t_r(k) + compute_r(k)``, and its wait ends when its own compute is done and
every transfer it takes part in has arrived; then it merges what it received:

    t_r(k + 1) = max(t_r(k) + compute_r(k),  max over peers p of round k [max(t_r(k), t_p(k)) + latency + x_rp(k)]) + after_r(k)

A transfer starts once both ends have posted (NCCL point-to-point is pairwise-synchronous) and
takes ``x_rp = max(x_r, x_p)``: ``x`` is a rank's round transfer time, max(bytes sent, bytes
received) / bandwidth per port class (full-duplex ports; the busier end's ports bound the pair,
whose share of them max-min fairness cannot raise above what the busier end leaves). The phase
ends when the last rank does. This is a closed form — one pass over the rounds, each vectorised
over the round's pairs — not an event simulation: ports are not shared over time, a transfer is
not split at other transfers' ends (``sim/engine.py`` does both, event by event, and is the
independent check: ``sim/estimate_accuracy.py``).

Pairs are ``[m, 3]`` int64 rows ``(round, r, p)``, both directions of every exchanging pair,
sorted; independent problems (a plan's forward and backward) are priced in one pass by stacking
their ranks (``stack``): the per-round numpy calls, not the arithmetic, are the cost.
"""

from __future__ import annotations

import numpy as np

__all__ = ["round_seconds", "pairs_of", "stack", "path_finish", "path_seconds", "path_seconds_py"]


def round_seconds(sent: np.ndarray, recv: np.ndarray, bw: float, nvl_bw: float = 0.0) -> np.ndarray:
    """[P, rounds] transfer seconds of each rank in each round from its bytes ``[P, rounds]``, or
    ``[2, P, rounds]`` (network, NVLink: ports that run in parallel)."""
    if sent.ndim == 3:
        return np.maximum(np.maximum(sent[0], recv[0]) / bw, np.maximum(sent[1], recv[1]) / nvl_bw)
    return np.maximum(sent, recv) / bw


def pairs_of(rounds: np.ndarray, src: np.ndarray, dst: np.ndarray, size: int) -> np.ndarray:
    """The sorted ``(round, r, p)`` rows, both directions, of the transfers ``src → dst`` in ``rounds``
    (repeats and self-pairs dropped)."""
    rounds, src, dst = (np.asarray(x, dtype=np.int64) for x in (rounds, src, dst))
    keep = src != dst
    rounds, src, dst = rounds[keep], src[keep], dst[keep]
    cells = (int(rounds.max()) + 1) * size * size if len(rounds) else 0
    if cells <= 1 << 22:  # a flag per (round, r, p): no sort
        flags = np.zeros(cells, dtype=bool)
        flags[(rounds * size + src) * size + dst] = True
        flags[(rounds * size + dst) * size + src] = True
        key = np.flatnonzero(flags)
    else:
        key = np.unique(np.concatenate([(rounds * size + src) * size + dst, (rounds * size + dst) * size + src]))
    return np.stack([key // (size * size), key // size % size, key % size], axis=1)


def stack(parts: list[tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Independent problems ``(comp, after, xfer, pairs)`` (same round count) as one: ranks of
    part ``i`` are offset by the ranks before it."""
    off = np.cumsum([0] + [c.shape[0] for c, _, _, _ in parts])
    comp = np.concatenate([c for c, _, _, _ in parts])
    xfer = np.concatenate([x for _, _, x, _ in parts])
    after = None if all(a is None for _, a, _, _ in parts) else np.concatenate(
        [np.zeros_like(c) if a is None else a for c, a, _, _ in parts])
    pairs = np.concatenate([p + np.array([0, o, o]) for (_, _, _, p), o in zip(parts, off)])
    # each part is sorted and its ranks lie above the previous part's: a stable sort by round alone
    # keeps (round, r, p) order
    return comp, after, xfer, pairs[np.argsort(pairs[:, 0], kind="stable")]


def path_finish(comp: np.ndarray, after: np.ndarray | None, xfer: np.ndarray, pairs: np.ndarray, latency: float) -> np.ndarray:
    """[P] seconds at which each rank ends the phase (the module docstring's recurrence).

    ``comp`` / ``after`` / ``xfer``: ``[P, rounds]`` seconds of stage ``k``'s compute (kernels
    slowed beside the round, launches, local merges), of the merges of round ``k``'s received
    results (after its wait; None: none) and of round ``k``'s transfers; ``pairs``: ``pairs_of``."""
    size, n = comp.shape
    t = np.zeros(size)
    kk, a, b = pairs[:, 0], pairs[:, 1], pairs[:, 2]
    bounds = np.searchsorted(kk, np.arange(n + 1))
    # per pair: latency + the busier end's transfer time; each rank's peers are one run of rows
    lat_x = np.maximum(xfer[a, kk], xfer[b, kk]) + latency
    new = np.ones(len(kk), dtype=bool)
    new[1:] = (kk[1:] != kk[:-1]) | (a[1:] != a[:-1])
    heads = np.flatnonzero(new)
    hb = np.searchsorted(heads, bounds)
    for k in range(n):
        end = t + comp[:, k]
        lo, hi = bounds[k], bounds[k + 1]
        if hi > lo:
            first = heads[hb[k]: hb[k + 1]]
            who = a[first]
            done = np.maximum.reduceat(np.maximum(t[a[lo:hi]], t[b[lo:hi]]) + lat_x[lo:hi], first - lo)
            end[who] = np.maximum(end[who], done)
        t = end if after is None else end + after[:, k]
    return t


def path_seconds(comp: np.ndarray, after: np.ndarray | None, xfer: np.ndarray, pairs: np.ndarray, latency: float) -> float:
    """Seconds until the last rank ends the phase (``path_finish``)."""
    return float(path_finish(comp, after, xfer, pairs, latency).max(initial=0.0))


def path_seconds_py(comp: list[list[float]], after: list[list[float]] | None, xfer: list[list[float]],
                    pairs: list[list[int]], latency: float) -> float:
    """``path_seconds`` as a loop over ranks and rounds, for problems of a few hundred cells
    (where numpy's per-round calls cost more than the arithmetic): the same operations on the
    same values in the same order (``np.maximum.reduceat`` over a rank's pair rows is a running
    maximum), so the same number. Arguments as lists (``tolist`` of the arrays)."""
    size = len(comp)
    n = len(comp[0]) if size else 0
    t = [0.0] * size
    j, m = 0, len(pairs)
    for k in range(n):
        end = [tr + row[k] for tr, row in zip(t, comp)]
        while j < m and pairs[j][0] < k:  # (rounds are sorted; a round without compute has no rows)
            j += 1
        while j < m and pairs[j][0] == k:
            a = pairs[j][1]
            xa, ta = xfer[a][k], t[a]
            done = None
            while j < m and pairs[j][0] == k and pairs[j][1] == a:
                b = pairs[j][2]
                v = max(ta, t[b]) + (max(xa, xfer[b][k]) + latency)
                if done is None or v > done:
                    done = v
                j += 1
            if done > end[a]:
                end[a] = done
        t = end if after is None else [e + row[k] for e, row in zip(end, after)]
    return max([0.0] + t)

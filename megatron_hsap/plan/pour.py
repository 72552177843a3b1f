"""Local blocks into stages (docs/design.md §2.1 step 3, used by ``schedule.py``): each rank's local
work gets per-stage budgets up to a common water level (``water_fill``), and its local blocks are
poured into the stages by those budgets, cut by q rows at stage boundaries but never into slivers
(``fill_stages_by_budget``, ``min_split_rows``)."""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.cuts import split_rows, with_stage
from megatron_hsap.plan.ir import Unit
from megatron_hsap.plan.placement import CostRates, rows_for_work

__all__ = ["MIN_SPLIT_ROWS", "min_split_rows", "water_fill", "fill_stages_by_budget"]


MIN_SPLIT_ROWS = 16  # local blocks are not cut into slivers thinner than this (flat prices: no kernel model)


def min_split_rows(rates: CostRates) -> int:
    """Fewest q rows a local block is cut to at a stage boundary: the kernel model's minimum
    tile (``KernelModel.min_block_rows``: a sliver under one row tile runs at rows/tile of the
    rate; docs/design.md §4), or ``MIN_SPLIT_ROWS`` under flat prices."""
    return rates.kernel.min_block_rows() if rates.kernel is not None else MIN_SPLIT_ROWS


def water_fill(floor: list[float], weights: list[float], amount: float) -> list[float]:
    """x ≥ 0 with Σx = amount minimising max_k (floor_k + x_k) / w_k (fill to level λ·w_k)."""
    n = len(floor)
    if amount <= 0 or n == 0:
        return [0.0] * n
    # a few dozen stages at most: Python floats (the same IEEE operations as the array form,
    # ``floor / weights``, a stable sort, ``max(λ·w − floor, 0)``), called per rank and staging
    fl, wl = floor, weights
    bp = [f / w for f, w in zip(fl, wl)]  # level at which stage k starts receiving
    order = sorted(range(n), key=bp.__getitem__)
    wsum = fsum = 0.0
    lam = bp[order[-1]]
    for j, k in enumerate(order):
        wsum += wl[k]
        fsum += fl[k]
        lam = (amount + fsum) / wsum
        if j + 1 == n or lam <= bp[order[j + 1]]:
            break
    return [max(lam * w - f, 0.0) for f, w in zip(fl, wl)]


def fill_stages_by_budget(units: list[Unit], budgets: np.ndarray, min_rows: int = MIN_SPLIT_ROWS) -> list[Unit]:
    """Local blocks into stages by cumulative work budgets, split by q rows at stage boundaries
    (never into a part thinner than ``min_rows``: the stage overfills or moves on instead)."""
    out: list[Unit] = []
    cum = np.cumsum(budgets).tolist()  # Python floats: the same values, without numpy scalar reads per block
    last = len(budgets) - 1
    k = 0
    poured = 0.0
    queue = list(reversed(units))
    while queue:
        u = queue.pop()
        while k < last and poured >= cum[k] * (1 - 1e-9):
            k += 1
        w = u.work
        if k == last or poured + w <= cum[k] * (1 + 1e-9):
            out.append(u.at_stage(k))
            poured += w
            continue
        room = cum[k] - poured
        n = rows_for_work(u.q, u.kv.start, u.causal, len(u.kv), room, u.window)
        if n < min(min_rows, len(u.q)):  # under a sliver of room left: the stage is full
            queue.append(u)
            k += 1
            continue
        if n >= len(u.q) - min_rows:  # all but a sliver fits: overfill a little instead
            out.append(u.at_stage(k))
            poured += w
            continue
        a, b = split_rows(u, u.q.start + n)
        out.append(with_stage(a, k))
        poured += a.work
        queue.append(b)
        k += 1
    return out

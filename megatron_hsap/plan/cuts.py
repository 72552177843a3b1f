"""Cutting placed blocks (docs/design.md §2.1 step 3, used by ``schedule.py``): by q rows, by kv columns or
in 2-D tiles, so a stage takes exactly the work and pool bytes it has room for and no input byte
travels twice."""

from __future__ import annotations

import math
import numpy as np

from megatron_hsap.plan.ir import TokenRange, Unit, new_unit, positional_builder
from megatron_hsap.plan.placement import CostRates, rows_for_work
from megatron_hsap.plan.units import clip_unit

__all__ = ["footprint", "held_bytes", "rank_footprints", "tiled_bytes", "split_rows", "split_cols", "with_stage", "cut_by_cols", "count_fitting",
           "smallest_piece", "tiles_below", "needs_tiles", "grid_tiles", "cut_fitting_part", "cut_fitting_part_room"]


# the planner's hottest constructions (~10^4 cuts per 1M-token compile): the slots' setters, not
# the dataclass ``__init__`` (equal objects; ``TokenRange``'s bounds check still runs)
_new_range = positional_builder(TokenRange)


def footprint(u: Unit, rates: CostRates) -> float:
    """Pool bytes ``u`` needs on its rank in backward (the larger phase): received inputs plus
    the partial results it sends home (in the gradient wire dtype: ``rates.dq``, ``rates.dkv``)."""
    total = 0.0
    if u.rank != u.q_owner:
        total += len(u.q) * (rates.q_bwd + rates.dq)
    if u.rank != u.kv_owner:
        total += len(u.kv) * (rates.kv + rates.dkv)
    return total


def held_bytes(remote: tuple[Unit, ...] | list[Unit], rates: CostRates) -> float:
    """Pool bytes one rank's remote blocks hold over all their stages, uncut: a lower bound of any
    staging's (a cut re-sends rows: its parts hold at least as much)."""
    return sum(footprint(u, rates) for u in remote)


def rank_footprints(remote: tuple[tuple[Unit, ...], ...], rates: CostRates, memo: dict) -> tuple[list[list[float]], list[float]]:
    """Per rank of ``remote`` (each rank's remote blocks): each block's ``footprint`` and their sum
    (``held_bytes``); memoised in ``memo`` (a split's: they do not depend on the pool budget, and a
    search stages under many budgets: 2.1 M footprints for one 1M-token document at 8x128)."""
    got = memo.get("footprints")
    if got is not None and got[0] is rates:
        return got[1]
    fps = [[footprint(u, rates) for u in rem] for rem in remote]
    out = (fps, [sum(f) for f in fps])
    memo["footprints"] = (rates, out)
    return out


def tiled_bytes(u: Unit, rates: CostRates, budget: float, fp: float | None = None) -> float:
    """Pool bytes ``u`` will occupy over all its stages once cut to fit ``budget``: its footprint
    (``fp`` when known), or, when both q rows and kv travel and they do not fit together, one
    budget per 2D tile (``cut_fitting_part`` re-sends a tile's q rows and kv columns with each
    neighbouring tile)."""
    if fp is None:
        fp = footprint(u, rates)
    if fp <= budget or u.rank == u.q_owner or u.rank == u.kv_owner:
        return fp
    fq, fk = rates.q_bwd + rates.dq, rates.kv + rates.dkv
    nq, nk = len(u.q), (u.q.stop - u.kv.start) if u.causal else len(u.kv)
    rows = min(nq, max(1.0, budget / (2 * fq)))
    cols = min(nk, max(1.0, (budget - rows * fq) / fk))
    tiles = math.ceil(nq / rows) * math.ceil(nk / cols) * (0.5 if u.causal else 1.0)
    return max(fp, tiles * (rows * fq + cols * fk))


def split_rows(u: Unit, m: int) -> tuple[Unit, Unit]:
    """Split ``u`` before global q row ``m``: a causal block's head keeps bottom-right alignment."""
    assert u.q.start < m < u.q.stop, (u, m)
    first_kv = _new_range(u.kv.start, m) if u.causal else u.kv
    a = _part(u, _new_range(u.q.start, m), first_kv, u.causal)
    b = _part(u, _new_range(m, u.q.stop), u.kv, u.causal)
    assert a is not None and b is not None, (u, m)
    return a, b


def split_cols(u: Unit, m: int) -> tuple[Unit, Unit]:
    """Split a rectangle before global kv row ``m``."""
    assert not u.causal and u.kv.start < m < u.kv.stop, (u, m)
    a = _part(u, u.q, _new_range(u.kv.start, m), False)
    b = _part(u, u.q, _new_range(m, u.kv.stop), False)
    assert a is not None and b is not None, (u, m)
    return a, b


def with_stage(u: Unit, stage: int) -> Unit:
    # not dataclasses.replace: called ~10^5 times per 1M-token compile (``Unit.at_stage``)
    return u.at_stage(stage)


def _part(u: Unit, q: TokenRange, kv: TokenRange, causal: bool) -> Unit | None:
    """A part of ``u`` on its rank and stage, clipped to the sliding window (None: beyond it).
    Row and column cuts of a clipped block are never empty (``plan/window.py``)."""
    w = u.window
    part = new_unit(u.doc, q, kv, causal, u.q_owner, u.kv_owner, u.rank, u.stage, w, -1)  # Unit(...), work not yet computed
    return part if w < 0 else clip_unit(part, w)


def cut_by_cols(u: Unit, rates: CostRates) -> bool:
    """Which side to cut a remote rectangle along: the one whose rows did not travel (no re-send),
    else so that the side re-sent with every part is the one of fewer bytes."""
    q_rem, kv_rem = u.rank != u.q_owner, u.rank != u.kv_owner
    if q_rem and not kv_rem:
        return False
    if kv_rem and not q_rem:
        return True
    return len(u.q) * (rates.q_bwd + rates.dq) <= len(u.kv) * (rates.kv + rates.dkv)


def count_fitting(amount: float, per: float) -> int:
    """How many items of size ``per`` fit in ``amount`` (unbounded amounts give a huge count)."""
    if amount <= 0:
        return 0
    if not math.isfinite(amount):
        return 1 << 62
    return int(amount // per)


def smallest_piece(u: Unit, rates: CostRates) -> float:
    """Work of the smallest part ``cut_fitting_part`` can cut from ``u`` (one row or one column)."""
    if u.causal:
        return float(u.q.start - u.kv.start + 1)
    return float(len(u.q) if cut_by_cols(u, rates) else len(u.kv))


def tiles_below(u: Unit, rates: CostRates) -> float:
    """The pool budget below which ``needs_tiles(u, budget)`` holds (−inf: never): q rows and kv both
    travel and even the shorter side nearly fills the budget. The one form of that rule, so a
    staging can tell which budgets leave its blocks whole (``schedule._cut_remote``)."""
    if u.rank == u.q_owner or u.rank == u.kv_owner:
        return -math.inf
    fq, fk = rates.q_bwd + rates.dq, rates.kv + rates.dkv
    if u.causal:  # row cuts (``cut_fitting_part``) can make progress unless one row's keys fill the budget
        return (u.q.stop - u.kv.start) * fk + fq if len(u.q) >= 2 else -math.inf
    # else cuts along the longer side (re-sending the shorter) can make progress while it fits half
    # the budget (``budget / 2 < m`` exactly when ``budget < 2 m``: halving and doubling are exact)
    return 2 * min(len(u.q) * fq, len(u.kv) * fk)


def needs_tiles(u: Unit, budget: float, rates: CostRates) -> bool:
    """Whether ``grid_tiles`` cuts ``u`` (whatever the share): q rows and kv both travel and even
    the shorter side nearly fills ``budget`` (``tiles_below``). Otherwise ``grid_tiles(u, ...)`` is ``[u]``."""
    return budget < tiles_below(u, rates)


def grid_tiles(u: Unit, share: float, budget: float, rates: CostRates) -> list[Unit]:
    """A block whose q rows and kv both travel and whose shorter side alone nearly fills
    ``budget`` (so 1-D cuts, which re-send that side with every part, cannot progress): cut into a
    grid of tiles of about ``share`` pairs (one stage's worth) that each fit the budget; a tile of
    area A costs r·fq + c·fk, least at r = sqrt(A·fk/fq). Causal blocks first split into their
    triangles and the rectangle between them."""
    if not needs_tiles(u, budget, rates):
        return [u]
    fq, fk = rates.q_bwd + rates.dq, rates.kv + rates.dkv
    nq, nk = len(u.q), len(u.kv)
    if u.causal:
        m = u.q.start + nq // 2
        parts = []
        if u.kv.start < u.q.start:  # keys before the rows: a rectangle of their own
            parts.append(_part(u, u.q, TokenRange(u.kv.start, u.q.start), False))
        parts += [
            _part(u, TokenRange(u.q.start, m), TokenRange(u.q.start, m), True),
            _part(u, TokenRange(m, u.q.stop), TokenRange(u.q.start, m), False),
            _part(u, TokenRange(m, u.q.stop), TokenRange(m, u.q.stop), True),
        ]
        return [t for part in parts if part is not None for t in grid_tiles(part, share, budget, rates)]
    area = max(1.0, min(float(share), float(nq) * nk, budget * budget / (4 * fq * fk)))
    r = min(nq, max(1, int(math.sqrt(area * fk / fq))))
    c = min(nk, max(1, int(area / r)))
    while r * fq + c * fk > budget and (r > 1 or c > 1):
        r, c = max(1, (r * 3) // 4), max(1, (c * 3) // 4)
    rows = np.linspace(u.q.start, u.q.stop, -(-nq // r) + 1).round().astype(np.int64).tolist()
    cols = np.linspace(u.kv.start, u.kv.stop, -(-nk // c) + 1).round().astype(np.int64).tolist()
    tiles = [_part(u, TokenRange(a, b), TokenRange(x, y), False)
             for a, b in zip(rows, rows[1:]) for x, y in zip(cols, cols[1:])]
    return [t for t in tiles if t is not None]


def cut_fitting_part(u: Unit, work: float, room: float, rates: CostRates) -> tuple[Unit | None, list[Unit]]:
    """Cut from remote block ``u`` a part with at most ``work`` pairs and ``room`` pool bytes.
    Returns (part, rest); part is None when not even one row/column fits.

    A block needing only q rows (kv local) is cut by rows, one needing only kv by columns: no
    byte travels twice. A rectangle needing both is cut along its longer side (the shorter is
    re-sent with every part; ``grid_tiles`` tiled the blocks where that side alone is too big). A
    causal block needing both is cut by rows (the key prefix is re-sent with every part)."""
    part, rest, _ = cut_fitting_part_room(u, work, room, rates)
    return part, rest


def cut_fitting_part_room(u: Unit, work: float, room: float, rates: CostRates) -> tuple[Unit | None, list[Unit], float]:
    """``cut_fitting_part`` and the least room that gives the same cut: any room from it up to
    ``room`` does (−inf when no row fits: a smaller room fits none either). The cut shrinks with
    the room only where the bytes bound it, so a pool-overflow restaging under a smaller budget
    can reuse a cut that had room to spare (``schedule._cut_remote``)."""
    q_rem, kv_rem = u.rank != u.q_owner, u.rank != u.kv_owner
    fq, fk = rates.q_bwd + rates.dq, rates.kv + rates.dkv
    nq, nk = len(u.q), len(u.kv)
    if u.causal:
        n = rows_for_work(u.q, u.kv.start, True, nk, work, u.window)
        need = -math.inf
        # halved while over the room: a smaller room halves at least as often, and stops at this n
        # exactly when its bytes still fit
        while n > 0:
            need = n * fq + (u.q.start + n - u.kv.start) * fk
            if need <= room:
                break
            n //= 2
        if n <= 0:
            return None, [u], -math.inf
        if n >= nq:
            return u, [], need
        a, b = split_rows(u, u.q.start + n)
        return a, [b], need
    by_cols = cut_by_cols(u, rates)
    # cutting along one axis: the other axis' rows (if remote) travel with every part
    length, per, fixed = (nk, fk, nq * fq if q_rem else 0.0) if by_cols else (nq, fq, nk * fk if kv_rem else 0.0)
    n = min(count_fitting(work, nq if by_cols else nk), count_fitting(room - fixed, per))
    if n <= 0:
        return None, [u], -math.inf
    # the same cut while ``count_fitting(room' - fixed, per)`` reaches min(n, length) (monotone in
    # the room); its bytes, checked by the same expression (float rounding), else no slack
    m = min(n, length)
    need = fixed + m * per
    if count_fitting(need - fixed, per) < m or need > room:
        need = room
    if n >= length:
        return u, [], need
    a, b = split_cols(u, u.kv.start + n) if by_cols else split_rows(u, u.q.start + n)
    return a, [b], need

"""Stages (docs/design.md §2.1 step 3): cut every rank's placed blocks into ``S`` stages so that each stage
carries the same compute on every rank and its inputs arrive, hidden, during the stage before.

Round ``k`` is posted at the start of stage ``k``; it carries the inputs of stage ``k + 1`` and the
results of stage ``k − 1``. So stage 0 computes only *local* blocks (inputs already on the rank),
and results of the last stage travel in a tail round that nothing hides. With ``S ≥ 3`` stages:

* stages ``1 .. S−2`` take the rank's *remote* blocks (some input or result travels), spread
  evenly by work (or, ``ring_fill``, filled from the first stage at the common level, like a ring)
  in ring order — at the ``s``-th remote stage rank ``r`` talks to rank ``r − s``, as in
  DistFlashAttn, so no rank feeds everyone in one round — and cut so that each stage's pool use
  (inputs + fp32 results, backward) stays within ``budget`` bytes: by q rows when only q travels,
  by kv columns when only kv does (no byte moves twice), along the longer side when both do (the
  shorter is re-sent), and in a grid of 2-D tiles when even the shorter side fills the budget;
* *local* blocks fill every stage up to a common water level ``λ·w_k`` with weights ``w = (α,
  1, …, 1, α)``: the first and last stages are local only (they hide the first inputs and the
  last results), so the most loaded rank carries the same work in every stage and the sum over
  stages of the slowest rank's compute equals the slowest rank's total. A rank short of local
  work may run thin kv-column slices of blocks it fetched kv for in the last stage (their only
  travelling result, dkv of a few columns, is small).

Local blocks are split by q rows (a causal block's head rows keep bottom-right alignment), never
into slivers under 16 rows. ``stage_shapes`` proposes ``StageShape(S, α, ring_fill)`` candidates; the planner
prices each (``estimate.price_staging``) and keeps the cheapest. No staging passes ``stage_cap``
stages (``StagingError``): only a pool far below the default would need more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megatron_hsap.plan.cuts import (cut_fitting_part_room, footprint, grid_tiles, needs_tiles, rank_footprints, smallest_piece, tiles_below,
                                     split_cols, split_rows, tiled_bytes, with_stage)
from megatron_hsap.plan.ir import Unit
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.pour import MIN_SPLIT_ROWS, fill_stages_by_budget, min_split_rows, water_fill

__all__ = ["BlocksByRank", "StagedBlocks", "StagingError", "StageShape", "default_shape", "stage", "stage_cap", "footprint",
           "stage_shapes", "split_rows", "split_cols"]


class StagingError(Exception):
    """Internal: a stage shape cannot hold this placement (or not within ``stage_cap`` stages)."""


# The most stages a staging may take (``stage_cap``): 8 per rank, at least 128, plus the two local
# end stages. Above every shape the work balance proposes (``stage_shapes``: at most twice
# max(8, 2P) middle stages) and, with room to spare, above what the default pool needs: the
# benchmark batches staged at most 40 stages at P 8 (cap 130), 62 at P 16 (cap 130), 12 at P 64.
# Only a pool far below the default needs more, and there every extra stage is a round of latency
# and more cut blocks to stage, price and build: a 227K-token batch at 8x16 under a 1 MiB pool took
# 3,448 stages and 23,887 blocks in one staging, 490 s and 5.4 GB to compile (docs/enable.md §7.4).
# A placement that needs more is not staged; when none fits, the compile names the pool. (The
# floor of 128: at a few ranks a staging is a few hundred blocks, cheap to compile at any count.)
_CAP_PER_RANK = 8
_CAP_MIN = 128


def stage_cap(size: int) -> int:
    """The most stages (two local end stages included) a staging of ``size`` ranks may take."""
    return max(_CAP_PER_RANK * size, _CAP_MIN) + 2


@dataclass(frozen=True, slots=True)
class StageShape:
    """``stages`` in all; remote blocks in stages ``1 .. stages−2`` (``1`` when ``stages == 2``);
    ``end_weight`` (α): weight of the first and last (local-only) stages against a middle one; ``ring_fill``:
    remote blocks fill the stages from the first at the common level (a ring: ranks with little
    remote work finish it early) instead of spreading evenly over all middle stages."""

    stages: int
    end_weight: float
    ring_fill: bool = False
    # the stage count of the shape with the same end weight this one doubles the middle stages of
    # (``stage_shapes``: n0 and 2·n0; 0: none). Not part of the shape's identity.
    doubles: int = field(default=0, compare=False)

    @property
    def weights(self) -> np.ndarray:
        s = self.stages
        w = np.ones(s)
        if s >= 2:
            w[0] = self.end_weight
        if s >= 3:
            w[-1] = self.end_weight
        return w

    @property
    def middle(self) -> range:
        s = self.stages
        return range(1, max(2, s - 1)) if s >= 2 else range(0)


@dataclass(frozen=True, slots=True)
class StagedBlocks:
    """A placement cut into stages before local blocks are poured: the remote parts (stage set),
    each rank's local blocks and their per-stage work budgets ``[P, stages]``."""

    stages: int
    remote: tuple[Unit, ...]
    local: tuple[tuple[Unit, ...], ...]
    local_budget: np.ndarray
    remote_work: np.ndarray  # [P, stages] pairs
    min_rows: int = MIN_SPLIT_ROWS  # pouring never cuts a local block thinner (``min_split_rows``)
    # where ``estimate.price_staging`` keeps what it derives from ``remote`` alone (bytes per
    # round, block costs): the split's memo, under a key naming the stage count and each rank's
    # memoised cut list when no rank's list was changed after the cut (``_fill_last``); stagings
    # of one split that differ only in the end weight then share it. None: not shared.
    memo: dict | None = field(default=None, compare=False, repr=False)
    memo_key: tuple | None = field(default=None, compare=False, repr=False)

    def units(self) -> list[Unit]:
        """Every block with its stage: the remote parts plus the local blocks poured by budget."""
        out = list(self.remote)
        for r, loc in enumerate(self.local):
            if not loc:
                continue
            # a pure function of the rank's blocks, budgets and ``min_rows``: kept on the split's
            # memo, since its stagings often give a rank the same budgets and a staging is poured
            # again when its code is built (380 distinct of 954 pours, fineweb 64K / P_inter 8)
            key = ("poured", r, self.local_budget[r].tobytes(), self.min_rows)
            hit = self.memo.get(key) if self.memo is not None else None
            if hit is None or hit[0] is not loc:
                hit = (loc, fill_stages_by_budget(list(loc), self.local_budget[r], self.min_rows))
                if self.memo is not None:
                    self.memo[key] = hit
            out.extend(hit[1])
        return out


@dataclass(frozen=True, slots=True)
class BlocksByRank:
    """A placement's blocks by rank: remote and local (in token order), with local work sums."""

    size: int
    remote: tuple[tuple[Unit, ...], ...]
    local: tuple[tuple[Unit, ...], ...]
    local_work: np.ndarray  # [P]
    remote_work: tuple[int, ...] = ()  # [P] exact pairs of each rank's remote blocks
    # staging memo, per split (so per compile and price set): (rank, budget) and (rank, "untiled")
    # -> the rank's remote blocks in ``_interleave`` order when no block needs 2-D tiles under that
    # budget (the order is then the same for every stage shape and budget tried) and the least
    # budget keeping them whole; ("cut", rank, middle stages, budget, level) -> ``_cut_remote``'s
    # parts; ("cut-spans", rank, middle stages, level) -> [(least budget, budget, parts)] of the cuts
    # made, for ``_cut_again`` to reuse under a budget in between; ("staged", shape, budget) ->
    # (rates, ``stage``'s result); ("poured", rank, budgets, min_rows) -> ``StagedBlocks.units``'
    # local parts; and ``estimate``'s and ``candidates``' entries (through ``StagedBlocks.memo``)
    orders: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, placed: list[Unit], size: int) -> "BlocksByRank":
        local: list[list[Unit]] = [[] for _ in range(size)]
        remote: list[list[Unit]] = [[] for _ in range(size)]
        lw = np.zeros(size)
        rw = [0] * size
        for u in placed:
            w = u.work
            if u.is_local:
                local[u.rank].append(u)
                lw[u.rank] += w
            else:
                remote[u.rank].append(u)
                rw[u.rank] += w
        for loc in local:
            loc.sort(key=lambda u: (u.q.start, u.kv.start))
        return cls(size, tuple(map(tuple, remote)), tuple(map(tuple, local)), lw, tuple(rw))


def stage(split: BlocksByRank, rates: CostRates, shape: StageShape, budget: float) -> StagedBlocks:
    """Cut ``split`` into ``shape``'s stages (see the module docstring); local blocks get budgets.

    ``budget``: pool bytes one rank may use for the remote blocks of one stage. When a rank's
    remote blocks need more middle stages than ``shape`` has, every rank gets the extra stages."""
    if shape.stages == 1 and any(split.remote):
        raise StagingError("one stage cannot hold blocks whose inputs travel")
    # the planner stages a split's default shape twice (its quick price, then again among every
    # shape): a pure function of these, and a StagedBlocks is never mutated, so the first is reused
    key = ("staged", shape, budget)
    hit = split.orders.get(key)
    if hit is not None and hit[0] is rates:
        return hit[1]
    st = _stage(split, rates, shape, budget)
    split.orders[key] = (rates, st)
    return st


def _stage(split: BlocksByRank, rates: CostRates, shape: StageShape, budget: float) -> StagedBlocks:
    size = split.size
    n_mid = len(shape.middle)
    cuts: list[list[Unit]] = [[] for _ in range(size)]
    works: list[list[int]] = [[] for _ in range(size)]  # pairs of each part in ``cuts``
    used = n_mid
    level = None
    if shape.ring_fill:  # the common per-stage level of the most loaded rank
        top = max(split.local_work[r] + split.remote_work[r] for r in range(size))
        level = top / float(shape.weights.sum())
    for r in range(size):
        if split.remote[r]:
            key = ("cut", r, n_mid, budget, level)  # a pure function of these: shapes that differ
            got = split.orders.get(key)  # only in alpha share it (the result is never mutated)
            if got is None:
                got = _cut_again(split, r, n_mid, rates, budget, level)
                split.orders[key] = got
            if isinstance(got, str):
                raise StagingError(got)
            cuts[r], works[r], n, _ = got
            used = max(used, n)
    memoised = list(cuts)  # the memo's list objects (alive in ``split.orders``, so their ids are stable)
    stages = shape.stages + (used - n_mid)
    # per rank as Python lists (a few stages: numpy's per-row calls cost more than the
    # arithmetic), the same values as ``StageShape.weights`` and the same operations per cell
    weights = [1.0] * stages
    if stages >= 2:
        weights[0] = shape.end_weight
    if stages >= 3:
        weights[-1] = shape.end_weight
    local_work = split.local_work.tolist()
    floor: list[list[float]] = []
    budgets: list[list[float]] = []
    remote: list[Unit] = []
    for r in range(size):
        row = [0.0] * stages  # the same additions, in the same order, as on the array
        for u, w in zip(cuts[r], works[r]):
            row[u.stage] += w
        bud = water_fill(row, weights, local_work[r]) if split.local[r] else [0.0] * stages
        if stages >= 3 and cuts[r]:
            filled = _fill_last(cuts[r], row, bud, weights, rates, budget)
            if filled is not cuts[r] and split.local[r]:  # (the same list: ``row`` unchanged, the same fill)
                bud = water_fill(row, weights, local_work[r])
            cuts[r] = filled
        floor.append(row)
        budgets.append(bud)
        remote.extend(cuts[r])
    shared = all(c is m for c, m in zip(cuts, memoised))
    key = ("priced", stages, tuple(id(c) if c else 0 for c in memoised)) if shared else None
    return StagedBlocks(stages, tuple(remote), split.local, np.array(budgets).reshape(size, stages),
                        np.array(floor).reshape(size, stages), min_split_rows(rates), split.orders, key)


def _cut_again(split: BlocksByRank, r: int, n_mid: int, rates: CostRates, budget: float,
               level: float | None) -> tuple[list[Unit], list[int], int, float] | str:
    """``_cut_remote``'s result under ``budget`` (its ``StagingError`` as the message), reusing a
    cut made under a larger budget whose least budget (``_cut_remote``) is at or below this one:
    every decision goes the same way, so the parts are the same (one 1M-token document at 8x128
    restages owner-computes under nine budgets after pool overflows, most of them cutting alike).
    The reused result is the same object, so stagings built on it share their remote prices too."""
    spans = split.orders.setdefault(("cut-spans", r, n_mid, level), [])
    for lo, hi, got in spans:
        if lo <= budget <= hi:
            return got
    try:
        got = _cut_remote(split, r, n_mid, rates, budget, level)
    except StagingError as e:
        return str(e)  # (a fact about these inputs too: every shape sharing them fails alike)
    if got[3] < budget:
        spans.append((got[3], budget, got))
    return got


def _fill_last(parts: list[Unit], floor: list[float], budgets: list[float], weights: list[float], rates: CostRates,
               budget: float) -> list[Unit]:
    """A rank short of local work idles in the local-only last stage. Blocks whose q rows are its
    own and whose kv was fetched can run there after all: their only result that travels is dkv of
    the kv columns, and a thin column slice of a tall block is much work for few bytes. Moves kv
    columns from the busiest middle stages until the last stage carries its share (``floor`` is
    updated in place)."""
    last = len(weights) - 1
    load = [f + b for f, b in zip(floor, budgets)]
    mid = load[1:last]
    if not mid:
        return parts
    n_mid = len(mid)
    alpha = weights[last]
    total = float(np.array(mid).sum())  # numpy's (pairwise) sum of the contiguous row, as before
    want = (alpha * total / n_mid - load[last]) / (1 + alpha / n_mid)
    if want <= 1e-3 * (total / n_mid):  # ``mid.mean()``: the same sum over the same count, without its Python wrapper
        return parts
    fetched = [i for i, u in enumerate(parts) if 0 < u.stage < last and not u.causal and u.rank == u.q_owner != u.kv_owner]
    if not fetched:
        return parts
    by_stage = load
    fetched.sort(key=lambda i: -by_stage[parts[i].stage])
    room_b = budget
    per_col = rates.kv + rates.dkv
    out = list(parts)
    for i in fetched:
        if want <= 0:
            break
        room_cols = int(room_b // per_col)
        if room_cols <= 0:
            break  # the pool budget only shrinks: no later block gets a column either
        u = out[i]
        kv = u.kv
        nk = kv.stop - kv.start
        cols = min(nk, int(want // (u.q.stop - u.q.start)), room_cols)
        if cols <= 0:
            continue
        if cols >= nk:
            moved, keep = u, None
        else:
            keep, moved = split_cols(u, kv.stop - cols)
        out[i] = keep
        out.append(with_stage(moved, last))
        mw = moved.work
        floor[u.stage] -= mw
        floor[last] += mw
        want -= mw
        room_b -= footprint(moved, rates)
    if len(out) == len(parts):  # nothing moved: the same list (so stagings can still share its prices)
        return parts
    return [u for u in out if u is not None]


def _interleave(units: list[Unit], size: int) -> list[Unit]:
    """Order a rank's remote blocks so that its traffic with every peer spreads over the stages.

    Within each (q owner, kv owner) group, in token order, a block is keyed by the middle of its
    share of the group's work; groups are merged by that key, ties broken by ring distance
    ``(rank − peer) mod P``. One big block per peer (one document over all ranks) thus runs in
    ring order — at the s-th remote stage rank r talks to rank r − s, as in DistFlashAttn — so no
    rank feeds many others in the same round."""
    groups: dict[tuple[int, int], list[Unit]] = {}
    for u in units:
        groups.setdefault((u.q_owner, u.kv_owner), []).append(u)
    if len(groups) == 1:
        return sorted(units, key=lambda u: (u.q.start, u.kv.start))
    keyed: list[tuple[float, int, int, Unit]] = []
    for (qo, ko), members in groups.items():
        members.sort(key=lambda u: (u.q.start, u.kv.start))
        rank = members[0].rank
        peer = qo if qo != rank else ko
        dist = (rank - peer) % size
        total = float(sum(u.work for u in members)) or 1.0
        acc = 0.0
        for j, u in enumerate(members):
            keyed.append((round((acc + u.work / 2) / total, 6), dist, j, u))
            acc += u.work
    keyed.sort(key=lambda t: t[:3])
    return [t[3] for t in keyed]


def _ordered_remote(split: BlocksByRank, r: int, per: float, budget: float, rates: CostRates) -> tuple[list[tuple[Unit, int, float]], float]:
    """Rank ``r``'s remote blocks, 2-D tiled where needed (``grid_tiles``), in ``_interleave``
    order, each with its work and pool footprint, and the least budget giving this list (every
    budget from it up to ``budget``; ``budget`` itself when a block is tiled: tiles follow the
    budget); cached on ``split`` when no block needs tiles under ``budget`` (then neither ``per``
    nor the budget matters: one list serves every budget without tiles, as a pool-overflow search
    restages under many)."""
    key = (r, budget)
    got = split.orders.get(key)
    if got is not None:
        return got
    units = split.remote[r]
    if any(needs_tiles(u, budget, rates) for u in units):
        order = _interleave([t for u in units for t in grid_tiles(u, per, budget, rates)], split.size)
        return [(u, u.work, footprint(u, rates)) for u in order], budget
    got = split.orders.get((r, "untiled"))
    if got is None:
        got = split.orders[(r, "untiled")] = ([(u, u.work, footprint(u, rates)) for u in _interleave(list(units), split.size)],
                                              max((tiles_below(u, rates) for u in units), default=-math.inf))
    split.orders[key] = got
    return got


def _cut_remote(split: BlocksByRank, r: int, n_mid: int, rates: CostRates, budget: float,
                level: float | None = None) -> tuple[list[Unit], list[int], int, float]:
    """Spread rank ``r``'s remote blocks evenly by work over middle stages ``1 .. n_mid`` (or,
    with ``level``, fill each from the first up to that much work) within ``budget`` pool bytes
    each; returns the parts (stage set), their pairs, how many middle stages they use (``> n_mid``
    when forced) and the least budget that cuts them alike: every pool-byte test taken the same
    way from it up to ``budget`` (a block that fit still fits, one that did not still does not; a
    cut the bytes did not bound is the same cut), so a pool-overflow restaging under a smaller
    budget reuses these parts (``_stage``). ``StagingError`` once they would need more than
    ``stage_cap`` allows (checked as the stages fill: past the cap nothing more is cut)."""
    limit = stage_cap(split.size) - 2
    total = float(split.remote_work[r])
    per = total / n_mid if level is None else max(level, total / (4 * n_mid), 1.0)
    out: list[Unit] = []
    works: list[int] = []
    k = 0  # middle stage index (stage k + 1)
    placed_w = acc_b = 0.0  # work placed so far (all stages), pool bytes of stage k
    order, least = _ordered_remote(split, r, per, budget, rates)
    queue = list(reversed(order))  # (block, work, footprint)
    # the pool-byte tests taken (``fp <= budget - acc_b`` true, a cut's room ``need`` <= budget -
    # acc_b) hold for every budget above max(fp + acc_b, need + acc_b) in exact arithmetic, so for
    # any float past the rounded sum: one ulp past the largest of them is a least budget
    top = -math.inf
    while queue:
        if k >= limit:  # the next part would land in stage k + 1, past the cap
            raise StagingError(f"rank {r}'s remote blocks need more than {limit} middle stages under {budget:.0f} pool bytes")
        u, w, fp = queue.pop()
        # cumulative target: stages 0..k hold per·(k+1); the last planned one takes the rest
        room_w = per * (k + 1) - placed_w if (k < n_mid - 1 or level is not None) else math.inf
        small = w <= 0.25 * per  # not worth a cut: place whole, later stages make up for it
        fits = fp <= budget - acc_b
        if fits and fp + acc_b > top:  # (taken or not below: a smaller budget must still fit it)
            top = fp + acc_b
        if (w <= room_w * 1.0001 + 1 or (small and room_w > 0.5 * w)) and fits:
            out.append(u.at_stage(k + 1))
            works.append(w)
            placed_w += w
            acc_b += fp
            if placed_w >= per * (k + 1) * 0.9999 and (k < n_mid - 1 or level is not None):
                k, acc_b = k + 1, 0.0
            continue
        part, rest = None, [u]
        if (not small or not fits) and room_w >= 0.1 * per:  # else the stage is full
            part, rest, need = cut_fitting_part_room(u, max(room_w, 0.0), budget - acc_b, rates)
            if need + acc_b > top:
                top = need + acc_b
        if part is None and acc_b == 0.0:
            # an empty stage: take at least one row or column, whatever the work target says
            part, rest, need = cut_fitting_part_room(u, max(room_w, smallest_piece(u, rates)), budget, rates)
            if need > top:
                top = need
            if part is None:
                part, rest = u, []  # not one row fits the pool budget: codegen decides
        if part is not None:
            out.append(with_stage(part, k + 1))
            pw = part.work
            works.append(pw)
            placed_w += pw
            acc_b += footprint(part, rates)
        if rest:
            queue.extend((t, t.work, footprint(t, rates)) for t in reversed(rest))
            k, acc_b = k + 1, 0.0
    least = min(max(least, math.nextafter(top, math.inf)), budget)
    return out, works, (out[-1].stage if out else 1), least  # stages only grow along the queue


def default_shape(shapes: list[StageShape]) -> StageShape:
    """The shape tried first: the fewest stages with half-length end stages (when offered)."""
    fewest = min(s.stages for s in shapes)
    return min((s for s in shapes if s.stages == fewest), key=lambda s: (abs(s.end_weight - 0.5), s.ring_fill))


def stage_shapes(split: BlocksByRank, rates: CostRates, budget: float, max_stages: int | None = None) -> list[StageShape]:
    """Candidate stage shapes for a placement: enough middle stages for the pool budget and for the
    most remote-heavy rank, with short or full-length local end stages; the caller prices each.
    Empty when some rank's remote blocks cannot fit ``max_stages`` (default ``stage_cap``) stages of
    ``budget`` bytes: their footprints alone (cuts only add re-sent rows) fill more."""
    size = split.size
    if max_stages is None:
        max_stages = stage_cap(size)
    fps, held = rank_footprints(split.remote, rates, split.orders)
    remote_w = np.array(split.remote_work, dtype=float)  # (exact: integer sums under 2^53)
    remote_b = np.zeros(size)
    for r in range(size):
        acc = 0.0  # (the same additions, in the same order, as on the array's element)
        for u, fp in zip(split.remote[r], fps[r]):
            acc += fp if fp <= budget else tiled_bytes(u, rates, budget, fp)
        remote_b[r] = acc
    if not remote_w.any() and not remote_b.any():
        return [StageShape(1, 1.0)]
    if max(held) > budget * (max_stages - 2):
        return []
    work = remote_w + split.local_work
    n_pool = int(math.ceil(float(remote_b.max()) / budget)) if budget > 0 else 1
    top = float(work.max())
    rho = min(float(remote_w.max()) / top, 0.999) if top > 0 else 0.0
    shapes: set[StageShape] = set()
    # A rank with remote work R needs n ≥ 2αR / (W* − R) middle stages to keep each under the
    # common level W*/(n + 2α). A rank with (almost) no local work cannot be helped by more
    # stages beyond a point: its loss is then the two short end stages, 2α/(n + 2α) of W*.
    fit_cap = max(8, 2 * size)
    for alpha in (0.25, 0.5, 1.0):
        n_fit = min(fit_cap, int(math.ceil(2 * alpha * rho / (1 - rho) - 1e-9))) if rho > 0 else 1
        n0 = max(1, n_pool, n_fit)
        base = StageShape(min(n0, max_stages - 2) + 2, alpha)
        shapes.add(base)
        shapes.add(StageShape(min(2 * n0, max_stages - 2) + 2, alpha, doubles=base.stages))  # (equal to base when capped: not added)
        shapes.add(StageShape(base.stages, alpha, ring_fill=True))
    if n_pool <= 1:
        shapes.add(StageShape(2, 1.0))
        shapes.add(StageShape(3, 1.0))
    return sorted(shapes, key=lambda s: (s.stages, s.end_weight, s.ring_fill))

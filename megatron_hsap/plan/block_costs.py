"""What a staged block costs to compute, per ``[rank, stage]`` (docs/design.md §4): the kernel at
its rate for the block's shape (``KernelModel``, ``plan/hardware.py``), a launch per varlen call
(``plan/calls.py``'s grouping, in closed form, gathered calls as one block plus their kv copy),
FA3's backward grid, GQA dK/dV atomics, and the LSE merges / fp32 accumulations of rows with more
than one contribution. ``plan/estimate.py``
turns these into phase times; split from it as its own concept (and to keep modules short).

Blocks are ``_arrays`` rows (int64, one per block); the functions here are numpy over them (they
run per staging the planner prices), except ``_block_costs_py``: the same sums as a Python loop
for the tens of remote blocks of a small staging (``block_costs_pair`` picks it; tested equal bit
for bit in ``tests/plan/test_compile_speed_equal_pricing.py``)."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np

from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.window import staircase_pairs

__all__ = ["BlockCosts", "BlockGroups", "block_costs", "block_costs_pair"]


@dataclass(frozen=True, slots=True)
class BlockCosts:
    """Compute seconds per [rank, stage] of one phase: ``kernel`` (attention kernels, slowed
    beside in-flight transfers) and ``fixed`` (launches, grid, local merges: not slowed);
    ``after``: merges of the results another rank computed, received in that round (done after
    its wait, ``codegen``'s ``Merge`` / ``Accumulate``); ``launch`` [P]: each rank's launch seconds."""

    kernel: np.ndarray
    fixed: np.ndarray
    launch: np.ndarray
    after: np.ndarray

    def seconds(self, sent: np.ndarray, recv: np.ndarray, slowdown: float) -> np.ndarray:
        if slowdown <= 0:
            return self.kernel + self.fixed
        return self.kernel * (1.0 + slowdown * ((sent > 0) | (recv > 0))) + self.fixed


def _arrays(units) -> np.ndarray:
    """[n, 10] int64: rank, stage, q.start, q.stop, kv.start, kv.stop, work, causal, q_owner, kv_owner
    (work in closed form, docs/design.md §4, unless a sliding window bands the block)."""
    if not units:
        return np.zeros((0, 10), dtype=np.int64)
    # one flat list of Python ints through ``array.array``: about half the time of ``np.array`` on a
    # list of tuples (which discovers the nesting and dtype per element); called per staging priced
    flat: list[int] = []
    put = flat.extend
    if len(units) <= _PY_ROWS:  # tens of blocks (a small staging): each block's cached ``work``
        # (the same pairs: ``Unit.work`` is ``banded_pairs``, the closed form below without a
        # window), without the half-dozen numpy calls of the column form
        for u in units:
            q, kv = u.q, u.kv
            put((u.rank, u.stage, q.start, q.stop, kv.start, kv.stop, u.work, u.causal, u.q_owner, u.kv_owner))
        return np.frombuffer(array("q", flat), dtype=np.int64).reshape(-1, 10).copy()
    for u in units:
        q, kv = u.q, u.kv
        put((u.rank, u.stage, q.start, q.stop, kv.start, kv.stop, 0, u.causal, u.q_owner, u.kv_owner, u.window))
    a = np.frombuffer(array("q", flat), dtype=np.int64).reshape(-1, 11).copy()
    n = a[:, 3] - a[:, 2]
    a[:, 6] = np.where(a[:, 7] == 1, staircase_pairs(n, a[:, 2] - a[:, 4] + 1), n * (a[:, 5] - a[:, 4]))
    banded = np.nonzero(a[:, 10] >= 0)[0]
    for i in banded:
        a[i, 6] = units[i].work
    return a[:, :10]


def _rows_again(rank: np.ndarray, start: np.ndarray, stop: np.ndarray, span: int) -> np.ndarray:
    """Per interval, rows already covered by an earlier interval of the same rank (intervals taken
    in start order): the rows whose contribution is merged into an accumulator."""
    n = len(rank)
    if n == 0:
        return np.zeros(0)
    a = rank * span + start
    b = rank * span + stop
    order = np.lexsort((b, a))
    a_s, b_s = a[order], b[order]
    reach = np.maximum.accumulate(b_s)
    prev = np.concatenate([[-1], reach[:-1]])  # keys are >= 0
    again = np.maximum(np.minimum(prev, b_s) - a_s, 0)
    out = np.zeros(n)
    out[order] = again
    return out


def _acc(grid: np.ndarray, idx: np.ndarray, vals) -> None:
    """``grid.flat[idx] += vals`` with repeated indices summed (``np.bincount``: far faster than ``np.add.at``)."""
    w = np.full(idx.shape, vals, dtype=np.float64) if np.ndim(vals) == 0 else vals
    grid.reshape(-1)[:] += np.bincount(idx, weights=w, minlength=grid.size)


@dataclass(frozen=True, slots=True)
class BlockGroups:
    """What ``block_costs`` needs of blocks ``a`` that does not depend on the phase (forward and
    backward price the same blocks: ``price_staging`` and ``quick_price`` group them once):
    each block's ``[rank, stage]`` cell, its varlen call (``gcell`` each call's cell), each call's
    longest kv sequence and sequence count, and the rows merged into an accumulator already
    holding an earlier contribution (q rows on the q owner — ``merge_q`` of the blocks there, a
    gathered call's q rows once — and kv rows on the kv owner). A gathered call (``plan/calls.py``)
    prices each member at the call's shape: ``knk`` / ``kw`` the kv rows / pairs of the block's
    sequence (its own outside a gathered call); ``acc_nk`` / ``gather_nk`` the kv rows of its GQA
    dK/dV accumulation / kv gather (the call's on its first member, 0 on the others)."""

    cell: np.ndarray
    gcell: np.ndarray
    maxk: np.ndarray
    count: np.ndarray
    home_q: np.ndarray
    merge_q: np.ndarray
    again_q: np.ndarray
    home_k: np.ndarray
    again_k: np.ndarray
    knk: np.ndarray
    kw: np.ndarray
    acc_nk: np.ndarray
    gather_nk: np.ndarray
    # what ``block_costs`` derives from these alone, the same in both phases (launch grids, index
    # arrays): computed by the first phase priced, reused by the second
    shared: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, a: np.ndarray, size: int, n: int, rates: CostRates | None = None) -> "BlockGroups":
        rank, stg, qa, qb, ka, kb, work, causal, qo, ko = a.T
        cell = rank * n + stg
        home_q = rank == qo
        home_k = rank == ko
        # the varlen calls of plan/calls.py, walking each stage's items in codegen's order (rank,
        # stage, q home, q start, kv start): an item with a remote operand or result is a call of
        # its own; consecutive local items with one causality fuse while their q and kv rows run
        # on in the rank's local rows (``CostRates.segments``; without them, in global tokens)
        order = np.lexsort((ka, qa, home_q, cell))
        local = (home_q & home_k)[order]
        c_o, cz, r_o = cell[order], causal[order], rank[order]
        lq_a, lq_b, lk_a, lk_b = _local_rows(rates, r_o, (qa[order], qb[order], ka[order], kb[order]))
        brk = np.ones(len(order), dtype=bool)
        brk[1:] = ((c_o[1:] != c_o[:-1]) | ~local[1:] | ~local[:-1] | (cz[1:] != cz[:-1])
                   | (lq_a[1:] != lq_b[:-1]) | (lk_a[1:] != lk_b[:-1]))
        inv = np.empty(len(order), dtype=np.int64)
        inv[order] = np.cumsum(brk) - 1
        gcell = c_o[brk]
        nk = kb - ka
        knk, kw, acc_nk, seq = nk, work, nk, np.ones(len(a), dtype=np.int64)
        merge_q, gather_nk = home_q, np.zeros(len(a), dtype=np.int64)
        gat = _gatherable(a)
        if np.count_nonzero(gat) > 1:  # gathered calls: same cell and q range, two or more members
            gi = np.nonzero(gat)[0]
            gi = gi[np.lexsort((inv[gi], qb[gi], qa[gi], cell[gi]))]  # runs in walk order
            new = np.ones(len(gi), dtype=bool)
            new[1:] = (cell[gi][1:] != cell[gi][:-1]) | (qa[gi][1:] != qa[gi][:-1]) | (qb[gi][1:] != qb[gi][:-1])
            run = np.cumsum(new) - 1
            multi = np.bincount(run)[run] > 1
            mem, lead = gi[multi], gi[new][run][multi]
            if len(mem):
                tot_nk = np.bincount(run, weights=nk[gi])[run][multi].astype(np.int64)
                tot_w = np.bincount(run, weights=work[gi])[run][multi].astype(np.int64)
                first = mem == lead
                knk, kw, acc_nk = nk.copy(), work.copy(), nk.copy()
                knk[mem], kw[mem] = tot_nk, tot_w
                acc_nk[mem] = np.where(first, tot_nk, 0)
                seq[mem] = first
                merge_q = home_q.copy()
                merge_q[mem] = first
                inv[mem] = inv[lead]  # one call, where its first member was; drop the others' calls
                keep = np.zeros(len(gcell), dtype=bool)
                keep[inv] = True
                inv = (np.cumsum(keep) - 1)[inv]
                gcell = gcell[keep]
                gather_nk[lead[first]] = tot_nk[first]
        maxk = np.zeros(len(gcell))
        np.maximum.at(maxk, inv, knk)
        span = int(max(qb.max(), kb.max())) + 1
        return cls(cell, gcell, maxk, np.bincount(inv, weights=seq, minlength=len(gcell)),
                   home_q, merge_q, _rows_again(rank[merge_q], qa[merge_q], qb[merge_q], span),
                   home_k, _rows_again(rank[home_k], ka[home_k], kb[home_k], span), knk, kw, acc_nk, gather_nk)


def _gatherable(a: np.ndarray) -> np.ndarray:
    """Blocks that may join a gathered call (``plan/calls.gatherable``): rectangles seeing every
    pair (not causal, work = nq·nk: no window cut), computed by their q owner with remote kv."""
    return ((a[:, 7] == 0) & (a[:, 0] == a[:, 8]) & (a[:, 0] != a[:, 9])
            & (a[:, 6] == (a[:, 3] - a[:, 2]) * (a[:, 5] - a[:, 4])))  # fmt: skip


def _may_gather(a: np.ndarray) -> bool:
    """Whether two blocks of ``a`` form a gathered call (same rank, stage and q range)."""
    g = _gatherable(a)
    if np.count_nonzero(g) < 2:
        return False
    seen: set[tuple[int, ...]] = set()
    for key in map(tuple, a[g][:, :4].tolist()):
        if key in seen:
            return True
        seen.add(key)
    return False


_SEG_MEMO: dict[int, tuple[object, np.ndarray, np.ndarray, np.ndarray, int]] = {}


def _local_rows(rates: CostRates | None, rank: np.ndarray, bounds: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Local rows on ``rank`` of the global token ranges ``(q start, q stop, kv start, kv stop)``
    (a stop maps through the segment of its last token), from ``rates.segments``; the tokens
    themselves without them or on a one-segment-per-rank layout. Only meaningful for blocks whose
    rows the rank holds (local items)."""
    segs = rates.segments if rates is not None else ()
    if not segs or len(rank) == 0 or all(len(ss) == 1 for ss in segs):
        return bounds
    hit = _SEG_MEMO.get(id(segs))
    if hit is None or hit[0] is not segs:
        arr = np.array([(r, t, l) for r, ss in enumerate(segs) for t, l in ss], dtype=np.int64).reshape(-1, 3)
        span = int(arr[:, 1].max(initial=0)) + (1 << 40)
        keys = arr[:, 0] * span + arr[:, 1]
        o = np.argsort(keys, kind="stable")
        if len(_SEG_MEMO) >= 8:
            _SEG_MEMO.clear()
        hit = _SEG_MEMO[id(segs)] = (segs, keys[o], arr[o, 1], arr[o, 2], span)
    _, keys, t0, l0, span = hit
    tok = np.concatenate(bounds)
    probe = tok - np.tile(np.repeat([0, 1], len(rank)), 2)  # a stop belongs to its last token's segment
    i = np.minimum(np.maximum(np.searchsorted(keys, np.tile(rank, 4) * span + probe, side="right") - 1, 0), len(keys) - 1)
    return tuple(np.split(l0[i] + tok - t0[i], 4))


def block_costs(a: np.ndarray, size: int, n: int, rates: CostRates, phase: Phase | str, groups: BlockGroups | None = None) -> BlockCosts:
    """Price the blocks ``a`` (``_arrays`` rows) of one phase on a ``[size, n]`` grid (see the
    module docstring; ``sim/hsap.py`` charges the same terms event by event); ``groups``:
    ``BlockGroups.of(a, size, n)`` when the caller prices both phases."""
    phase = Phase(phase)
    kern = np.zeros((size, n))
    after = np.zeros((size, n))
    if len(a) == 0:
        return BlockCosts(kern, np.zeros((size, n)), np.zeros(size), after)
    g = BlockGroups.of(a, size, n, rates) if groups is None else groups
    k = rates.kernel
    assert k is not None
    got = g.shared.get((size, n, k.launch_s))
    if got is None:  # phase-independent: launches (a zero grid plus them, as the phase would add) and indices
        rank, stg, qa, qb, ka, kb, work, _causal, qo, ko = a.T
        fixed0, launch0 = np.zeros((size, n)), np.zeros(size)
        _acc(fixed0, g.gcell, k.launch_s)
        _acc(launch0, g.gcell // n, k.launch_s)
        if g.gather_nk.any():  # a gathered call's kv copy (read and write), both phases
            _acc(fixed0, g.cell, g.gather_nk * (2.0 * rates.kv / rates.hbm_bw))
        away_q, away_k = ~g.home_q, ~g.home_k
        nq, nk = qb - qa, kb - ka
        got = g.shared[(size, n, k.launch_s)] = (
            fixed0, launch0, nq, g.knk, work, np.maximum(g.kw, 1).astype(np.float64),
            g.cell[g.merge_q], qo[away_q] * n + np.minimum(stg[away_q] + 1, n - 1), nq[away_q],
            g.cell[g.home_k], ko[away_k] * n + np.minimum(stg[away_k] + 1, n - 1), nk[away_k])
    fixed0, launch0, nq, knk, work, w, cell_hq, after_q, nq_away, cell_hk, after_k, nk_away = got
    fixed, launch = fixed0.copy(), launch0.copy()
    fpp = rates.fpp_fwd if phase == Phase.FWD else rates.fpp_bwd
    secs = work * fpp / k.rate(nq, knk, phase, rates.group, w)  # a gathered call's members at its shape
    cell = g.cell
    _acc(kern, cell, secs)
    if phase != Phase.FWD and k.cta_s > 0:  # FA3's backward grid: ⌈max kv / 128⌉ × heads CTAs per block
        _acc(fixed, g.gcell, k.cta_s * np.ceil(g.maxk / 128.0) * rates.heads * g.count)
    if phase != Phase.FWD and k.gqa_dkv_accum and rates.group > 1:
        T = float(k.tile or 128)
        _acc(fixed, cell, np.ceil(g.acc_nk / T) * rates.heads * T * rates.accum_row / rates.hbm_bw)
    if phase == Phase.FWD:  # o rows merged into the q owner's accumulator
        _acc(fixed, cell_hq, g.again_q * rates.merge_o)
        _acc(after, after_q, nq_away * rates.merge_o)
    else:  # dq into the q owner's, dk/dv into the kv owner's fp32 gradients
        _acc(fixed, cell_hq, g.again_q * rates.merge_dq)
        _acc(after, after_q, nq_away * rates.merge_dq)
        _acc(fixed, cell_hk, g.again_k * rates.merge_dkv)
        _acc(after, after_k, nk_away * rates.merge_dkv)
    return BlockCosts(kern, fixed, launch, after)


# up to this many blocks (none of them local) ``block_costs_pair`` runs as a Python loop: the
# planner prices tens of remote blocks per staging (fineweb 64K, 8 ranks: ~25), where the ~80
# numpy calls of ``BlockGroups.of`` and two ``block_costs`` cost more than the loop
_PY_ROWS = 96


def block_costs_pair(a: np.ndarray, size: int, n: int, rates: CostRates) -> tuple[BlockCosts, BlockCosts]:
    """``block_costs`` of ``a`` in both phases (forward, backward) over one ``BlockGroups``; for up
    to ``_PY_ROWS`` blocks none of which is local and no two of which gather into one call, the
    same numbers from ``_block_costs_py``."""
    if 0 < len(a) <= _PY_ROWS and not ((a[:, 0] == a[:, 8]) & (a[:, 0] == a[:, 9])).any() and not _may_gather(a):
        return _block_costs_py(a, size, n, rates)
    g = BlockGroups.of(a, size, n, rates) if len(a) else None
    return block_costs(a, size, n, rates, Phase.FWD, g), block_costs(a, size, n, rates, Phase.BWD, g)


def _block_costs_py(a: np.ndarray, size: int, n: int, rates: CostRates) -> tuple[BlockCosts, BlockCosts]:
    """``BlockGroups.of`` + ``block_costs`` per phase as a loop over blocks none of which is local
    and none gathered (so every block is a varlen call of its own: ``maxk`` its kv length, ``count`` 1): every cell
    receives the same terms in the same order as ``np.bincount`` adds them (input order: blocks
    in ``a``'s order, calls in ``BlockGroups``' (cell, q home, q start, kv start) order), each
    ``_acc`` summed from zero before it is added to the grid. Kernel rates come from the kernel
    model's own arrays (``KernelModel.rate``: one definition of the curve)."""
    k = rates.kernel
    assert k is not None
    rows = a.tolist()
    m = len(rows)
    nq_a, nk_a = a[:, 3] - a[:, 2], a[:, 5] - a[:, 4]
    w = np.maximum(a[:, 6], 1).astype(np.float64)
    rate = {ph: k.rate(nq_a, nk_a, ph, rates.group, w).tolist() for ph in (Phase.FWD, Phase.BWD)}
    cells = size * n
    cell = [r[0] * n + r[1] for r in rows]
    home_q = [r[0] == r[8] for r in rows]
    home_k = [r[0] == r[9] for r in rows]
    calls = sorted(range(m), key=lambda i: (cell[i], home_q[i], rows[i][2], rows[i][4]))  # lexsort: stable
    span = int(max(a[:, 3].max(), a[:, 5].max())) + 1

    def again(home: list[bool], lo: int, hi: int) -> list[tuple[int, float]]:
        """``_rows_again`` of the blocks with ``home`` (in block order): (cell, rows again)."""
        idx = [i for i in range(m) if home[i]]
        keys = [(rows[i][0] * span + rows[i][lo], rows[i][0] * span + rows[i][hi]) for i in idx]
        out = [0.0] * len(idx)
        prev = -1
        for j in sorted(range(len(idx)), key=keys.__getitem__):
            ka, kb = keys[j]
            out[j] = float(max(min(prev, kb) - ka, 0))
            prev = kb if kb > prev else prev
        return [(cell[i], x) for i, x in zip(idx, out)]

    def away(home: list[bool], lo: int, hi: int, oc: int) -> list[tuple[int, int]]:
        """(cell of the owner's merge after the round, rows) of the blocks without ``home``."""
        return [(r[oc] * n + min(r[1] + 1, n - 1), r[hi] - r[lo]) for r, h in zip(rows, home) if not h]

    def summed(terms: list[tuple[int, float]]) -> list[float]:
        """One ``np.bincount``: the terms added one by one from zero, per cell."""
        part = [0.0] * cells
        for c, v in terms:
            part[c] += v
        return part

    def plus(grid: list[float], part: list[float]) -> list[float]:
        return [x + y for x, y in zip(grid, part)]

    again_q, again_k = again(home_q, 2, 3), again(home_k, 4, 5)
    away_q, away_k = away(home_q, 2, 3, 8), away(home_k, 4, 5, 9)
    launch_s, heads = k.launch_s, rates.heads
    fixed0 = summed([(cell[i], launch_s) for i in calls])
    launch0 = [0.0] * size
    for i in calls:
        launch0[rows[i][0]] += launch_s
    out = []
    for phase in (Phase.FWD, Phase.BWD):
        fpp = rates.fpp_fwd if phase == Phase.FWD else rates.fpp_bwd
        kern = summed([(c, r[6] * fpp / x) for c, r, x in zip(cell, rows, rate[phase])])
        fixed = fixed0
        if phase == Phase.FWD:
            mo = rates.merge_o
            fixed = plus(fixed, summed([(c, x * mo) for c, x in again_q]))
            after = summed([(c, nq * mo) for c, nq in away_q])
        else:
            if k.cta_s > 0:
                cta = k.cta_s
                fixed = plus(fixed, summed([(cell[i], cta * float(math.ceil(float(rows[i][5] - rows[i][4]) / 128.0)) * heads * 1)
                                            for i in calls]))
            if k.gqa_dkv_accum and rates.group > 1:
                T = float(k.tile or 128)
                ar, hb = rates.accum_row, rates.hbm_bw
                fixed = plus(fixed, summed([(c, float(math.ceil((r[5] - r[4]) / T)) * heads * T * ar / hb) for c, r in zip(cell, rows)]))
            mq, mk = rates.merge_dq, rates.merge_dkv
            fixed = plus(fixed, summed([(c, x * mq) for c, x in again_q]))
            after = summed([(c, nq * mq) for c, nq in away_q])
            fixed = plus(fixed, summed([(c, x * mk) for c, x in again_k]))
            after = plus(after, summed([(c, nk * mk) for c, nk in away_k]))
        out.append(BlockCosts(np.array(kern).reshape(size, n), np.array(fixed).reshape(size, n), np.array(launch0),
                              np.array(after).reshape(size, n)))
    return out[0], out[1]

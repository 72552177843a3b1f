"""The document-aware ``balanced`` layout (beyond the paper): balance exact work before any byte moves.

Every non-attention layer is token-wise, so a micro-batch's tokens may sit on CP ranks in any
order as long as labels, loss mask and positions travel with them (Transformer Engine's zigzag is
one such permutation). This layout chooses the permutation per batch:

1. every inter rank holds exactly ``L = T'/P_inter`` tokens (equal activation memory);
2. documents go largest work first; a document too heavy (or too long) for one rank is split
   zigzag-style over ``k`` ranks: cut into ``2k`` near-equal pieces, rank ``j`` of the ``k`` takes
   pieces ``j`` and ``2k−1−j`` (a head–tail pair) — equal consecutive pieces of one causal
   document carry unequal work, head–tail pairs carry equal work;
3. other documents go whole to the least-loaded rank with room (LPT), or to the lowest
   *projected* load (load + the rest of its room at the density of what is still to place);
4. documents that fit nowhere whole are cut to fill the ranks' remaining room exactly (a small one
   that would be shredded over many ranks: contiguously over the largest rooms, ``_SLIVER_RANKS``).

Splitting is traffic: the split document's later pieces need the kv of its pieces elsewhere.
``token_cost`` (pairs of attention per kv token moved, from the link and the head shape) makes
the layout weigh that against the balance it buys, so over a slow link it splits less — except
among inter ranks that share a node (``node_prices.NodePrices``: kv between them at NVLink's price), where it
splits a long document inside one node, as Megatron's dynamic CP rings a long sample; a rank's
time is modelled as ``max(work, traffic) + ½·min(work, traffic)`` (the staged plan hides most of
the smaller behind the larger). Several
greedy variants (how many ranks each document is split over: only when longer than a rank, by
work, by work and density, or chosen per document; LPT or projected) are run — a few ms each —
and the lowest busiest-rank cost is kept. The SAP plan then still moves work where the layout
alone cannot balance, and ``compile_plan`` keeps the contiguous plan if it is estimated faster.
Work is counted as owner-computes work (q rows × every earlier key of their document).
Deterministic: ties break by rank index and document order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsap.plan.ir import Segment, TokenRange, positional_builder
from megatron_hsap.plan.layout import Batch, Layout, contiguous_layout
from megatron_hsap.plan.node_prices import NodePrices
from megatron_hsap.plan.window import banded_pairs, staircase_pairs

if TYPE_CHECKING:
    from megatron_hsap.plan.placement import CostRates

__all__ = ["balanced_layout", "kv_token_cost", "piece_work", "kept_layout"]

_new_segment, _new_range = positional_builder(Segment), positional_builder(TokenRange)  # ~2x the dataclass __init__


def piece_work(doc_start: int, a: int, b: int, window: int = -1) -> int:
    """Owner-computes pairs of rows ``[a, b)`` of a document starting at ``doc_start`` (banded
    under a sliding ``window``: ``plan/window.py``)."""
    if window >= 0:
        return banded_pairs(a, b, doc_start, b, window)
    return staircase_pairs(b - a, a - doc_start + 1)  # no ranges built: the layout's inner loop


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


def _split_counts(lengths: np.ndarray, work: np.ndarray, size: int, chunk: int) -> np.ndarray:
    """Ranks each document is split over (1 = kept whole).

    A rank holding ``n/k`` tokens (work ``w/k``) of a split document fills the rest of its room
    with the whole documents, of density ``ρ`` (work per token) — so the share must leave room
    for that: ``w/k + (chunk − n/k)·ρ ≤ τ`` ⇒ ``k ≥ (w − nρ)/(τ − chunk·ρ)``. ``ρ`` depends on which
    documents are split, so the split set is refined a few times from ``w > τ``."""
    tau = float(work.sum()) / size
    k = np.where(work > tau * (1 + _SLACK), np.ceil(work / tau), 1.0)
    for _ in range(4):
        whole = k == 1
        tokens = float(lengths[whole].sum())
        rho = float(work[whole].sum()) / tokens if tokens else 0.0
        denom = tau - chunk * rho
        if denom <= 0:
            break  # whole documents as dense as the mean: nothing better to derive
        over = work + (chunk - lengths) * rho > tau * (1 + _SLACK)
        new = np.where(over, np.ceil(np.maximum(work - lengths * rho, 0.0) / denom), 1.0)
        if np.array_equal(new, k):
            break
        k = new
    k = np.maximum(k, np.ceil(lengths / chunk))  # a share must fit one rank's tokens
    return np.clip(k, 1, size).astype(np.int64)


_LAYOUT_GAIN_PERCENT = 1  # layout="balanced" skips its compile when the contiguous plan is this close to the compute bound
_SLACK = 0.02  # a document whole on a rank may overshoot the mean work by this before it is split
_EXPOSED = 0.5  # measured: 0.5 beat 0.1, 0.25 and 1.0 (no overlap) on plan estimates, 64K–1M, P 8–64
_KEEP_WITHIN = 1.005  # balanced_layout keeps the fewest pieces among the variants within 0.5% of the cheapest
_MIN_PIECE = 64  # tokens: balance alone never cuts a document into head/tail pieces smaller than this
# A document whose split had to be widened, for want of room, past the count it asked for, past
# _SLIVER_RANKS ranks and into head/tail pieces under _MIN_PIECE tokens is instead cut contiguously
# over the largest rooms (the fewest pieces, one per rank; its work is too small for head-tail
# balance to matter). Each piece costs a kernel call per earlier piece of it on its rank (a remote
# block, plan/calls.py), 5 us each. Measured at 1,024 GPUs (8 x 128, slimpajama 1M, GQA 64:8):
# 20-89-token documents were spread head-tail over up to 26 ranks in 1-2-token pieces, 43 of the
# critical rank's 109 remote calls per phase; with this rule the estimate went 3.05 -> 2.80 ms,
# simulated fwd / bwd 1.35 / 2.40 -> 1.22 / 2.26 ms (pair imbalance 1.50 both). 8, not 1: the rule
# never fires at P_inter <= 8 and left every Table 2 / Table 4 / MagiAttention result as it was (one
# of 20 Table 2 SP 16 layouts moved, its plan did not); threshold 1 -- any widened split of a small
# document -- gave 2.65 ms, 1.08 / 2.11 ms but changed 47 of 159 benchmark layouts and 18 of 29 plan
# fixtures.
_SLIVER_RANKS = 8


def _assign(starts: np.ndarray, lengths: np.ndarray, work: np.ndarray, k_of: np.ndarray | None, size: int,
            chunk: int, projected: bool, token_cost: float, window: int = -1,
            abandon_above: float = float("inf"), nodes: NodePrices | None = None) -> tuple[list[list[tuple[int, int]]], np.ndarray]:
    """One greedy assignment: ``(pieces held per rank, estimated cost per rank)``.

    ``abandon_above``: raise ``_Abandoned`` as soon as one rank's cost exceeds it (costs only grow
    while pieces are given: the finished assignment would cost more still; ``balanced_layout``).

    Documents go largest work first. With ``k_of`` a document is cut head–tail over ``k_of[d]``
    ranks; without it, over the ``k`` (smallest first, pieces ≥ ``_MIN_PIECE``) that minimises
    the busiest chosen rank's cost. A rank's cost (``_cost``) combines its owner-computes work and
    ``token_cost`` × the kv tokens of its split documents held elsewhere (pairs per token moved:
    the layout stays traffic-aware, so a slow link splits less). Whole documents go to the best
    rank with room: the least costly (LPT) or, with ``projected``, the lowest projected final
    cost — plus what the rest of its room will hold at the density of the documents still to
    place (LPT ignores rooms and can leave the last ranks to fill with dense material; the
    projection can overshoot when that density falls fast — the caller tries both). Documents
    that fit nowhere whole are cut into the remaining rooms, least costly rank first."""
    room = np.full(size, chunk, dtype=np.int64)
    load = np.zeros(size)  # owner-computes work (pairs)
    traffic = np.zeros(size)  # kv tokens to receive × token_cost (pairs)
    held: list[list[tuple[int, int]]] = [[] for _ in range(size)]

    # ``_cost(load, traffic)`` kept up to date rank by rank (the key of the LPT variants, whose
    # projection density is 0): the same float operations as ``_cost``, one rank at a time
    cost = np.zeros(size)

    # Python mirrors of the arrays, for the scalar updates of ``give`` (the same float64 values and
    # operations; numpy scalar reads and in-place updates only cost time)
    room_l, load_l, traffic_l, cost_l = room.tolist(), load.tolist(), traffic.tolist(), cost.tolist()
    by_cost = sorted((c, r) for r, c in enumerate(cost_l))  # every rank by (cost, rank), kept sorted by give

    def give(r: int, a: int, b: int, doc_start: int, remote: float, price: float = token_cost) -> None:
        held[r].append((a, b))
        room[r] = room_l[r] = room_l[r] - (b - a)
        load[r] = lr = load_l[r] = load_l[r] + piece_work(doc_start, a, b, window)
        traffic[r] = tr = traffic_l[r] = traffic_l[r] + price * remote
        del by_cost[bisect.bisect_left(by_cost, (cost_l[r], r))]
        cost[r] = cost_l[r] = c = (lr if lr >= tr else tr) + _EXPOSED * (tr if lr >= tr else lr)
        if c > abandon_above:
            raise _Abandoned
        bisect.insort(by_cost, (c, r))

    def cut_contiguously(s: int, n: int, rank_key: Callable[[int], tuple]) -> int:
        """Give document ``[s, s + n)`` in consecutive pieces to the ranks with room, in
        ``rank_key`` order, each piece filling its rank's room; returns where the pieces stopped."""
        a = s
        for r in sorted((r for r in range(size) if room_l[r] > 0), key=rank_key):
            if a >= s + n:
                break
            b = min(s + n, a + room_l[r])
            give(r, a, b, s, a - s)  # its kv rows before this piece are held elsewhere
            a = b
        return a

    order = np.lexsort((np.arange(len(lengths)), -work))
    rest_work, rest_tokens = float(work.sum()), float(lengths.sum())
    cap = float(work.sum()) / size * (1 + _SLACK)
    leftovers: list[int] = []
    ranks = np.arange(size)
    # Python scalars for the per-document loop (the same float64 values: numpy scalars only cost time)
    starts_l, lengths_l, work_l = starts.tolist(), lengths.tolist(), work.tolist()
    k_of_l = None if k_of is None else k_of.tolist()
    for d in order.tolist():
        s, n = int(starts_l[d]), int(lengths_l[d])
        wd = float(work_l[d])
        rest_work -= wd
        rest_tokens -= n
        rho = rest_work / rest_tokens if projected and rest_tokens else 0.0
        if rho:  # projected: the rest of the room fills at the remaining density
            projected_load = load + room * rho
            key = _cost(projected_load, traffic)
        else:  # load + room·0 is load, bit for bit: the maintained cost is the key
            projected_load, key = load, cost
        keys_l: list[float] = []  # (projected) the key as Python floats, listed when first needed
        pl_l: list[float] = []  # (projected) projected_load as Python floats, listed when first needed
        best: tuple[float, int, np.ndarray | list[int]] | None = None
        by_key: list[np.ndarray] = []  # every rank by (key, rank), sorted once per document

        def best_ranks(k: int) -> np.ndarray | list[int] | None:
            """The k lowest-key ranks with room for a ``⌈n/k⌉`` share (None if fewer fit)."""
            if k == 1:  # the common case: the lowest key with room (ties: lowest rank)
                if not rho:  # the key is the cost: the first rank by (cost, rank) with room
                    for _, r in by_cost:
                        if room_l[r] >= n:
                            return [r]
                    return None
                if not keys_l:  # projected: a scan of the key as Python floats, listed once per document
                    keys_l.extend(key.tolist())
                r, low = -1, 0.0
                for j in range(size):
                    if room_l[j] >= n and (r < 0 or keys_l[j] < low):
                        r, low = j, keys_l[j]
                return [r] if r >= 0 else None  # (read as chosen[0] only)
            if not by_key:
                order = np.lexsort((ranks, key))
                by_key.extend((order, room[order]))
            order, rooms = by_key
            fit = order[rooms >= -(-n // k)]  # the ranks with room, still by (key, rank)
            return fit[:k] if len(fit) >= k else None

        def split_peak(k: int, chosen: np.ndarray) -> tuple[float, np.ndarray, np.ndarray | None]:
            """The busiest chosen rank's cost with a ``k``-way share of this document, and the
            chosen ranks; with ``nodes``, also the lowest-key ranks of each node that can take the
            whole split alone, kv priced per pair of pieces (``NodePrices.traffic``): the cheaper set wins."""
            share = wd / k - rho * n / k
            # ``_cost(projected_load[ranks] + share, traffic[ranks] + extra).max()`` rank by rank: the
            # same float operations on Python floats (k is small: numpy's calls cost more)
            if rho and not pl_l:
                pl_l.extend(projected_load.tolist())
            pl = pl_l if rho else load_l  # (load_l mirrors load; no piece is given during the search)

            def peak_of(ranks: list[int], extra: Iterable[float]) -> float:
                peak = -np.inf
                for r, t in zip(ranks, extra):
                    lw, tw = pl[r] + share, traffic_l[r] + t
                    c = (lw if lw >= tw else tw) + _EXPOSED * (tw if lw >= tw else lw)
                    if c > peak:
                        peak = c
                return peak

            if nodes is None or not nodes.prices(wd, cap):
                return peak_of(chosen.tolist(), repeat(token_cost * n * (k - 1) / k)), chosen, None
            best_set: tuple[float, np.ndarray, list[float] | None] | None = None
            order, rooms = by_key  # (built by best_ranks(k) for k > 1)
            fit = order[rooms >= -(-n // k)]
            for ranks in (chosen, *nodes.within(fit, k)):
                rl = ranks.tolist()
                tr = nodes.traffic(rl, n / k)
                peak = peak_of(rl, tr)
                if best_set is None or peak < best_set[0]:
                    best_set = (peak, ranks, tr)
            assert best_set is not None
            return best_set

        k_asked = int(k_of_l[d]) if k_of_l is not None else max(1, -(-n // chunk))
        best_tr: list[float] | None = None  # (nodes) the kept split's kv traffic per chosen rank, in pairs
        if k_of_l is not None:  # fixed split count (widened only when rooms are short)
            for k in range(k_asked, size + 1):
                chosen = best_ranks(k)
                if chosen is not None:
                    if k > 1 and nodes is not None:
                        _, chosen, best_tr = split_peak(k, chosen)
                    best = (0.0, k, chosen)
                    break
        else:
            k_max = min(size, max(1, n // (2 * _MIN_PIECE)))
            bound: _WiderBound | None = None  # built at the first k that needs it (fixed for this document)
            for k in range(k_asked, size + 1):
                chosen = best_ranks(k)
                if chosen is None:
                    continue
                if k == 1:  # one rank: the same float operations on scalars
                    r0 = int(chosen[0])
                    floor = float(key[r0])
                    lw = float(projected_load[r0]) + wd / k - rho * n / k
                    tw = float(traffic[r0]) + token_cost * n * (k - 1) / k
                    peak = (lw if lw >= tw else tw) + _EXPOSED * (tw if lw >= tw else lw)
                    tr_k = None
                else:
                    floor = float(key[chosen[-1]])  # chosen runs by (key, rank): its last key is its largest
                    # the share displaces n/k tokens of filler (projected) and pays its kv traffic
                    peak, chosen, tr_k = split_peak(k, chosen)
                if best is None or peak < best[0]:
                    best = (peak, k, chosen)
                    best_tr = tr_k
                if peak <= cap or k >= k_max or floor >= best[0]:
                    break
                if bound is None:
                    near = nodes is not None and nodes.prices(wd, cap)  # split_peak prices kv inside a node cheaper
                    bound = _WiderBound(n, wd, rho, nodes.local_cost if near else token_cost, projected_load, traffic, room)
                if bound.cannot_win(best[0], k):
                    break
        if best is None:
            leftovers.append(d)
            continue
        _, k, chosen = best
        if k == 1:
            give(int(chosen[0]), s, s + n, s, 0.0)
            continue
        if k > max(k_asked, _SLIVER_RANKS, n // (2 * _MIN_PIECE)):  # widened into slivers (_SLIVER_RANKS)
            cut_contiguously(s, n, lambda r: (-room_l[r], r))  # the largest rooms: the fewest pieces
            continue
        # (nodes) each rank's kv priced by where its peers' pieces are, else every token at token_cost
        tr_of = None if best_tr is None else dict(zip(chosen.tolist(), best_tr))
        for r, parts in zip(sorted(chosen.tolist()), _zigzag(s, n, k)):
            for a, b in parts:
                if tr_of is None:
                    give(r, a, b, s, n * (k - 1) / k / len(parts))
                else:
                    give(r, a, b, s, tr_of[r] / len(parts), 1.0)
    for d in sorted(leftovers, key=lambda d: starts[d]):
        s, n = int(starts[d]), int(lengths[d])
        placed = cut_contiguously(s, n, lambda r: (load[r] + traffic[r], r))
        assert placed == s + n, "token rooms must absorb every leftover document"
    return held, _cost(load, traffic)


class _Abandoned(Exception):
    """An assignment stopped by ``abandon_above``: it cannot be the kept variant."""


class _WiderBound:
    """Whether no split of a document (``n`` tokens, work ``wd``) over ``k' > k`` ranks can cost
    less than ``best`` (``_assign``'s search then stops: skipping candidates that cannot replace
    the best changes nothing). Each of the ``k'`` chosen ranks ``r`` (with room) pays
    ``traffic[r] + token_cost·n·(k'−1)/k'``, at least ``traffic[r] + A`` with ``A =
    token_cost·n·k/(k+1)``, on a load of ``projected_load[r] + (wd − ρ·n)/k'``: at least
    ``projected_load[r]`` when ``wd ≥ ρ·n``, at least 0 otherwise (a chosen rank has room for its
    share). ``_cost`` grows with both, so the busiest chosen rank costs at least the least of
    those bounds over the ranks with room; the margin (1e-9 of the magnitudes) is far above the
    rounding of the candidates' own float operations. Built once per document (the ranks with
    room and their loads do not change while its split count is searched), asked per ``k``."""

    __slots__ = ("n", "token_cost", "open", "loads", "traffics", "least_traffic", "top", "wd", "by_load")

    def __init__(self, n: int, wd: float, rho: float, token_cost: float, projected_load: np.ndarray,
                 traffic: np.ndarray, room: np.ndarray) -> None:
        self.n, self.token_cost = n, token_cost
        open_ = room > 0
        self.open = bool(open_.any())
        self.by_load = wd >= rho * n
        if self.open:
            self.loads, self.traffics = projected_load[open_], traffic[open_]
            self.least_traffic = float(self.traffics.min())
        self.top, self.wd = float(projected_load.max()), wd

    def cannot_win(self, best: float, k: int) -> bool:
        if not self.open:
            return False
        ahead = self.token_cost * self.n * k / (k + 1)
        if self.by_load:
            low = float(_cost(self.loads, self.traffics + ahead).min())
        else:
            low = ahead + self.least_traffic
        return low - 1e-9 * (low + self.top + self.wd) >= best


def _cost(load: np.ndarray, traffic: np.ndarray) -> np.ndarray:
    """A rank's time in pairs: the staged plan overlaps receiving with computing, except for
    about ``_EXPOSED`` of the smaller of the two (the first stage's transfer, uneven stages)."""
    return np.maximum(load, traffic) + _EXPOSED * np.minimum(load, traffic)


def kv_token_cost(rates: CostRates) -> float:
    """``balanced_layout``'s ``token_cost`` from a plan's ``CostRates``: the seconds of moving one
    token's kv (forward kv, backward kv and dkv back, at the link's rate) over the seconds of one
    (q, k) pair of attention, forward and backward."""
    return (2 * rates.kv + rates.dkv) / rates.bw / (rates.sec_fwd + rates.sec_bwd)


def balanced_layout(batch: Batch, inter_size: int, intra_size: int, token_cost: float = 0.0, window: int = -1,
                    node: tuple[int, ...] = (), local_token_cost: float | None = None) -> Layout:
    """Document-aware layout of ``batch`` over ``inter_size`` ranks (see the module docstring).

    ``token_cost``: the time of moving one token's kv (forward and backward) in units of the time
    of one (q, k) pair of attention (0: balance work only). A few greedy variants (split only
    what exceeds a rank's tokens, split by work, split by density, or choose each split; LPT or
    projected placement) each take a few milliseconds; the one with the lowest busiest-rank cost
    is kept (within 0.5%: fewer pieces, i.e. less traffic); a variant stops as soon as one of its
    ranks costs more than 1.005 × the cheapest finished one (it could not be kept: the same
    layout, ~7× less layout time at 1,024 GPUs). Under a sliding ``window`` every work
    count is the banded one (a windowed document's work grows linearly with its length)."""
    if inter_size == 1:
        # one rank holds every token: whatever the assignment, sorted and merged below it is the
        # one segment [0, T') (plan.py then builds one plan for both layouts)
        return replace(contiguous_layout(batch, 1, intra_size), name="balanced")
    size = inter_size
    chunk = batch.padded_tokens // size
    nodes = NodePrices.of(node, local_token_cost, token_cost)
    starts = batch.doc_starts
    lengths = np.diff(starts)
    work = batch.doc_work(window).astype(float)
    tau = float(work.sum()) / size
    must = np.clip(np.ceil(lengths / chunk), 1, size).astype(np.int64)
    plain = np.clip(np.maximum(np.ceil(work / tau) if tau else 1, must), 1, size).astype(np.int64)
    dense = _split_counts(lengths, work, size, chunk) if size > 1 else plain
    splits: list[np.ndarray | None] = [must]
    for k_of in (plain, dense):
        if not any(np.array_equal(k_of, x) for x in splits if x is not None):
            splits.append(k_of)
    variants = []
    # (the projected placement pays mostly with per-document splits: 5 variants, not 8)
    candidates = [*((k, False) for k in splits), (None, False), (None, True)]
    # A variant whose busiest rank already costs more than ``_KEEP_WITHIN`` × the cheapest one
    # finished so far can be neither the cheapest nor within ``_KEEP_WITHIN`` of it (its costs
    # only grow: piece work and traffic are ≥ 0 and float addition is monotone), so its assignment
    # stops there — the kept variant is the same as with every one finished. The order they run
    # in changes nothing else (the choice below reads them in ``candidates`` order): the per-document
    # LPT variant first (the cheapest finished one in 4 of the 5 fineweb 1M / P_inter 64 budget
    # batches, so its bar abandons the others earliest: 1.72 -> 1.63 G instructions per compile
    # there, 64K / P_inter 8 +0.3%), then the fixed splits from the most split to ``must``, then
    # the projected per-document variant.
    run_order = [len(splits), *reversed(range(len(splits))), len(splits) + 1]
    for i in run_order:
        k_of, projected = candidates[i]
        bar = min(v[1] for v in variants) * _KEEP_WITHIN if variants and token_cost >= 0 else float("inf")
        try:
            held, cost = _assign(starts, lengths, work, k_of, size, chunk, projected, token_cost, window, bar, nodes)
        except _Abandoned:
            continue
        variants.append((i, float(cost.max()), sum(map(len, held)), held))
    variants.sort(key=lambda v: v[0])
    low = min(v[1] for v in variants)
    held = min((v for v in variants if v[1] <= low * _KEEP_WITHIN), key=lambda v: (v[2], v[1]))[3]
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
            segs.append(_new_segment(_new_range(a, b), row))  # Segment(TokenRange(a, b), row)
            row += b - a
        segments.append(tuple(segs))
    return Layout(name="balanced", segments=tuple(segments), chunk_tokens=chunk, intra_size=intra_size)


_PS_PER_S = 10**12  # kept_layout compares estimates in integer picoseconds


def _ps(seconds: float) -> int:
    """An estimate in whole picoseconds (fixed units: equal for floats a few ulps apart)."""
    return round(float(seconds) * _PS_PER_S)


def kept_layout(contiguous_s: float, balanced_s: float | None, compute_bound_s: float) -> str:
    """The layout ``layout="balanced"`` (with its fallback) ships, from the two plans' estimated
    times: contiguous when it is within 1% of the compute bound (the balanced plan is then not even
    compiled: pass ``balanced_s=None``) or estimated faster; balanced otherwise (ties: balanced).

    Every rank compiles its own plan, so this choice must come out the same on every node
    (issue 16): the estimates are rounded to integer picoseconds and compared as integers
    (``100·c ≤ 101·bound``, ``b ≤ c``), so estimates that differ in the last bits (another BLAS,
    FMA contraction, summation order) give the same layout. Only an estimate within rounding noise
    of a half-picosecond edge could still round apart; the plan hash covers the layout
    (``plan/fingerprint.py``), so such ranks are stopped by the pre-round handshake with a
    ``RuntimeMismatchError`` before any payload moves, never run on different layouts."""
    c = _ps(contiguous_s)
    if 100 * c <= (100 + _LAYOUT_GAIN_PERCENT) * _ps(compute_bound_s):
        return "contiguous"
    if balanced_s is None:
        return "balanced"  # undecided until the balanced plan is compiled
    return "balanced" if _ps(balanced_s) <= c else "contiguous"

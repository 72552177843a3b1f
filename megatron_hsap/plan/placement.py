"""Placement (DESIGN §2.1 step 2): which rank computes which rows of each block.

The exact work of a block is its count of unmasked (q, k) pairs. A rank's load is its work plus
its bytes sent and received per phase; the target is ``tau = total work / P``. Two kinds of move
shed work from a rank above ``tau`` to one below it:

* **cross block** (q owner ≠ kv owner): its tail q rows ``[m, q.stop)`` run on the kv owner, which
  receives those q rows and returns o/lse (dq in backward) — the DistFlashAttn trick; the head rows
  ``[q.start, m)`` stay with the q owner, which fetches the kv slice (and returns dkv). Moving rows
  back (raising ``m``) is the same move the other way, so min-traffic starts can be balanced too;
* **local block** (both owners equal: each document piece's diagonal): a *band* of tail rows
  ``[x, y)`` runs on a helper rank, which receives those q rows and the kv rows they see (a tail
  band of a causal block is the heaviest work per byte; a whole short document is one band).

Donors are visited from the most loaded; each sheds its excess through the cheapest moves first
(bytes per pair moved), into the ranks with the most spare work, while no rank's traffic per phase
exceeds ``traffic_budget`` × its share of compute time (traffic beyond that could not hide behind
compute). Each move is priced in O(1), so a placement costs O(units · log units).

``compile_plan`` stages several placements (owner-computes, min-traffic and balanced ones with
different budgets) and keeps the lowest *estimated time* (DESIGN §4): never worse than leaving
every block with its q owner.
"""

from __future__ import annotations

import math
import heapq
from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware
from megatron_hsap.plan.ir import TokenRange, Unit, Wire
from megatron_hsap.plan.units import WorkUnit, causal_work

__all__ = ["Prices", "Placement", "owner_computes", "min_traffic", "region_distflash", "balance", "rows_for_work"]

# per-rank traffic vector: bytes sent / received, forward and backward
SF, RF, SB, RB = range(4)


@dataclass(frozen=True, slots=True)
class Prices:
    """Per-token bytes of each wire, seconds per (q, k) pair and the link bandwidth."""

    q: float
    kv: float
    o_lse: float
    q_bwd: float  # q + do + lse + delta: what travels with q rows in backward
    dq: float
    dkv: float
    sec_fwd: float
    sec_bwd: float
    bw: float

    @classmethod
    def of(cls, shape: HeadShape, hw: Hardware, bw: float) -> "Prices":
        b = shape.token_bytes
        return cls(
            q=b(Wire.Q),
            kv=b(Wire.KV),
            o_lse=b(Wire.O) + b(Wire.LSE),
            q_bwd=b(Wire.Q) + b(Wire.DO) + b(Wire.LSE) + b(Wire.DELTA),
            dq=b(Wire.DQ),
            dkv=b(Wire.DKV),
            sec_fwd=shape.fwd_flops_per_pair / hw.attn_fwd_flops,
            sec_bwd=shape.bwd_flops_per_pair / hw.attn_bwd_flops,
            bw=bw,
        )

    @property
    def sec(self) -> float:
        """Seconds per pair, forward + backward."""
        return self.sec_fwd + self.sec_bwd

    @property
    def q_total(self) -> float:
        """Bytes per q row computed away from its owner, both phases, one direction each."""
        return self.q + self.o_lse + self.q_bwd + self.dq

    @property
    def kv_total(self) -> float:
        """Bytes per kv row fetched by another rank, both phases (kv twice, dkv back)."""
        return 2 * self.kv + self.dkv

    def q_side(self, n: float) -> Vec:
        """Traffic of the *owner* of ``n`` q rows computed elsewhere: (SF, RF, SB, RB)."""
        return (n * self.q, n * self.o_lse, n * self.q_bwd, n * self.dq)

    def kv_side(self, n: float) -> Vec:
        """Traffic of the *owner* of ``n`` kv rows used elsewhere: (SF, RF, SB, RB)."""
        return (n * self.kv, 0.0, n * self.kv, n * self.dkv)


Vec = tuple[float, float, float, float]


def _mirror(v: Vec) -> Vec:
    """The peer's view of a traffic vector: sent ↔ received."""
    return (v[1], v[0], v[3], v[2])


def _plus(a: Vec, b: Vec) -> Vec:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def _minus(a: Vec, b: Vec) -> Vec:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3])


def rows_for_work(q: TokenRange, kv_start: int, causal: bool, nk: int, work: float) -> int:
    """Largest ``n`` such that the first ``n`` rows of a block (causal: rows attend keys from
    ``kv_start``; rectangle: ``nk`` keys each) hold at most ``work`` pairs; closed form."""
    if work <= 0:
        return 0
    if not math.isfinite(work):
        return len(q)
    if not causal:
        return min(len(q), int(work // nk))
    first = q.start - kv_start + 1  # keys seen by the first row
    b = 2 * first - 1
    n = (math.isqrt(int(b * b + 8 * work)) - b) // 2
    while n > 0 and n * first + n * (n - 1) // 2 > work:
        n -= 1
    return min(len(q), max(0, n))


def tail_rows_for_work(q: TokenRange, kv_start: int, causal: bool, nk: int, work: float) -> int:
    """Smallest row ``x`` such that rows ``[x, q.stop)`` hold at least ``work`` pairs."""
    total = causal_work(q, TokenRange(kv_start, q.stop) if causal else TokenRange(0, nk), causal)
    if work >= total:
        return q.start
    head = rows_for_work(q, kv_start, causal, nk, total - work)
    return q.start + head


@dataclass(slots=True)
class Placement:
    """Mutable state of one placement.

    ``cut[i]`` (cross blocks): rows ``[q.start, cut)`` run on the q owner, the rest on the kv owner.
    ``home[i]`` / ``bands[i]`` (local blocks): rows ``[q.start, home)`` stay, bands
    ``(x, y, helper)`` (descending, tiling ``[home, q.stop)``) run on helpers.
    """

    name: str
    units: list[WorkUnit]
    pr: Prices
    size: int
    work: list[float]  # [P] pairs
    traffic: list[Vec]  # [P] bytes (SF, RF, SB, RB)
    cut: list[int]
    home: list[int]
    bands: list[list[tuple[int, int, int]]]
    base: list[Unit]  # every block whole on its q owner (shared by copies: placed() reuses them)

    def copy(self, name: str) -> "Placement":
        return Placement(name, self.units, self.pr, self.size, list(self.work), list(self.traffic), list(self.cut),
                         list(self.home), [list(b) for b in self.bands], self.base)

    # ------------------------------------------------------------------ pricing of one block
    def cross_state(self, i: int, m: int) -> tuple[float, float, Vec]:
        """(q-owner work, kv-owner work, q-owner traffic) of cross block ``i`` cut at ``m``."""
        u = self.units[i]
        nk = u.kv.stop - u.kv.start
        moved = u.q.stop - m
        t = self.pr.q_side(moved)
        if m > u.q.start:  # the q owner fetches the kv slice
            t = _plus(t, _mirror(self.pr.kv_side(nk)))
        return float((m - u.q.start) * nk), float(moved * nk), t

    def band_state(self, i: int, x: int, y: int) -> tuple[float, Vec]:
        """(work, owner traffic) of rows ``[x, y)`` of local block ``i`` run on a helper."""
        u = self.units[i]
        if u.causal:
            n, first = y - x, x - u.kv.start + 1
            w = n * first + n * (n - 1) // 2
            nkv = y - u.kv.start
        else:
            nkv = u.kv.stop - u.kv.start
            w = (y - x) * nkv
        return float(w), _plus(self.pr.q_side(y - x), self.pr.kv_side(nkv))

    # ------------------------------------------------------------------ moves
    def set_cut(self, i: int, m: int) -> None:
        u = self.units[i]
        a, c = u.q_owner, u.kv_owner
        wa0, wc0, t0 = self.cross_state(i, self.cut[i])
        wa1, wc1, t1 = self.cross_state(i, m)
        self.work[a] += wa1 - wa0
        self.work[c] += wc1 - wc0
        d = _minus(t1, t0)
        self.traffic[a] = _plus(self.traffic[a], d)
        self.traffic[c] = _plus(self.traffic[c], _mirror(d))
        self.cut[i] = m

    def add_band(self, i: int, x: int, helper: int) -> None:
        """Move rows ``[x, home)`` of local block ``i`` to ``helper`` (merging with an adjacent
        band on the same helper so its kv is sent once)."""
        u = self.units[i]
        y = self.home[i]
        bands = self.bands[i]
        a = u.q_owner
        if bands and bands[-1][2] == helper and bands[-1][0] == y:
            old_x, old_y, _ = bands.pop()
            w0, t0 = self.band_state(i, old_x, old_y)
            self.work[a] += w0
            self.work[helper] -= w0
            self.traffic[a] = _minus(self.traffic[a], t0)
            self.traffic[helper] = _minus(self.traffic[helper], _mirror(t0))
            y = old_y
        w, t = self.band_state(i, x, y)
        self.work[a] -= w
        self.work[helper] += w
        self.traffic[a] = _plus(self.traffic[a], t)
        self.traffic[helper] = _plus(self.traffic[helper], _mirror(t))
        bands.append((x, y, helper))
        self.home[i] = x

    # ------------------------------------------------------------------ result
    def placed(self) -> list[Unit]:
        """Placed blocks. A causal band ``[x, y)`` with ``x`` past the block start becomes a
        rectangle (rows × keys before ``x``) and a causal block, so its kv can be split later."""
        out: list[Unit] = []
        base = self.base
        for i, u in enumerate(self.units):
            a, c = u.q_owner, u.kv_owner
            if self.cut[i] == u.q.stop and self.home[i] == u.q.stop:
                out.append(base[i])  # untouched: whole on its q owner
                continue
            if a != c:
                m = self.cut[i]
                if m > u.q.start:
                    out.append(Unit(u.doc, TokenRange(u.q.start, m), u.kv, False, a, c, a))
                if m < u.q.stop:
                    out.append(Unit(u.doc, TokenRange(m, u.q.stop), u.kv, False, a, c, c))
                continue
            h = self.home[i]
            if h > u.q.start:
                kv = TokenRange(u.kv.start, h) if u.causal else u.kv
                out.append(Unit(u.doc, TokenRange(u.q.start, h), kv, u.causal, a, a, a))
            for x, y, helper in self.bands[i]:
                if not u.causal:
                    out.append(Unit(u.doc, TokenRange(x, y), u.kv, False, a, a, helper))
                    continue
                if x > u.kv.start:
                    out.append(Unit(u.doc, TokenRange(x, y), TokenRange(u.kv.start, x), False, a, a, helper))
                out.append(Unit(u.doc, TokenRange(x, y), TokenRange(x, y), True, a, a, helper))
        return out

    def surrogate(self) -> float:
        """max over ranks of Σ_phase max(compute, max(sent, received) / bw): a lower bound of the
        staged estimate without latency."""
        pr = self.pr
        t = np.asarray(self.traffic, dtype=float).reshape(self.size, 4)
        w = np.asarray(self.work, dtype=float)
        f = np.maximum(w * pr.sec_fwd, np.maximum(t[:, SF], t[:, RF]) / pr.bw)
        b = np.maximum(w * pr.sec_bwd, np.maximum(t[:, SB], t[:, RB]) / pr.bw)
        return float((f + b).max())


def _empty(name: str, units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None) -> Placement:
    n = len(units)
    if base is None:
        base = [Unit(u.doc, u.q, u.kv, u.causal, u.q_owner, u.kv_owner, u.q_owner) for u in units]
    return Placement(name, units, pr, size, [0.0] * size, [(0.0, 0.0, 0.0, 0.0)] * size, [u.q.stop for u in units],
                     [u.q.stop for u in units], [[] for _ in range(n)], base)


def _start(name: str, units: list[WorkUnit], size: int, pr: Prices, at_kv_owner: list[bool], base: list[Unit] | None) -> Placement:
    pl = _empty(name, units, size, pr, base)
    work = [0.0] * size
    traffic: list[Vec] = [(0.0, 0.0, 0.0, 0.0)] * size
    for i, u in enumerate(units):
        if u.q_owner == u.kv_owner:
            pl.home[i] = u.q.stop
            work[u.q_owner] += u.work
            continue
        m = u.q.start if at_kv_owner[i] else u.q.stop
        pl.cut[i] = m
        wa, wc, t = pl.cross_state(i, m)
        work[u.q_owner] += wa
        work[u.kv_owner] += wc
        traffic[u.q_owner] = _plus(traffic[u.q_owner], t)
        traffic[u.kv_owner] = _plus(traffic[u.kv_owner], _mirror(t))
    pl.work, pl.traffic = work, traffic
    return pl


def owner_computes(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """Every block on its q owner: the reference the planner must never lose to. (``base``, in
    all three starts: the blocks as ``Unit``s on their q owners, shared to save allocations.)"""
    return _start("owner-computes", units, size, pr, [False] * len(units), base)


def region_distflash(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """DistFlashAttn inside every document's region (the paper's step 2): a document spanning
    ``n`` chunks puts its cross block ``(i, j)`` on the kv owner when ``i − j > n/2`` and on the q
    owner when ``i − j < n/2``; at exactly ``n/2`` the tail half of the rows goes to the kv owner.
    For one document over all ranks this is DistFlashAttn's balanced schedule."""
    pl = _start("region-distflash", units, size, pr, [False] * len(units), base)
    span: dict[int, tuple[int, int]] = {}
    for u in units:
        lo, hi = span.get(u.doc, (u.q_owner, u.q_owner))
        span[u.doc] = (min(lo, u.kv_owner, u.q_owner), max(hi, u.kv_owner, u.q_owner))
    for i, u in enumerate(units):
        if u.q_owner == u.kv_owner:
            continue
        lo, hi = span[u.doc]
        n = hi - lo + 1
        dist = 2 * abs(u.q_owner - u.kv_owner)
        if dist > n:
            pl.set_cut(i, u.q.start)
        elif dist == n:
            pl.set_cut(i, (u.q.start + u.q.stop) // 2)
    return pl


def min_traffic(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """Every cross block on whichever owner moves fewer bytes (both phases)."""
    flags = [u.q_owner != u.kv_owner and len(u.q) * pr.q_total < len(u.kv) * pr.kv_total for u in units]
    return _start("min-traffic", units, size, pr, flags, base)


_MIN_BAND_ROWS = 8  # a band thinner than this moves too little work for its kv


def balance(start: Placement, *, traffic_budget: float, allow_helpers: bool = True, tol: float = 0.005,
            name: str | None = None) -> Placement:
    """Shed work from ranks above ``tau = total / P`` (see the module docstring).

    ``traffic_budget``: a rank's bytes per phase may grow only up to this fraction of what its
    link moves in ``tau``'s compute time of that phase (1.0: traffic as long as compute)."""
    pl = start.copy(name or f"{start.name}+balanced")
    pr, size, units = pl.pr, pl.size, pl.units
    if size == 1:
        return pl
    tau = float(sum(pl.work)) / size
    if tau <= 0:
        return pl
    cap = (tau * pr.sec_fwd * pr.bw * traffic_budget, tau * pr.sec_bwd * pr.bw * traffic_budget)
    cross_of: list[list[int]] = [[] for _ in range(size)]
    local_of: list[list[int]] = [[] for _ in range(size)]
    for i, u in enumerate(units):
        if u.q_owner != u.kv_owner:
            cross_of[u.q_owner].append(i)
            cross_of[u.kv_owner].append(i)
        else:
            local_of[u.q_owner].append(i)

    def ok(rank: int, d: Vec) -> bool:
        """Traffic of ``rank`` after adding ``d`` stays within the cap (or does not grow)."""
        t = pl.traffic[rank]
        for s_, r_, c in ((0, 1, cap[0]), (2, 3, cap[1])):
            after = max(t[s_] + d[s_], t[r_] + d[r_])
            if after > c and after > max(t[s_], t[r_]) + 1.0:
                return False
        return True

    order = sorted(range(size), key=lambda r: -pl.work[r])
    for b in order:
        if pl.work[b] <= tau * (1 + tol):
            continue
        cands: list[tuple[float, int, int]] = []  # (bytes per pair, kind, block)
        for i in cross_of[b]:
            u = units[i]
            nk, nq = u.kv.stop - u.kv.start, u.q.stop - u.q.start
            if b == u.q_owner and pl.cut[i] > u.q.start:
                cands.append((pr.q_total / nk, 0, i))
            elif b == u.kv_owner and pl.cut[i] < u.q.stop:
                # rows back to the q owner: it then fetches the kv slice, the rows stop travelling
                cands.append((max(nk * pr.kv_total - nq * pr.q_total, 0.0) / (nq * nk) + 1e-12, 0, i))
        if allow_helpers:
            for i in local_of[b]:
                u = units[i]
                h = pl.home[i]
                if h <= u.q.start:
                    continue
                w, t = pl.band_state(i, u.q.start, h)
                if w > 0:
                    cands.append(((t[0] + t[1] + t[2] + t[3]) / w, 1, i))
        cands.sort()
        receivers = _Receivers(pl, tau, b)
        for _, kind, i in cands:
            if pl.work[b] - tau <= tau * tol:
                break
            if kind == 0:
                _shed_cross(pl, i, b, tau, ok)
            elif not ok(b, pr.q_side(_MIN_BAND_ROWS)):
                break  # the donor's link is full
            else:
                _shed_local(pl, i, b, tau, ok, receivers)
    return pl


def _shed_cross(pl: Placement, i: int, b: int, tau: float, ok) -> None:
    """Move rows of cross block ``i`` from ``b`` to its other owner, up to both limits."""
    u = pl.units[i]
    nk = u.kv.stop - u.kv.start
    other = u.kv_owner if b == u.q_owner else u.q_owner
    amount = min(pl.work[b] - tau, tau - pl.work[other])
    if amount <= 0:
        return
    rows = max(1, int(round(amount / nk)))
    m0 = pl.cut[i]
    m = max(u.q.start, m0 - rows) if b == u.q_owner else min(u.q.stop, m0 + rows)
    if m == m0:
        return
    _, _, t0 = pl.cross_state(i, m0)
    _, _, t1 = pl.cross_state(i, m)
    d = _minus(t1, t0)  # the q owner's change; the kv owner's is its mirror
    if ok(u.q_owner, d) and ok(u.kv_owner, _mirror(d)):
        pl.set_cut(i, m)


_RECEIVER_TRIES = 2  # receivers whose link is full, tried per block before giving it up


class _Receivers:
    """Ranks below ``tau`` by spare work (a min-heap of work with lazy updates)."""

    def __init__(self, pl: Placement, tau: float, donor: int) -> None:
        self.pl, self.tau = pl, tau
        self.heap = [(pl.work[r], r) for r in range(pl.size) if r != donor and pl.work[r] < tau]
        heapq.heapify(self.heap)

    def best(self, excluded: set[int]) -> int:
        """The rank with the most spare work, not in ``excluded`` (-1 if none)."""
        aside = []
        found = -1
        work = self.pl.work
        while self.heap:
            w, r = self.heap[0]
            if w != work[r]:  # stale: its work changed since it was pushed
                heapq.heapreplace(self.heap, (work[r], r))
                continue
            if w >= self.tau:
                break
            if r in excluded:
                aside.append(heapq.heappop(self.heap))
                continue
            found = r
            break
        for item in aside:
            heapq.heappush(self.heap, item)
        return found


def _shed_local(pl: Placement, i: int, b: int, tau: float, ok, receivers: _Receivers) -> None:
    """Move tail bands of local block ``i`` to the ranks with the most spare work; a receiver
    whose link is full is skipped, and after ``_RECEIVER_TRIES`` such the block is given up."""
    u = pl.units[i]
    nk = u.kv.stop - u.kv.start
    work = pl.work
    excluded: set[int] = set()
    while pl.home[i] > u.q.start and len(excluded) < _RECEIVER_TRIES:
        excess = work[b] - tau
        if excess <= 0:
            return
        h = receivers.best(excluded)
        if h < 0:
            return
        spare = tau - work[h]
        y = pl.home[i]
        x = tail_rows_for_work(TokenRange(u.q.start, y), u.kv.start, u.causal, nk, min(excess, spare))
        if y - x < _MIN_BAND_ROWS and x > u.q.start:
            x = max(u.q.start, y - _MIN_BAND_ROWS)
        w, t = pl.band_state(i, x, y)
        while w > spare * 1.05 + 1 and x < y - 1:
            x += max(1, (y - x) // 16)  # too much for the receiver: a thinner band
            w, t = pl.band_state(i, x, y)
        if w <= 0:
            return
        if not ok(b, t):
            return  # the donor's link is full: no receiver helps
        if not ok(h, _mirror(t)):
            excluded.add(h)
            continue
        pl.add_band(i, x, h)

"""Placement (DESIGN §2.1 step 2): which rank computes which q rows of each block.

The exact work of a block is its count of unmasked (q, k) pairs. Every block keeps a *head*
``[q.start, home)`` on its q owner and hands *bands* of rows ``[x, y)`` (tiling ``[home, q.stop)``)
to other ranks. A band on the kv owner needs only those q rows (and returns o/lse, dq): the
DistFlashAttn trick; a band on any other rank also needs the kv rows it sees (the whole kv slice
of a cross block, the key prefix ``[start, y)`` of a diagonal block). A head on the q owner of a
cross block needs the kv slice. The tail rows of a causal block see the most keys: a tail band is
the most work per byte moved, and a whole short document is one band.

A rank's load is its work plus its bytes sent and received per phase; the target is ``tau =
total work / P``. Donors (ranks above ``tau``) are visited from the most loaded; each sheds its
excess through the cheapest moves first (bytes per pair moved): head rows to the kv owner or to
any rank, rows of a band it holds back to the q owner or on to any rank — into the ranks with the
most spare work, while no rank's traffic per phase exceeds ``traffic_budget`` × the time ``tau``
takes to compute in that phase (traffic beyond that could not hide behind compute).

``compile_plan`` stages several placements (owner-computes, min-traffic, DistFlashAttn per
document region, and balanced ones with different budgets) and keeps the lowest *estimated time*
(DESIGN §4): never worse than leaving every block with its q owner.
"""

from __future__ import annotations

import heapq
import math
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


Band = tuple[int, int, int]  # (x, y, rank computing rows [x, y))


@dataclass(slots=True)
class Placement:
    """Mutable state of one placement: ``home[i]`` and ``bands[i]`` (descending, tiling
    ``[home, q.stop)``) per block, and the per-rank work and traffic they add up to."""

    name: str
    units: list[WorkUnit]
    pr: Prices
    size: int
    work: list[float]  # [P] pairs
    traffic: list[Vec]  # [P] bytes (SF, RF, SB, RB)
    home: list[int]
    bands: list[list[Band]]
    base: list[Unit]  # every block whole on its q owner (shared by copies: placed() reuses them)

    def copy(self, name: str) -> "Placement":
        return Placement(name, self.units, self.pr, self.size, list(self.work), list(self.traffic), list(self.home),
                         [list(b) for b in self.bands], self.base)

    # ------------------------------------------------------------------ one block's share
    def rows_work(self, i: int, x: int, y: int) -> float:
        """Pairs of rows ``[x, y)`` of block ``i``."""
        u = self.units[i]
        if y <= x:
            return 0.0
        if u.causal:
            n, first = y - x, x - u.kv.start + 1
            return float(n * first + n * (n - 1) // 2)
        return float((y - x) * (u.kv.stop - u.kv.start))

    def contrib(self, i: int, home: int | None = None, bands: list[Band] | None = None) -> list[tuple[int, float, Vec]]:
        """(rank, work, traffic) terms of block ``i`` (optionally for a hypothetical state)."""
        u = self.units[i]
        pr = self.pr
        home = self.home[i] if home is None else home
        bands = self.bands[i] if bands is None else bands
        a, c = u.q_owner, u.kv_owner
        nk = u.kv.stop - u.kv.start
        out: list[tuple[int, float, Vec]] = []
        if home > u.q.start:
            out.append((a, self.rows_work(i, u.q.start, home), _ZERO))
            if c != a:  # the head fetches the kv slice
                kv = pr.kv_side(nk)
                out.append((c, 0.0, kv))
                out.append((a, 0.0, _mirror(kv)))
        for x, y, h in bands:
            out.append((h, self.rows_work(i, x, y), _ZERO))
            if h != a:
                q = pr.q_side(y - x)
                out.append((a, 0.0, q))
                out.append((h, 0.0, _mirror(q)))
            if h != c:
                kv = pr.kv_side((y - u.kv.start) if u.causal else nk)
                out.append((c, 0.0, kv))
                out.append((h, 0.0, _mirror(kv)))
        return out

    def _add(self, terms: list[tuple[int, float, Vec]], sign: float) -> None:
        for r, w, t in terms:
            if w:
                self.work[r] += sign * w
            if t is not _ZERO:
                self.traffic[r] = _plus(self.traffic[r], t) if sign > 0 else _minus(self.traffic[r], t)

    def set_rows(self, i: int, home: int, bands: list[Band]) -> None:
        """Replace block ``i``'s head and bands (normalised: neighbours on one rank merged)."""
        home, bands = _normalise(self.units[i], home, bands)
        self._add(self.contrib(i), -1.0)
        self.home[i], self.bands[i] = home, bands
        self._add(self.contrib(i), 1.0)

    def delta(self, i: int, home: int, bands: list[Band]) -> dict[int, tuple[float, Vec]]:
        """Per-rank (work, traffic) change if block ``i`` had ``home`` and ``bands``."""
        home, bands = _normalise(self.units[i], home, bands)
        out: dict[int, list] = {}
        for sign, terms in ((-1.0, self.contrib(i)), (1.0, self.contrib(i, home, bands))):
            for r, w, t in terms:
                cur = out.setdefault(r, [0.0, _ZERO])
                cur[0] += sign * w
                cur[1] = _plus(cur[1], t) if sign > 0 else _minus(cur[1], t)
        return {r: (v[0], v[1]) for r, v in out.items()}

    # ------------------------------------------------------------------ result
    def placed(self) -> list[Unit]:
        """Placed blocks. A causal band ``[x, y)`` past the block's first row becomes a rectangle
        (rows × keys before ``x``) and a causal block, so staging may split its kv."""
        out: list[Unit] = []
        base = self.base
        for i, u in enumerate(self.units):
            if self.home[i] == u.q.stop:
                out.append(base[i])  # untouched: whole on its q owner
                continue
            a, c = u.q_owner, u.kv_owner
            h0 = self.home[i]
            if h0 > u.q.start:
                kv = TokenRange(u.kv.start, h0) if u.causal else u.kv
                out.append(Unit(u.doc, TokenRange(u.q.start, h0), kv, u.causal, a, c, a))
            for x, y, h in self.bands[i]:
                if not u.causal:
                    out.append(Unit(u.doc, TokenRange(x, y), u.kv, False, a, c, h))
                    continue
                if x > u.kv.start:
                    out.append(Unit(u.doc, TokenRange(x, y), TokenRange(u.kv.start, x), False, a, c, h))
                out.append(Unit(u.doc, TokenRange(x, y), TokenRange(x, y), True, a, c, h))
        return out

    def surrogate(self) -> float:
        """max over ranks of Σ_phase max(compute, max(sent, received) / bw): a lower bound of the
        staged estimate (staging adds latency and can only add traffic)."""
        pr = self.pr
        t = np.asarray(self.traffic, dtype=float).reshape(self.size, 4)
        w = np.asarray(self.work, dtype=float)
        f = np.maximum(w * pr.sec_fwd, np.maximum(t[:, SF], t[:, RF]) / pr.bw)
        b = np.maximum(w * pr.sec_bwd, np.maximum(t[:, SB], t[:, RB]) / pr.bw)
        return float((f + b).max())


_ZERO: Vec = (0.0, 0.0, 0.0, 0.0)


def _normalise(u: WorkUnit, home: int, bands: list[Band]) -> tuple[int, list[Band]]:
    """Drop empty bands, merge neighbours on one rank, fold bands on the q owner next to the
    head into it."""
    out: list[Band] = []
    for x, y, h in bands:
        if y <= x:
            continue
        if out and out[-1][2] == h and out[-1][0] == y:
            out[-1] = (x, out[-1][1], h)
        else:
            out.append((x, y, h))
    while out and out[-1][2] == u.q_owner and out[-1][0] == home:
        home = out.pop()[1]
    return home, out


def _empty(name: str, units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None) -> Placement:
    if base is None:
        base = [Unit(u.doc, u.q, u.kv, u.causal, u.q_owner, u.kv_owner, u.q_owner) for u in units]
    work = [0.0] * size
    for u in units:
        work[u.q_owner] += u.work
    traffic: list[Vec] = [_ZERO] * size
    pl = Placement(name, units, pr, size, work, traffic, [u.q.stop for u in units], [[] for _ in units], base)
    for i, u in enumerate(units):
        if u.q_owner != u.kv_owner:  # the q owner fetches the kv slice
            kv = pr.kv_side(u.kv.stop - u.kv.start)
            pl.traffic[u.kv_owner] = _plus(pl.traffic[u.kv_owner], kv)
            pl.traffic[u.q_owner] = _plus(pl.traffic[u.q_owner], _mirror(kv))
    return pl


def owner_computes(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """Every block on its q owner: the reference the planner must never lose to. (``base``, in
    all three starts: the blocks as ``Unit``s on their q owners, shared to save allocations.)"""
    return _empty("owner-computes", units, size, pr, base)


def min_traffic(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """Every cross block on whichever owner moves fewer bytes (both phases)."""
    pl = _empty("min-traffic", units, size, pr, base)
    for i, u in enumerate(units):
        if u.q_owner != u.kv_owner and len(u.q) * pr.q_total < len(u.kv) * pr.kv_total:
            pl.set_rows(i, u.q.start, [(u.q.start, u.q.stop, u.kv_owner)])
    return pl


def region_distflash(units: list[WorkUnit], size: int, pr: Prices, base: list[Unit] | None = None) -> Placement:
    """DistFlashAttn inside every document's region (the paper's step 2): a document spanning
    ``n`` chunks puts its cross block ``(i, j)`` on the kv owner when ``i − j > n/2`` and on the q
    owner when ``i − j < n/2``; at exactly ``n/2`` the tail half of the rows goes to the kv owner.
    For one document over all ranks this is DistFlashAttn's balanced schedule."""
    pl = _empty("region-distflash", units, size, pr, base)
    span: dict[int, tuple[int, int]] = {}
    for u in units:
        lo, hi = span.get(u.doc, (u.q_owner, u.q_owner))
        span[u.doc] = (min(lo, u.kv_owner, u.q_owner), max(hi, u.kv_owner, u.q_owner))
    for i, u in enumerate(units):
        if u.q_owner == u.kv_owner:
            continue
        lo, hi = span[u.doc]
        dist = 2 * abs(u.q_owner - u.kv_owner)
        n = hi - lo + 1
        if dist > n:
            pl.set_rows(i, u.q.start, [(u.q.start, u.q.stop, u.kv_owner)])
        elif dist == n:
            mid = (u.q.start + u.q.stop) // 2
            pl.set_rows(i, mid, [(mid, u.q.stop, u.kv_owner)])
    return pl


_MIN_BAND_ROWS = 8  # a band thinner than this moves too little work for its kv
_LOCAL_RESERVE = 0.05  # of tau: local work a donor keeps for its local-only end stages
_RECEIVER_TRIES = 2  # receivers whose link is full, tried per candidate before giving it up


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


def balance(start: Placement, *, traffic_budget: float, allow_helpers: bool = True, tol: float = 0.005,
            name: str | None = None) -> Placement:
    """Shed work from ranks above ``tau = total / P`` (see the module docstring).

    ``traffic_budget``: a rank's bytes per phase may grow only up to this fraction of what its
    link moves in ``tau``'s compute time of that phase (1.0: traffic as long as compute).
    ``allow_helpers=False`` restricts moves to a block's own q and kv owners."""
    pl = start.copy(name or f"{start.name}+balanced")
    pr, size, units = pl.pr, pl.size, pl.units
    if size == 1:
        return pl
    tau = float(sum(pl.work)) / size
    if tau <= 0:
        return pl
    cap = (tau * pr.sec_fwd * pr.bw * traffic_budget, tau * pr.sec_bwd * pr.bw * traffic_budget)
    touching: list[list[int]] = [[] for _ in range(size)]
    for i, u in enumerate(units):
        touching[u.q_owner].append(i)
        if u.kv_owner != u.q_owner:
            touching[u.kv_owner].append(i)
    for i, bands in enumerate(pl.bands):  # helpers of the start placement
        for _, _, h in bands:
            if h not in (units[i].q_owner, units[i].kv_owner):
                touching[h].append(i)

    def ok(changes: dict[int, tuple[float, Vec]]) -> bool:
        """No rank's traffic per phase grows beyond the cap."""
        for r, (_, d) in changes.items():
            t = pl.traffic[r]
            for s_, r_, c in ((0, 1, cap[0]), (2, 3, cap[1])):
                after = max(t[s_] + d[s_], t[r_] + d[r_])
                if after > c and after > max(t[s_], t[r_]) + 1.0:
                    return False
        return True

    # local work (heads of blocks whose q and kv are the rank's own) each rank keeps in reserve:
    # without some, a rank idles in the first and last stages, which only local blocks may fill
    local = [0.0] * size
    for i, u in enumerate(units):
        if u.q_owner == u.kv_owner:
            local[u.q_owner] += pl.rows_work(i, u.q.start, pl.home[i])
    reserve = [min(_LOCAL_RESERVE * tau, w) for w in local]
    order = sorted(range(size), key=lambda r: -pl.work[r])
    for b in order:
        if pl.work[b] <= tau * (1 + tol):
            continue
        cands = _candidates(pl, b, touching[b], tau, allow_helpers)
        receivers = _Receivers(pl, tau, b)
        for _, kind, i, j in cands:
            if pl.work[b] - tau <= tau * tol:
                break
            u = units[i]
            keep = 0.0
            if kind == _HEAD and u.q_owner == u.kv_owner:
                head = pl.rows_work(i, u.q.start, pl.home[i])
                keep = max(0.0, reserve[b] - (local[b] - head))  # of this head, what must stay
                if head - keep <= 0:
                    continue
                before = head
            _shed(pl, b, kind, i, j, tau, ok, receivers, touching, allow_helpers, keep, traffic_budget)
            if kind == _HEAD and u.q_owner == u.kv_owner:
                local[b] -= before - pl.rows_work(i, u.q.start, pl.home[i])
    return pl


# move kinds: rows of the head (kind 0) or of band j (kind 1) of a block, to another rank
_HEAD, _BAND = 0, 1


def _candidates(pl: Placement, b: int, blocks: list[int], tau: float, allow_helpers: bool) -> list[tuple[float, int, int, int]]:
    """(bytes per pair, kind, block, band index) of every way ``b`` can shed work, cheapest first.
    Prices assume the cheapest receiver (the kv owner for rows of a cross block)."""
    pr, units = pl.pr, pl.units
    excess = pl.work[b] - tau
    out = []
    for i in blocks:
        u = units[i]
        a, c = u.q_owner, u.kv_owner
        nk = u.kv.stop - u.kv.start
        if b == a and pl.home[i] > u.q.start:
            w = pl.rows_work(i, u.q.start, pl.home[i])
            if c != a:
                out.append((pr.q_total / nk, _HEAD, i, -1))
            elif allow_helpers and w > 0:
                amount = min(w, excess)
                x = tail_rows_for_work(TokenRange(u.q.start, pl.home[i]), u.kv.start, u.causal, nk, amount)
                moved = pl.rows_work(i, x, pl.home[i])
                nkv = (pl.home[i] - u.kv.start) if u.causal else nk
                if moved > 0:
                    out.append((((pl.home[i] - x) * pr.q_total + nkv * pr.kv_total) / moved, _HEAD, i, -1))
        for j, (x, y, h) in enumerate(pl.bands[i]):
            if h != b:
                continue
            w = pl.rows_work(i, x, y)
            if w <= 0:
                continue
            if j == len(pl.bands[i]) - 1 and b != a:
                # rows back to the q owner: they stop travelling; the head may start fetching kv
                fetch = nk * pr.kv_total if (c != a and pl.home[i] == u.q.start) else 0.0
                out.append((max(fetch - (y - x) * pr.q_total, 0.0) / w + 1e-12, _BAND, i, j))
            elif allow_helpers:
                out.append((pr.q_total / nk + (pr.kv_total * nk / w if b == c else 0.0), _BAND, i, j))
    out.sort()
    return out


def _shed(pl: Placement, b: int, kind: int, i: int, j: int, tau: float, ok, receivers: _Receivers,
          touching: list[list[int]], allow_helpers: bool, keep: float = 0.0, budget_ratio: float = 1.0) -> None:
    """Apply one candidate: move rows off ``b`` to the best receiver(s) that keep every link
    within its cap (and at least ``keep`` pairs of a head where it stays). A move whose bytes take
    the receiver longer than ``budget_ratio`` × the compute time it brings is refused."""
    u = pl.units[i]
    a, c = u.q_owner, u.kv_owner
    nk = u.kv.stop - u.kv.start
    excluded: set[int] = set()
    while len(excluded) < _RECEIVER_TRIES:
        excess = pl.work[b] - tau
        if excess <= 0:
            return
        if kind == _HEAD:
            lo, hi = u.q.start, pl.home[i]
            if keep > 0:
                excess = min(excess, pl.rows_work(i, lo, hi) - keep)
                if excess <= 0:
                    return
        else:
            if j >= len(pl.bands[i]) or pl.bands[i][j][2] != b:
                return  # the band changed under us (merged or moved)
            lo, hi = pl.bands[i][j][0], pl.bands[i][j][1]
        if hi <= lo:
            return
        # the receiver: the natural owner first (no extra traffic), else the most spare
        if kind == _HEAD and c != a and c not in excluded and pl.work[c] < tau:
            h = c
        elif kind == _BAND and j == len(pl.bands[i]) - 1 and b != a and a not in excluded and pl.work[a] < tau:
            h = a
        elif allow_helpers:
            h = receivers.best(excluded)
        else:
            return
        if h < 0:
            return
        spare = tau - pl.work[h]
        if spare <= 0:
            excluded.add(h)
            continue
        amount = min(excess, spare)
        back_home = kind == _BAND and h == a and j == len(pl.bands[i]) - 1
        if back_home:  # the band's head rows return next to the head
            n = rows_for_work(TokenRange(lo, hi), u.kv.start, u.causal, nk, amount)
            n = max(n, 1)
            m = lo + n
            new_home, new_bands = m, pl.bands[i][:j] + [(m, hi, b)]
        else:  # the tail rows [m, hi) go to h
            m = tail_rows_for_work(TokenRange(lo, hi), u.kv.start, u.causal, nk, amount)
            if hi - m < _MIN_BAND_ROWS and m > lo:
                m = max(lo, hi - _MIN_BAND_ROWS)
            while pl.rows_work(i, m, hi) > spare * 1.05 + 1 and m < hi - 1:
                m += max(1, (hi - m) // 16)  # too much for the receiver: a thinner band
            if kind == _HEAD:
                new_home, new_bands = m, pl.bands[i] + [(m, hi, h)]
            else:
                new_home = pl.home[i]
                new_bands = pl.bands[i][:j] + [(m, hi, h), (lo, m, b)] + pl.bands[i][j + 1:]
        changes = pl.delta(i, new_home, new_bands)
        moved_w, moved_t = changes.get(h, (0.0, _ZERO))
        pr = pl.pr
        xfer = (max(moved_t[0], moved_t[1]) + max(moved_t[2], moved_t[3])) / pr.bw
        if moved_w <= 0 or xfer > budget_ratio * moved_w * (pr.sec_fwd + pr.sec_bwd):
            excluded.add(h)  # the move's bytes would not hide behind the work it brings
            continue
        if not ok(changes):
            # the donor's own link full: no receiver helps; else try another receiver
            if any(r == b for r, (_, d) in changes.items() if not ok({r: (0.0, d)})):
                return
            excluded.add(h)
            continue
        pl.set_rows(i, new_home, new_bands)
        if h not in (a, c) and i not in touching[h]:
            touching[h].append(i)
        if kind == _BAND:
            return  # the band list changed shape: re-derive candidates next round

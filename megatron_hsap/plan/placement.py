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

import heapq
import math
from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware
from megatron_hsap.plan.ir import TokenRange, Unit, Wire
from megatron_hsap.plan.units import WorkUnit, causal_work

__all__ = ["Prices", "Placement", "owner_computes", "min_traffic", "balance", "rows_for_work"]

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

    def q_side(self, n: float) -> np.ndarray:
        """Traffic of the *owner* of ``n`` q rows computed elsewhere: (SF, RF, SB, RB)."""
        return np.array([n * self.q, n * self.o_lse, n * self.q_bwd, n * self.dq])

    def kv_side(self, n: float) -> np.ndarray:
        """Traffic of the *owner* of ``n`` kv rows used elsewhere: (SF, RF, SB, RB)."""
        return np.array([n * self.kv, 0.0, n * self.kv, n * self.dkv])


def _mirror(v: np.ndarray) -> np.ndarray:
    """The peer's view of a traffic vector: sent ↔ received."""
    return v[[RF, SF, RB, SB]]


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
    work: np.ndarray  # [P] pairs
    traffic: np.ndarray  # [P, 4] bytes (SF, RF, SB, RB)
    cut: list[int]
    home: list[int]
    bands: list[list[tuple[int, int, int]]]

    def copy(self, name: str) -> "Placement":
        return Placement(name, self.units, self.pr, self.size, self.work.copy(), self.traffic.copy(), list(self.cut),
                         list(self.home), [list(b) for b in self.bands])

    # ------------------------------------------------------------------ pricing of one block
    def cross_state(self, i: int, m: int) -> tuple[float, float, np.ndarray]:
        """(q-owner work, kv-owner work, q-owner traffic) of cross block ``i`` cut at ``m``."""
        u = self.units[i]
        nk = len(u.kv)
        moved = u.q.stop - m
        t = self.pr.q_side(moved)
        if m > u.q.start:  # the q owner fetches the kv slice
            t = t + _mirror(self.pr.kv_side(nk))
        return float((m - u.q.start) * nk), float(moved * nk), t

    def band_state(self, i: int, x: int, y: int) -> tuple[float, np.ndarray]:
        """(work, owner traffic) of rows ``[x, y)`` of local block ``i`` run on a helper."""
        u = self.units[i]
        if u.causal:
            w = causal_work(TokenRange(x, y), TokenRange(u.kv.start, y), True)
            nkv = y - u.kv.start
        else:
            w = (y - x) * len(u.kv)
            nkv = len(u.kv)
        return float(w), self.pr.q_side(y - x) + self.pr.kv_side(nkv)

    # ------------------------------------------------------------------ moves
    def set_cut(self, i: int, m: int) -> None:
        u = self.units[i]
        a, c = u.q_owner, u.kv_owner
        wa0, wc0, t0 = self.cross_state(i, self.cut[i])
        wa1, wc1, t1 = self.cross_state(i, m)
        self.work[a] += wa1 - wa0
        self.work[c] += wc1 - wc0
        self.traffic[a] += t1 - t0
        self.traffic[c] += _mirror(t1 - t0)
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
            self.traffic[a] -= t0
            self.traffic[helper] -= _mirror(t0)
            y = old_y
        w, t = self.band_state(i, x, y)
        self.work[a] -= w
        self.work[helper] += w
        self.traffic[a] += t
        self.traffic[helper] += _mirror(t)
        bands.append((x, y, helper))
        self.home[i] = x

    # ------------------------------------------------------------------ result
    def placed(self) -> list[Unit]:
        """Placed blocks. A causal band ``[x, y)`` with ``x`` past the block start becomes a
        rectangle (rows × keys before ``x``) and a causal block, so its kv can be split later."""
        out: list[Unit] = []
        for i, u in enumerate(self.units):
            a, c = u.q_owner, u.kv_owner
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
        t = self.traffic
        f = np.maximum(self.work * pr.sec_fwd, np.maximum(t[:, SF], t[:, RF]) / pr.bw)
        b = np.maximum(self.work * pr.sec_bwd, np.maximum(t[:, SB], t[:, RB]) / pr.bw)
        return float((f + b).max())


def _empty(name: str, units: list[WorkUnit], size: int, pr: Prices) -> Placement:
    n = len(units)
    return Placement(name, units, pr, size, np.zeros(size), np.zeros((size, 4)), [u.q.stop for u in units],
                     [u.q.stop for u in units], [[] for _ in range(n)])


def _start(name: str, units: list[WorkUnit], size: int, pr: Prices, at_kv_owner: list[bool]) -> Placement:
    pl = _empty(name, units, size, pr)
    work = np.zeros(size)
    traffic = np.zeros((size, 4))
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
        traffic[u.q_owner] += t
        traffic[u.kv_owner] += _mirror(t)
    pl.work, pl.traffic = work, traffic
    return pl


def owner_computes(units: list[WorkUnit], size: int, pr: Prices) -> Placement:
    """Every block on its q owner: the reference the planner must never lose to."""
    return _start("owner-computes", units, size, pr, [False] * len(units))


def min_traffic(units: list[WorkUnit], size: int, pr: Prices) -> Placement:
    """Every cross block on whichever owner moves fewer bytes (both phases)."""
    flags = [u.q_owner != u.kv_owner and len(u.q) * pr.q_total < len(u.kv) * pr.kv_total for u in units]
    return _start("min-traffic", units, size, pr, flags)


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
    total = float(pl.work.sum())
    tau = total / size
    if tau <= 0:
        return pl
    cap = np.array([tau * pr.sec_fwd * pr.bw, tau * pr.sec_bwd * pr.bw]) * traffic_budget
    # blocks touching each rank: cross blocks by both owners, local blocks by their owner
    cross_of: list[list[int]] = [[] for _ in range(size)]
    local_of: list[list[int]] = [[] for _ in range(size)]
    for i, u in enumerate(units):
        if u.q_owner != u.kv_owner:
            cross_of[u.q_owner].append(i)
            cross_of[u.kv_owner].append(i)
        else:
            local_of[u.q_owner].append(i)
    limit = tau * (1 + tol)

    def within_budget(rank: int, delta: np.ndarray) -> bool:
        new = pl.traffic[rank] + delta
        for ph, (s, r) in enumerate(((SF, RF), (SB, RB))):
            after = max(new[s], new[r])
            if after > cap[ph] and after > max(pl.traffic[rank, s], pl.traffic[rank, r]) + 1.0:
                return False
        return True

    order = np.argsort(-pl.work, kind="stable").tolist()
    for b in order:
        if pl.work[b] <= limit:
            continue
        # candidates: (bytes per pair, kind, block index)
        cands: list[tuple[float, int, int]] = []
        for i in cross_of[b]:
            u = units[i]
            nk, nq = len(u.kv), len(u.q)
            if b == u.q_owner and pl.cut[i] > u.q.start:
                cands.append((pr.q_total / nk, 0, i))
            elif b == u.kv_owner and pl.cut[i] < u.q.stop:
                # rows back to the q owner: it then fetches the kv slice, the rows stop travelling
                gain = nq * pr.q_total - nk * pr.kv_total
                cands.append((max(-gain, 0.0) / (nq * nk) + 1e-12, 0, i))
        if allow_helpers:
            for i in local_of[b]:
                u = units[i]
                if pl.home[i] <= u.q.start:
                    continue
                n = pl.home[i] - u.q.start
                w = causal_work(TokenRange(u.q.start, pl.home[i]), TokenRange(u.kv.start, pl.home[i]), True) if u.causal else n * len(u.kv)
                if w <= 0:
                    continue
                nkv = (pl.home[i] - u.kv.start) if u.causal else len(u.kv)
                cands.append(((n * pr.q_total + nkv * pr.kv_total) / w, 1, i))
        cands.sort()
        # receivers by spare work (max-heap with lazy updates)
        heap = [(-(tau - pl.work[r]), r) for r in range(size) if r != b and pl.work[r] < tau]
        heapq.heapify(heap)
        for _, kind, i in cands:
            excess = pl.work[b] - tau
            if excess <= tau * tol:
                break
            u = units[i]
            if kind == 0:
                _shed_cross(pl, i, b, excess, tau, within_budget)
            else:
                _shed_local(pl, i, b, tau, heap, within_budget)
    return pl


def _shed_cross(pl: Placement, i: int, b: int, excess: float, tau: float, ok) -> None:
    """Move rows of cross block ``i`` from ``b`` to its other owner, up to both limits."""
    u = pl.units[i]
    nk = len(u.kv)
    other = u.kv_owner if b == u.q_owner else u.q_owner
    spare = tau - pl.work[other]
    amount = min(excess, spare)
    if amount <= 0:
        return
    rows = int(round(amount / nk))
    m0 = pl.cut[i]
    if b == u.q_owner:
        m = max(u.q.start, m0 - max(rows, 1))
    else:
        m = min(u.q.stop, m0 + max(rows, 1))
    if m == m0:
        return
    # the q owner's traffic change (the peer's is the mirror)
    _, _, t0 = pl.cross_state(i, m0)
    _, _, t1 = pl.cross_state(i, m)
    d = t1 - t0
    if not (ok(u.q_owner, d) and ok(u.kv_owner, _mirror(d))):
        return
    pl.set_cut(i, m)


def _shed_local(pl: Placement, i: int, b: int, tau: float, heap: list, ok) -> None:
    """Move tail bands of local block ``i`` to the ranks with the most spare work."""
    u = pl.units[i]
    nk = len(u.kv)
    skipped = []
    while heap and pl.home[i] > u.q.start:
        excess = pl.work[b] - tau
        if excess <= 0:
            break
        negspare, h = heapq.heappop(heap)
        spare = tau - pl.work[h]
        if abs(-negspare - spare) > 1e-9 * max(tau, 1.0):  # stale entry
            if spare > 0:
                heapq.heappush(heap, (-spare, h))
            continue
        if spare <= 0:
            continue
        amount = min(excess, spare)
        home_rng = TokenRange(u.q.start, pl.home[i])
        x = tail_rows_for_work(home_rng, u.kv.start, u.causal, nk, amount)
        if pl.home[i] - x < _MIN_BAND_ROWS and x > u.q.start:
            x = max(u.q.start, pl.home[i] - _MIN_BAND_ROWS)
        w, t = pl.band_state(i, x, pl.home[i])
        if w > spare * 1.05 + 1 and x < pl.home[i] - 1:
            x = min(pl.home[i] - 1, x + 1)  # one row too many for the receiver
            w, t = pl.band_state(i, x, pl.home[i])
        if w <= 0:
            skipped.append((negspare, h))
            continue
        if not (ok(u.q_owner, t) and ok(h, _mirror(t))):
            skipped.append((-spare, h))
            continue
        pl.add_band(i, x, h)
        left = tau - pl.work[h]
        if left > 0:
            heapq.heappush(heap, (-left, h))
    for item in skipped:
        heapq.heappush(heap, item)

"""Placement (DESIGN §2.1 step 2): which rank computes each block, balancing exact work
against traffic with the cost model of DESIGN §4.

Per rank ``r`` and phase, the surrogate time is ``max(compute_r, max(sent_r, recv_r) / bw)``
(links are full duplex); a placement's surrogate is the max over ranks of forward + backward.
Moves considered:

* a cross block (q owner ≠ kv owner) keeps its head rows on the q owner and moves ``m`` tail rows
  to the kv owner (the DistFlashAttn trick: the kv owner receives those q rows and returns o, lse);
  only the two owners' totals change, so a move is priced in O(1);
* a local block (both owners equal: short documents, diagonals) moves whole to another rank,
  which receives its q and kv and returns o, lse.

The greedy repeatedly unloads the bottleneck rank while that lowers the surrogate. Several
starting points are returned; ``compile_plan`` stages each and keeps the lowest *estimated time*
(DESIGN §4), the owner-computes placement always among them, so a plan is never worse than
leaving every block with its q owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware
from megatron_hsap.plan.ir import TokenRange, Unit, Wire
from megatron_hsap.plan.units import WorkUnit, causal_work

__all__ = ["Prices", "Placement", "owner_computes", "min_traffic", "balance"]


@dataclass(frozen=True, slots=True)
class Prices:
    """Per-token bytes of each wire, seconds per (q, k) pair, and link bandwidth."""

    q: float
    kv: float
    o_lse: float
    q_bwd: float  # q + do + lse + delta, sent with q when a block runs away from its q owner
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


# Per-rank load vector: compute s fwd/bwd, bytes sent/recv fwd/bwd.
CF, CB, SF, RF, SB, RB = range(6)
Load = tuple[float, float, float, float, float, float]
_ZERO: Load = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _add(a: Load, b: Load, sign: float = 1.0) -> Load:
    return tuple(x + sign * y for x, y in zip(a, b))  # type: ignore[return-value]


def _time(row: Load, bw: float) -> float:
    """Surrogate seconds of one rank: per phase max(compute, max(sent, recv) / bw), summed."""
    cf, cb, sf, rf, sb, rb = row
    return max(cf, (sf if sf > rf else rf) / bw) + max(cb, (sb if sb > rb else rb) / bw)


@dataclass(slots=True)
class Placement:
    """Mutable state of the greedy. Every block is split at one q row ``cut``: rows before it stay
    home (the q owner), rows from it on run on ``helper`` (the kv owner for cross blocks, any rank
    for local blocks); ``cut == q.stop`` means unsplit at home."""

    units: list[WorkUnit]
    cut: list[int]
    helper: list[int]
    loads: list[Load]
    name: str

    def copy(self, name: str) -> "Placement":
        return Placement(self.units, list(self.cut), list(self.helper), list(self.loads), name)

    def placed(self) -> list[Unit]:
        """Placed blocks (a split block gives two)."""
        out: list[Unit] = []
        for u, m, h in zip(self.units, self.cut, self.helper):
            if m > u.q.start:
                kv = TokenRange(u.kv.start, m) if u.causal else u.kv
                out.append(Unit(u.doc, TokenRange(u.q.start, m), kv, u.causal, u.q_owner, u.kv_owner, rank=u.q_owner))
            if m < u.q.stop:
                out.append(Unit(u.doc, TokenRange(m, u.q.stop), u.kv, u.causal, u.q_owner, u.kv_owner, rank=h))
        return out


def _loads_of(u: WorkUnit, m: int, h: int, pr: Prices) -> tuple[Load, Load]:
    """Load vectors (q owner, helper) of block ``u`` cut at row ``m``; the helper's rows
    [m, q.stop) need those q rows and, unless the helper owns them, the kv rows they see."""
    head_kv = TokenRange(u.kv.start, m) if u.causal else u.kv
    w_home = causal_work(TokenRange(u.q.start, m), head_kv, u.causal) if m > u.q.start else 0
    w_away = u.work - w_home
    nm = u.q.stop - m
    home_rank = u.q_owner
    # kv the home part needs from the kv owner (cross blocks only)
    kv_home = len(head_kv) if (m > u.q.start and u.kv_owner != home_rank) else 0
    kv_away = (u.kv.stop - u.kv.start) if (nm and h != u.kv_owner) else 0
    fs, bs = pr.sec_fwd, pr.sec_bwd
    home = [w_home * fs, w_home * bs, 0.0, 0.0, 0.0, 0.0]
    away = [w_away * fs, w_away * bs, 0.0, 0.0, 0.0, 0.0]
    # home part's kv comes from the kv owner, which is the helper for cross blocks
    if kv_home:
        home[RF] += kv_home * pr.kv
        home[RB] += kv_home * pr.kv
        home[SB] += kv_home * pr.dkv
        away[SF] += kv_home * pr.kv  # helper == kv owner here
        away[SB] += kv_home * pr.kv
        away[RB] += kv_home * pr.dkv
    if nm and h != home_rank:
        home[SF] += nm * pr.q
        home[RF] += nm * pr.o_lse
        home[SB] += nm * pr.q_bwd
        home[RB] += nm * pr.dq
        away[RF] += nm * pr.q
        away[SF] += nm * pr.o_lse
        away[RB] += nm * pr.q_bwd
        away[SB] += nm * pr.dq
    if kv_away:  # local block on a third rank: kv travels from its owner (== q owner)
        home[SF] += kv_away * pr.kv
        home[SB] += kv_away * pr.kv
        home[RB] += kv_away * pr.dkv
        away[RF] += kv_away * pr.kv
        away[RB] += kv_away * pr.kv
        away[SB] += kv_away * pr.dkv
    return tuple(home), tuple(away)  # type: ignore[return-value]


def _start(units: list[WorkUnit], size: int, pr: Prices, at_kv_owner: list[bool], name: str) -> Placement:
    loads: list[Load] = [_ZERO] * size
    cut, helper = [], []
    for u, move in zip(units, at_kv_owner):
        m = u.q.start if move else u.q.stop
        h = u.kv_owner
        home, away = _loads_of(u, m, h, pr)
        loads[u.q_owner] = _add(loads[u.q_owner], home)
        loads[h] = _add(loads[h], away)
        cut.append(m)
        helper.append(h)
    return Placement(units, cut, helper, loads, name)


def owner_computes(units: list[WorkUnit], size: int, pr: Prices) -> Placement:
    """Every block on its q owner: the reference the planner must never lose to."""
    return _start(units, size, pr, [False] * len(units), "owner-computes")


def min_traffic(units: list[WorkUnit], size: int, pr: Prices) -> Placement:
    """Every cross block on whichever owner moves fewer bytes (the necessary-traffic placement)."""
    flags = []
    for u in units:
        at_q = len(u.kv) * (2 * pr.kv + pr.dkv)
        at_kv = len(u.q) * (pr.q + pr.o_lse + pr.q_bwd + pr.dq)
        flags.append(u.q_owner != u.kv_owner and at_kv < at_q)
    return _start(units, size, pr, flags, "min-traffic")


def rank_times(loads: list[Load], bw: float) -> np.ndarray:
    return np.array([_time(r, bw) for r in loads])


def balance(start: Placement, pr: Prices, *, allow_helpers: bool = True, max_moves: int | None = None) -> Placement:
    """Target descent: lower the bottleneck rank to a target time ``tau`` by moving rows to ranks
    below ``tau``; when no move reaches the target, raise ``tau`` halfway to the bottleneck."""
    pl = start.copy(start.name + "+balanced")
    units, loads, bw = pl.units, pl.loads, pr.bw
    size = len(loads)
    touching: list[list[int]] = [[] for _ in range(size)]
    for idx, u in enumerate(units):
        touching[u.q_owner].append(idx)
        if u.kv_owner != u.q_owner:
            touching[u.kv_owner].append(idx)
    times = [_time(r, bw) for r in loads]
    compute_floor = sum(r[CF] + r[CB] for r in loads) / size
    tau = max(compute_floor, sum(times) / size)
    limit = max_moves if max_moves is not None else 4 * len(units) + 16 * size
    for _ in range(limit):
        b = max(range(size), key=times.__getitem__)
        tb = times[b]
        if tb <= tau * (1 + 1e-6):
            tau = tb  # balanced to the target; try a slightly lower one
            tau_next = max(compute_floor, tb * 0.98)
            if tau_next >= tb * (1 - 1e-6):
                break
            tau = tau_next
            continue
        move = _best_move(pl, b, touching[b], times, tau, pr, allow_helpers)
        if move is None:
            new_tau = (tau + tb) / 2
            if tb - tau < 1e-4 * tb:
                break
            tau = new_tau
            continue
        idx, m, h = move
        _apply(pl, idx, m, h, pr, times)
        if h != units[idx].kv_owner:
            touching[h].append(idx)
    return pl


def _apply(pl: Placement, idx: int, m: int, h: int, pr: Prices, times: list[float]) -> None:
    u = pl.units[idx]
    old_home, old_away = _loads_of(u, pl.cut[idx], pl.helper[idx], pr)
    new_home, new_away = _loads_of(u, m, h, pr)
    loads = pl.loads
    loads[u.q_owner] = _add(loads[u.q_owner], old_home, -1.0)
    loads[pl.helper[idx]] = _add(loads[pl.helper[idx]], old_away, -1.0)
    loads[u.q_owner] = _add(loads[u.q_owner], new_home)
    loads[h] = _add(loads[h], new_away)
    pl.cut[idx], pl.helper[idx] = m, h
    for r in {u.q_owner, h, u.kv_owner}:
        times[r] = _time(loads[r], pr.bw)


def _best_move(pl: Placement, b: int, cands: list[int], times: list[float], tau: float, pr: Prices, allow_helpers: bool):
    """The move of one block's rows that lowers ``b`` the most while the receiver stays ≤ tau."""
    units, loads, bw = pl.units, pl.loads, pr.bw
    tb = times[b]
    best = None
    best_peak = tb * (1 - 1e-9)
    lightest = min(range(len(times)), key=times.__getitem__)
    for idx in cands:
        u = units[idx]
        m0, h0 = pl.cut[idx], pl.helper[idx]
        cross = u.q_owner != u.kv_owner
        if cross:
            options = [u.kv_owner]
        elif allow_helpers:
            options = [h0] if h0 != u.q_owner else [lightest]
        else:
            continue
        for h in options:
            if h == u.q_owner and not cross:
                continue
            # Which direction unloads b: b at home -> lower the cut; b the helper -> raise it.
            if b == u.q_owner and b != h:
                lo, hi, down = u.q.start, m0 if h == h0 else u.q.stop, True
            elif b == h0 and h == h0:
                lo, hi, down = m0, u.q.stop, False
            else:
                continue
            if lo >= hi:
                continue
            old_home, old_away = _loads_of(u, m0, h0, pr)
            base = {u.q_owner: _add(loads[u.q_owner], old_home, -1.0)}
            base[h0] = _add(base.get(h0, loads[h0]), old_away, -1.0)
            if h not in base:
                base[h] = loads[h]
            other = h if b == u.q_owner else u.q_owner

            def peak(m: int) -> tuple[float, float]:
                home, away = _loads_of(u, m, h, pr)
                rows = dict(base)
                rows[u.q_owner] = _add(rows[u.q_owner], home)
                rows[h] = _add(rows[h], away)
                return _time(rows[b], bw), _time(rows[other], bw)

            # Move as far as the receiver stays within tau (monotone in the cut).
            far = lo if down else hi
            tbf, tof = peak(far)
            if tof <= tau:
                m = far
            else:
                near = hi if down else lo
                a, z = near, far
                while abs(z - a) > 1:
                    mid = (a + z) // 2
                    if peak(mid)[1] <= tau:
                        a = mid
                    else:
                        z = mid
                m = a
                if m == near:
                    continue
            pb, po = peak(m)
            pk = max(pb, po)
            if pk < best_peak:
                best_peak, best = pk, (idx, m, h)
    return best

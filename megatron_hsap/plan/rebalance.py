"""Greedy rebalancing of a placement (docs/design.md §2.1 step 2, the moves of ``placement.py``).

A rank's load is its work plus its bytes sent and received per phase; the target is ``tau =
total work / P``. Donors (ranks above ``tau``) are visited from the most loaded; each sheds its
excess through the cheapest moves first (bytes per pair moved): head rows to the kv owner or to
any rank, rows of a band it holds back to the q owner or on to any rank — into the ranks with the
most spare work, while no rank's traffic per phase exceeds ``traffic_budget`` × the time ``tau``
takes to compute in that phase (traffic beyond that could not hide behind compute).

Compile time (issue 14 item 5): heads no helper could take are left out before any tail search,
and a receiver's change is priced alone (``_rank_delta``) before the full ``Placement.delta`` —
the same float operations, so the same placement as pricing every candidate in full.
"""

from __future__ import annotations

import heapq

from megatron_hsap.plan.ir import TokenRange
from megatron_hsap.plan.placement import Band, Placement, Vec, _band_keys, _normalise, rows_for_work, tail_rows_for_work

__all__ = ["balance"]


_MIN_BAND_ROWS = 8  # flat prices: a band thinner than this moves too little work for its kv (kernel model: its minimum tile)
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
    pl = start.copy(name or f"{start.name}+rebalanced")
    rates, size, units = pl.rates, pl.size, pl.units
    if size == 1:
        return pl
    tau = float(sum(pl.work)) / size
    if tau <= 0:
        return pl
    cap = (tau * rates.sec_fwd * rates.bw * traffic_budget, tau * rates.sec_bwd * rates.bw * traffic_budget)
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
    home = pl.home
    for i, u in enumerate(units):
        if u.q_owner == u.kv_owner:  # a whole head is the block's (cached) work: the same integer
            h = home[i]
            local[u.q_owner] += float(u.work) if h == u.q.stop else pl.rows_work(i, u.q.start, h)
    reserve = [min(_LOCAL_RESERVE * tau, w) for w in local]
    # a band under one row tile runs at rows/tile of the rate (flat prices: _MIN_BAND_ROWS)
    min_band = _MIN_BAND_ROWS if rates.kernel is None else rates.kernel.min_block_rows()
    # A head shed to a helper (of the rank's own block, or of a cross block whose kv owner has no
    # spare work) is refused by _shed when its bytes cannot hide behind the work they bring; when
    # no band of the head could pass (_helpers_cannot_hide: a bound over every band size, with a
    # 1e-6 margin far above the rounding of _shed's float operations), _candidates leaves the
    # head out unpriced. The verdict holds until the candidate's turn: only its own shed changes
    # its block, and while b sheds every other rank's work only grows (the kv owner stays full).
    hidden = traffic_budget * rates.bw * (rates.sec_fwd + rates.sec_bwd) * (1 + 1e-6)
    order = sorted(range(size), key=lambda r: -pl.work[r])
    for b in order:
        if pl.work[b] <= tau * (1 + tol):
            continue
        cands = _candidates(pl, b, touching[b], tau, allow_helpers, hidden)
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
            _shed(pl, b, kind, i, j, tau, ok, receivers, touching, allow_helpers, min_band, keep, traffic_budget)
            if kind == _HEAD and u.q_owner == u.kv_owner:
                local[b] -= before - pl.rows_work(i, u.q.start, pl.home[i])
    return pl


# move kinds: rows of the head (kind 0) or of band j (kind 1) of a block, to another rank
_HEAD, _BAND = 0, 1


def _candidates(pl: Placement, b: int, blocks: list[int], tau: float, allow_helpers: bool,
                hidden: float = float("inf")) -> list[tuple[float, int, int, int]]:
    """(bytes per pair, kind, block, band index) of every way ``b`` can shed work, cheapest first.
    CostRates assume the cheapest receiver (the kv owner for rows of a cross block)."""
    rates, units = pl.rates, pl.units
    excess = pl.work[b] - tau
    out = []
    for i in blocks:
        u = units[i]
        a, c = u.q_owner, u.kv_owner
        nk = u.kv.stop - u.kv.start
        if b == a and pl.home[i] > u.q.start and not (
                allow_helpers and u.window < 0 and not pl.bands[i] and (c == a or pl.work[c] >= tau)
                and _helpers_cannot_hide(pl, i, hidden)):  # (no helper could take any of it: see balance)
            w = pl.rows_work(i, u.q.start, pl.home[i])
            if c != a:
                out.append((rates.q_total / nk, _HEAD, i, -1))
            elif allow_helpers and w > 0:
                amount = min(w, excess)
                x = tail_rows_for_work(TokenRange(u.q.start, pl.home[i]), u.kv.start, u.causal, nk, amount, u.window)
                moved = pl.rows_work(i, x, pl.home[i])
                nkv = (pl.home[i] - u.kv.start) if u.causal else nk
                if moved > 0:
                    out.append((((pl.home[i] - x) * rates.q_total + nkv * rates.kv_total) / moved, _HEAD, i, -1))
        for j, (x, y, h) in enumerate(pl.bands[i]):
            if h != b:
                continue
            w = pl.rows_work(i, x, y)
            if w <= 0:
                continue
            if j == len(pl.bands[i]) - 1 and b != a:
                # rows back to the q owner: they stop travelling; the head may start fetching kv
                fetch = nk * rates.kv_total if (c != a and pl.home[i] == u.q.start) else 0.0
                out.append((max(fetch - (y - x) * rates.q_total, 0.0) / w + 1e-12, _BAND, i, j))
            elif allow_helpers:
                out.append((rates.q_total / nk + (rates.kv_total * nk / w if b == c else 0.0), _BAND, i, j))
    out.sort()
    return out


def _shed(pl: Placement, b: int, kind: int, i: int, j: int, tau: float, ok, receivers: _Receivers,
          touching: list[list[int]], allow_helpers: bool, min_band: int, keep: float = 0.0,
          budget_ratio: float = 1.0) -> None:
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
            n = rows_for_work(TokenRange(lo, hi), u.kv.start, u.causal, nk, amount, u.window)
            n = max(n, 1)
            m = lo + n
            new_home, new_bands = m, pl.bands[i][:j] + [(m, hi, b)]
        else:  # the tail rows [m, hi) go to h
            m = tail_rows_for_work(TokenRange(lo, hi), u.kv.start, u.causal, nk, amount, u.window)
            if hi - m < min_band and m > lo:  # a band under one row tile runs at rows/tile of the rate
                m = max(lo, hi - min_band)
            while pl.rows_work(i, m, hi) > spare * 1.05 + 1 and m < hi - 1:
                m += max(1, (hi - m) // 16)  # too much for the receiver: a thinner band
            if kind == _HEAD:
                new_home, new_bands = m, pl.bands[i] + [(m, hi, h)]
            else:
                new_home = pl.home[i]
                new_bands = pl.bands[i][:j] + [(m, hi, h), (lo, m, b)] + pl.bands[i][j + 1:]
        # most tries end here, on the receiver's own change: price it alone before the full delta
        moved_w, moved_t = _rank_delta(pl, i, *_normalise(u, new_home, new_bands), h)
        rates = pl.rates
        xfer = (max(moved_t[0], moved_t[1]) + max(moved_t[2], moved_t[3])) / rates.bw
        if moved_w <= 0 or xfer > budget_ratio * moved_w * (rates.sec_fwd + rates.sec_bwd):
            excluded.add(h)  # the move's bytes would not hide behind the work it brings
            continue
        changes = pl.delta(i, new_home, new_bands)
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


def _helpers_cannot_hide(pl: Placement, i: int, hidden: float) -> bool:
    """Whether no helper can take head rows of block ``i`` (no bands, no window) within the
    traffic test of ``_shed`` (see ``balance``). A band of the head's last ``n`` rows (1 <= n <=
    N) moves at least ``n·A + K·2kv`` bytes (``A = q + q_bwd``) for ``W(n)`` pairs: ``n·K`` for a
    rectangle, ``n·(K − (n−1)/2)`` for a causal block (its rows see K − n + 1 … K keys). It is
    refused when ``n·A + 2K·kv > hidden·W(n)``; that difference is linear (rectangle) or convex
    (causal) in n, so its least value over [1, N] lies at N or 1, or at the causal vertex
    ``n* = K + ½ − A/hidden`` — checked there, over real n (a bound of the integer ones)."""
    u, rates = pl.units[i], pl.rates
    n_max = pl.home[i] - u.q.start
    if n_max <= 0:
        return False
    row, key = rates.q + rates.q_bwd, 2 * rates.kv
    if hidden <= 0:  # any byte is refused
        return row + key > 0
    if u.causal:
        k = pl.home[i] - u.kv.start
        n = min(max(k + 0.5 - row / hidden, 1.0), float(n_max))
        return n * row + k * key > hidden * n * (k - (n - 1) / 2)
    k = u.kv.stop - u.kv.start
    return all(n * row + k * key > hidden * n * k for n in (1, n_max))


def _rank_delta(pl: Placement, i: int, home: int, bands: list[Band], r: int) -> tuple[float, Vec]:
    """Rank ``r``'s entry of ``pl.delta(i, home, bands)`` (``(0.0, _ZERO)`` where it has none) for
    an already normalised ``home`` / ``bands``, without building the other ranks' terms: the
    terms of ``Placement.contrib`` that fall on ``r``, old state subtracted then new state added,
    in ``contrib``'s order — the same float operations as ``delta``, so the same bits."""
    u = pl.units[i]
    rates = pl.rates
    a, c = u.q_owner, u.kv_owner
    nk = u.kv.stop - u.kv.start
    w = 0.0
    t0 = t1 = t2 = t3 = 0.0
    for sign, hm, bs in ((-1.0, pl.home[i], pl.bands[i]), (1.0, home, bands)):
        sub = sign < 0
        terms: list[Vec] = []  # traffic terms on r, in contrib's order
        if hm > u.q.start:
            if a == r:
                x = pl.rows_work(i, u.q.start, hm)
                if x:
                    w = w - x if sub else w + x
            if c != a:
                if c == r:
                    terms.append(rates.kv_side(nk))
                if a == r:
                    kv = rates.kv_side(nk)
                    terms.append((kv[1], kv[0], kv[3], kv[2]))
        for x, y, hh in bs:
            if hh == r:
                v = pl.rows_work(i, x, y)
                if v:
                    w = w - v if sub else w + v
            if hh != a and (a == r or hh == r):
                q = rates.q_side(y - x)
                if a == r:
                    terms.append(q)
                if hh == r:
                    terms.append((q[1], q[0], q[3], q[2]))
            if hh != c and (c == r or hh == r):
                kv = rates.kv_side(_band_keys(u, x, y) if u.causal else nk)
                if c == r:
                    terms.append(kv)
                if hh == r:
                    terms.append((kv[1], kv[0], kv[3], kv[2]))
        for d in terms:
            if sub:
                t0, t1, t2, t3 = t0 - d[0], t1 - d[1], t2 - d[2], t3 - d[3]
            else:
                t0, t1, t2, t3 = t0 + d[0], t1 + d[1], t2 + d[2], t3 + d[3]
    return w, (t0, t1, t2, t3)

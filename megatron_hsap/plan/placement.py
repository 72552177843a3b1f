"""Placement (docs/design.md §2.1 step 2): which rank computes which q rows of each block.

The exact work of a block is its count of unmasked (q, k) pairs. Every block keeps a *head*
``[q.start, home)`` on its q owner and hands *bands* of rows ``[x, y)`` (tiling ``[home, q.stop)``)
to other ranks. A band on the kv owner needs only those q rows (and returns o/lse, dq): the
DistFlashAttn trick; a band on any other rank also needs the kv rows it sees (the whole kv slice
of a cross block, the key prefix ``[start, y)`` of a diagonal block). A head on the q owner of a
cross block needs the kv slice. The tail rows of a causal block see the most keys: a tail band is
the most work per byte moved, and a whole short document is one band.

The starting placements live here (owner-computes, min-traffic, DistFlashAttn per document
region); ``rebalance.balance`` moves work from the ranks above ``tau = total work / P``.

``compile_plan`` stages several placements (owner-computes, min-traffic, DistFlashAttn per
document region, and balanced ones with different budgets) and keeps the lowest *estimated time*
(docs/design.md §4): never worse than leaving every block with its q owner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, KernelModel, LinkClass
from megatron_hsap.plan.ir import TokenRange, Unit, Wire, new_unit
from megatron_hsap.plan.options import PlanOptions, inter_rank_nodes
from megatron_hsap.plan.units import WorkUnit, causal_work, clip_unit
from megatron_hsap.plan.window import banded_pairs, staircase_pairs

__all__ = ["CostRates", "plan_rates", "Placement", "owner_computes", "min_traffic", "region_distflash", "rows_for_work", "tail_rows_for_work"]

# per-rank traffic vector: bytes sent / received, forward and backward
SF, RF, SB, RB = range(4)


@dataclass(frozen=True, slots=True)
class CostRates:
    """Per-token bytes of each wire, seconds per (q, k) pair and the link bandwidth; and what the
    estimate needs to price blocks like the hardware (docs/design.md §4): the kernel model, FLOPs
    per pair, HBM bytes per merged row and the kernel slowdown beside NCCL transfers.

    ``sec_fwd`` / ``sec_bwd`` are the *flat* rates (placement and rebalancing heuristics rank
    moves with them); the estimate (``plan/estimate.py``) prices every block by its shape."""

    q: float
    kv: float
    o_lse: float
    q_bwd: float  # q + do + lse + delta: what travels with q rows in backward
    dq: float
    dkv: float
    sec_fwd: float
    sec_bwd: float
    bw: float
    kernel: KernelModel | None = None  # None: the flat rates above price compute (hand-made tests)
    fpp_fwd: float = 0.0  # FLOPs per (q, k) pair, forward / backward
    fpp_bwd: float = 0.0
    group: int = 1  # q heads per kv head
    heads: int = 1  # q heads per rank (after the intra all-to-all)
    accum_row: float = 0.0  # FA3 GQA backward: fp32 dK/dV atomics bytes per (kv tile row, q head): (d + dv)·4·2
    merge_o: float = 0.0  # HBM seconds to merge one o row (forward LSE merge)
    merge_dq: float = 0.0  # ... to accumulate one dq row / one dkv row (backward)
    merge_dkv: float = 0.0
    hbm_bw: float = 1.0
    overlap_slowdown: float = 0.0  # kernels beside an in-flight NCCL transfer run 1 + this slower
    # Over a network link class some inter ranks still share a node and talk over NVLink (ports in
    # parallel with the NIC): ``node[i]`` is inter rank i's node, ``nvl_bw`` the NVLink rate; () prices
    # every pair at ``bw``.
    node: tuple[int, ...] = ()
    nvl_bw: float = 0.0
    # the most one network (link 0) transfer reaches on its own: NCCL's channels to one network peer
    # (``Hardware.flow_bandwidth`` of the plan's link and P_inter; inf: no cap, NVLink plans)
    flow_bw: float = float("inf")
    # the layout's (global token start, local row start) per segment, per inter rank: which local
    # items' rows run on in local rows (one varlen call, plan/calls.py); () counts global contiguity
    segments: tuple[tuple[tuple[int, int], ...], ...] = ()
    # estimate._local_rates_of's per-rank memo, {(size, rank, ids of its local blocks): (the
    # blocks, numbers)}: the placements of one compile (one CostRates) share blocks they leave
    # untouched; it lives and dies with these rates (a `replace` gets a fresh one), no part of equality
    local_memo: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)
    # placement._start_sums' memo, {(id(units), size): (units, work, traffic)}: the three starts of
    # one layout (owner-computes, min-traffic, region-distflash) begin from the same sums
    start_memo: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, shape: HeadShape, hw: Hardware, bw: float, node: tuple[int, ...] = (),
           segments: tuple[tuple[tuple[int, int], ...], ...] = (), flow_bw: float = float("inf")) -> "CostRates":
        b = shape.token_bytes
        h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
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
            kernel=hw.kernel,
            fpp_fwd=shape.fwd_flops_per_pair,
            fpp_bwd=shape.bwd_flops_per_pair,
            group=h // hkv,
            heads=h,
            accum_row=(d + dv) * 4 * 2,
            merge_o=h * dv * hw.merge_fwd_bytes / hw.hbm_bw,
            merge_dq=h * d * hw.merge_bwd_bytes / hw.hbm_bw,
            merge_dkv=hkv * (d + dv) * hw.merge_bwd_bytes / hw.hbm_bw,
            hbm_bw=hw.hbm_bw,
            overlap_slowdown=hw.overlap_slowdown,
            node=node if len(set(node)) > 1 else (),
            nvl_bw=hw.nvlink_bw,
            flow_bw=flow_bw,
            segments=segments,
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


def plan_rates(shape: HeadShape, hw: Hardware, link: LinkClass, opts: PlanOptions,
               segments: tuple[tuple[tuple[int, int], ...], ...] = ()) -> CostRates:
    """THE rates a plan is priced with (``compile_plan``, the windowed clip, head chunks): the
    link's rate, which inter ranks share a node, the layout's ``segments`` (``Layout.segment_starts``)
    and the per-flow cap of a P2P stream over ``link`` in a communicator of P_inter ranks
    (``Hardware.flow_bandwidth``: SAP's P2P runs on the inter group)."""
    return CostRates.of(shape, hw, hw.bandwidth(link), inter_rank_nodes(opts, link), segments,
                        hw.flow_bandwidth(link, opts.inter_size))


Vec = tuple[float, float, float, float]


def _mirror(v: Vec) -> Vec:
    """The peer's view of a traffic vector: sent ↔ received."""
    return (v[1], v[0], v[3], v[2])


def _plus(a: Vec, b: Vec) -> Vec:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def _minus(a: Vec, b: Vec) -> Vec:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3])


def rows_for_work(q: TokenRange, kv_start: int, causal: bool, nk: int, work: float, window: int = -1) -> int:
    """Largest ``n`` such that the first ``n`` rows of a block (causal: rows attend keys from
    ``kv_start``; rectangle: ``nk`` keys each) hold at most ``work`` pairs; closed form, or a
    bisection on the banded pair count under a sliding ``window``."""
    if work <= 0:
        return 0
    if not math.isfinite(work):
        return len(q)
    if window >= 0:
        # the largest n whose banded pairs fit (monotone in n): from a lower bound (no window, the
        # closed forms below; and at most window + 1 keys per row), which is exact for rows whose
        # window lies wholly in the keys, galloping up and then bisecting
        kv_stop = q.stop if causal else kv_start + nk
        lo = max(rows_for_work(q, kv_start, causal, nk, work), min(len(q), int(work // (window + 1))))
        step, hi = 1, len(q)
        while lo < hi:
            probe = min(lo + step, hi)
            if banded_pairs(q.start, q.start + probe, kv_start, kv_stop, window) <= work:
                lo, step = probe, 2 * step
            else:
                hi = probe - 1
                break
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if banded_pairs(q.start, q.start + mid, kv_start, kv_stop, window) <= work:
                lo = mid
            else:
                hi = mid - 1
        return lo
    if not causal:
        return min(len(q), int(work // nk))
    first = q.start - kv_start + 1  # keys seen by the first row
    b = 2 * first - 1
    n = (math.isqrt(int(b * b + 8 * work)) - b) // 2
    while n > 0 and staircase_pairs(n, first) > work:
        n -= 1
    return min(len(q), max(0, n))


def tail_rows_for_work(q: TokenRange, kv_start: int, causal: bool, nk: int, work: float, window: int = -1) -> int:
    """Smallest row ``x`` such that rows ``[x, q.stop)`` hold at least ``work`` pairs."""
    total = causal_work(q, TokenRange(kv_start, q.stop) if causal else TokenRange(kv_start, kv_start + nk), causal, window)
    if work >= total:
        return q.start
    head = rows_for_work(q, kv_start, causal, nk, total - work, window)
    return q.start + head


Band = tuple[int, int, int]  # (x, y, rank computing rows [x, y))


@dataclass(slots=True)
class Placement:
    """Mutable state of one placement: ``home[i]`` and ``bands[i]`` (descending, tiling
    ``[home, q.stop)``) per block, and the per-rank work and traffic they add up to."""

    name: str
    units: list[WorkUnit]
    rates: CostRates
    size: int
    work: list[float]  # [P] pairs
    traffic: list[Vec]  # [P] bytes (SF, RF, SB, RB)
    home: list[int]
    bands: list[list[Band]]  # per block; each list replaced whole, never changed in place (copies share them)
    base: list[Unit]  # every block whole on its q owner (shared by copies: placed() reuses them)

    def copy(self, name: str) -> "Placement":
        """An independent placement in the same state. A block's band list is a value: ``set_rows``
        replaces it with a fresh list (``_normalise``), nothing changes one in place, so copies
        share them (copying ~10^4 lists per rebalance was a third of its time at 1,024 GPUs)."""
        return Placement(name, self.units, self.rates, self.size, list(self.work), list(self.traffic), list(self.home),
                         list(self.bands), self.base)

    # ------------------------------------------------------------------ one block's share
    def rows_work(self, i: int, x: int, y: int) -> float:
        """Pairs of rows ``[x, y)`` of block ``i``."""
        u = self.units[i]
        if y <= x:
            return 0.0
        if u.window >= 0:
            return float(banded_pairs(x, y, u.kv.start, u.kv.stop if not u.causal else y, u.window))
        if u.causal:
            return float(staircase_pairs(y - x, x - u.kv.start + 1))
        return float((y - x) * (u.kv.stop - u.kv.start))

    def contrib(self, i: int, home: int | None = None, bands: list[Band] | None = None) -> list[tuple[int, float, Vec]]:
        """(rank, work, traffic) terms of block ``i`` (optionally for a hypothetical state)."""
        u = self.units[i]
        rates = self.rates
        home = self.home[i] if home is None else home
        bands = self.bands[i] if bands is None else bands
        a, c = u.q_owner, u.kv_owner
        nk = u.kv.stop - u.kv.start
        out: list[tuple[int, float, Vec]] = []
        if home > u.q.start:
            out.append((a, self.rows_work(i, u.q.start, home), _ZERO))
            if c != a:  # the head fetches the kv slice
                kv = rates.kv_side(nk)
                out.append((c, 0.0, kv))
                out.append((a, 0.0, _mirror(kv)))
        for x, y, h in bands:
            out.append((h, self.rows_work(i, x, y), _ZERO))
            if h != a:
                q = rates.q_side(y - x)
                out.append((a, 0.0, q))
                out.append((h, 0.0, _mirror(q)))
            if h != c:
                kv = rates.kv_side(_band_keys(u, x, y) if u.causal else nk)
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
        # every term carries work or traffic, not both; adding a zero leaves a sum as it is (no
        # -0.0 arises: sums start at +0.0 and x - x is +0.0), so zero halves are skipped
        for r, w, t in self.contrib(i):
            cur = out.get(r)
            if cur is None:
                cur = out[r] = [0.0, _ZERO]
            if w:
                cur[0] -= w
            if t is not _ZERO:
                c = cur[1]
                cur[1] = (c[0] - t[0], c[1] - t[1], c[2] - t[2], c[3] - t[3])
        for r, w, t in self.contrib(i, home, bands):
            cur = out.get(r)
            if cur is None:
                cur = out[r] = [0.0, _ZERO]
            if w:
                cur[0] += w
            if t is not _ZERO:
                c = cur[1]
                cur[1] = (c[0] + t[0], c[1] + t[1], c[2] + t[2], c[3] + t[3])
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
                out.append(Unit(u.doc, TokenRange(u.q.start, h0), kv, u.causal, a, c, a, window=u.window))
            for x, y, h in self.bands[i]:
                parts = []
                if not u.causal:
                    parts.append(Unit(u.doc, TokenRange(x, y), u.kv, False, a, c, h, window=u.window))
                else:
                    if x > u.kv.start:
                        parts.append(Unit(u.doc, TokenRange(x, y), TokenRange(u.kv.start, x), False, a, c, h, window=u.window))
                    parts.append(Unit(u.doc, TokenRange(x, y), TokenRange(x, y), True, a, c, h, window=u.window))
                for part in parts:  # under a window: clipped to the band, beyond it dropped
                    part = clip_unit(part, u.window)
                    if part is not None:
                        out.append(part)
        return out

    def flat_time_bound(self) -> float:
        """max over ranks of Σ_phase max(compute, max(sent, received) / bw): a lower bound of the
        staged estimate (staging adds latency and can only add traffic)."""
        rates = self.rates
        t = np.asarray(self.traffic, dtype=float).reshape(self.size, 4)
        w = np.asarray(self.work, dtype=float)
        f = np.maximum(w * rates.sec_fwd, np.maximum(t[:, SF], t[:, RF]) / rates.bw)
        b = np.maximum(w * rates.sec_bwd, np.maximum(t[:, SB], t[:, RB]) / rates.bw)
        return float((f + b).max())


_ZERO: Vec = (0.0, 0.0, 0.0, 0.0)


def _band_keys(u: WorkUnit, x: int, y: int) -> int:
    """Keys rows ``[x, y)`` of causal block ``u`` need: from its first key (or, under a window,
    from row ``x``'s oldest key) to ``y``."""
    start = u.kv.start if u.window < 0 else max(u.kv.start, x - u.window)
    return y - start


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


def _start_sums(units: list[WorkUnit], size: int, rates: CostRates) -> tuple[list[float], list[Vec]]:
    """Per-rank work and traffic with every block whole on its q owner (a fresh copy each call).

    The same float operations as adding ``u.work`` and ``rates.kv_side`` / its mirror per block in
    block order (``_plus`` per component; ranks no block reaches keep ``_ZERO``), computed once per
    ``(units, size)`` and kept on ``rates`` (one compile's) for the other starts of the layout.
    tests/plan/test_compile_speed_equal.py checks them against the per-block form."""
    key = (id(units), size)
    got = rates.start_memo.get(key)
    if got is None or got[0] is not units or got[1] != len(units):
        work = [0.0] * size
        sf, rf, sb, rb = ([0.0] * size for _ in range(4))
        touched = [False] * size
        kv, dkv = rates.kv, rates.dkv
        for u in units:
            a, c = u.q_owner, u.kv_owner
            work[a] += u.work
            if a != c:  # the q owner fetches the kv slice: kv_side(n) = (n·kv, 0, n·kv, n·dkv) on c, mirrored on a
                n = u.kv.stop - u.kv.start
                k, d = n * kv, n * dkv
                sf[c] += k; rf[c] += 0.0; sb[c] += k; rb[c] += d  # noqa: E702
                sf[a] += 0.0; rf[a] += k; sb[a] += d; rb[a] += k  # noqa: E702
                touched[a] = touched[c] = True
        traffic = [(sf[r], rf[r], sb[r], rb[r]) if touched[r] else _ZERO for r in range(size)]
        got = rates.start_memo[key] = (units, len(units), work, traffic)
    return list(got[2]), list(got[3])


def _empty(name: str, units: list[WorkUnit], size: int, rates: CostRates, base: list[Unit] | None) -> Placement:
    if base is None:
        # ``ir.new_unit``: the fast constructor, with the work unit's (equal) work carried over
        base = [new_unit(u.doc, u.q, u.kv, u.causal, u.q_owner, u.kv_owner, u.q_owner, 0, u.window, u.work) for u in units]
    work, traffic = _start_sums(units, size, rates)
    return Placement(name, units, rates, size, work, traffic, [u.q.stop for u in units], [[] for _ in units], base)


def owner_computes(units: list[WorkUnit], size: int, rates: CostRates, base: list[Unit] | None = None) -> Placement:
    """Every block on its q owner: the reference the planner must never lose to. (``base``, in
    all three starts: the blocks as ``Unit``s on their q owners, shared to save allocations.)"""
    return _empty("owner-computes", units, size, rates, base)


def min_traffic(units: list[WorkUnit], size: int, rates: CostRates, base: list[Unit] | None = None) -> Placement:
    """Every cross block on whichever owner moves fewer bytes (both phases)."""
    pl = _empty("min-traffic", units, size, rates, base)
    for i, u in enumerate(units):
        if u.q_owner != u.kv_owner and len(u.q) * rates.q_total < len(u.kv) * rates.kv_total:
            pl.set_rows(i, u.q.start, [(u.q.start, u.q.stop, u.kv_owner)])
    return pl


def region_distflash(units: list[WorkUnit], size: int, rates: CostRates, base: list[Unit] | None = None) -> Placement:
    """DistFlashAttn inside every document's region (the paper's step 2): a document spanning
    ``n`` chunks puts its cross block ``(i, j)`` on the kv owner when ``i − j > n/2`` and on the q
    owner when ``i − j < n/2``; at exactly ``n/2`` the tail half of the rows goes to the kv owner.
    For one document over all ranks this is DistFlashAttn's balanced schedule."""
    pl = _empty("region-distflash", units, size, rates, base)
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

"""A phase's time as the longest path over each rank's own program (docs/design.md §4).

Every rank runs ``Post(round k) · Compute(stage k) · Wait(round k) · Merge(round k)`` (``plan/codegen.py``)
on its own clock: nothing makes a rank wait at a stage boundary for ranks it does not exchange
with. So rank ``r`` posts round ``k`` at ``t_r(k)`` (the end of its round ``k − 1``), computes
stage ``k`` until ``t_r(k) + compute_r(k)``, and its wait ends when its own compute is done and
every transfer it takes part in has arrived; then it merges what it received:

    t_r(k + 1) = max(t_r(k) + compute_r(k),  max over r's transfers f of round k [end_f]) + after_r(k)

A transfer ``f = s → d`` (a round's bytes ``v_f`` between the two over one link class) starts at
``a_f = max(t_s(k), t_d(k)) + latency``: once both ends have posted (NCCL point-to-point is
pairwise-synchronous). It runs through ``s``'s send port and ``d``'s receive port of its class
(full-duplex ports, one bandwidth per class). Each port carries the round's transfers as they
start, never idle while one is pending (work-conserving, as max-min fair sharing is at a busy
port), so it has carried all of them by its drain time

    drain(port) = max over its transfers j of [a_j + Σ bytes of its transfers starting at or after a_j / bandwidth]

A port shares its bandwidth among the transfers it carries (max-min fair, as NCCL's channels
do), so a short transfer at a busy port ends before the port drains: under processor sharing it
has carried, when it ends, at most ``min(v_j, v_f)`` of every other transfer ``j`` of the port
(all of a shorter one, as much of a longer one as of itself; a ``j`` started earlier or later
has taken less while ``f`` ran), so it ends by

    shared(port, f) = a_f + Σ over the port's transfers j of min(v_j, v_f) / bandwidth

(exact when the port's transfers start together). At each end the transfer is done by
``min(drain, shared)``, and ``end_f = max(that at the send port of s, that at the receive port
of d, a_f + v_f / cap)``: a transfer
over the network (link 0 of a network plan) also runs at most at ``cap``, what NCCL's channels to
one network peer drive (``flow_bw``: ``Hardware.net_flow_bw`` of the inter group's size, 28 GB/s
on an NDR H100 up to 32 ranks, 14 GB/s from 33, against the NIC's 48; the simulator's
``Cluster.p2p_cap`` is the same rule), so a rank talking to one network peer is channel-bound and
one talking to several is port-bound. Rounds never share a port:
a rank posts round ``k + 1`` only after its round ``k`` transfers are done. The start times
matter: a port that carries a late peer's bytes after an early peer's is not charged both from
the later post (measured: owner-computes' backward on slimpajama SP8 32K s0 was priced 13.6%
over the simulator when every transfer was charged the busier end's whole round bytes from the
later post; within 3% with the drain). The shared term matters once stages are transfer-bound:
with gathered kernel calls (``plan/calls.py``) owner-computes' compute fell and the drain alone
priced its plan on the same batch 5.4% over the simulator, enough to keep a plan that simulates
2.4% slower; 1.0% over with the shared term. What is left out (``sim/engine.py`` does it, event by
event, and is the independent check: ``sim/estimate_accuracy.py``): a transfer slowed at one end
leaves bandwidth to the others at its other end, and the two ends' shares are taken one at a
time rather than jointly (max-min fairness over both ports); under the cap a
port whose transfers differ in size idles below its bandwidth once fewer than ``bw / cap`` are
left (the largest one's tail runs alone at ``cap``), which the max of the two terms does not
charge — there the estimate is below the simulator.

Transfers are ``[m, 4]`` int64 rows ``(round, src, dst, link)`` (link 0: the plan's link, 1:
NVLink between inter ranks on one node) with their bytes ``[m]``, sorted (``flows_of``);
independent problems (a plan's forward and backward) are priced in one pass by stacking their
ranks (``stack``): the per-round numpy calls, not the arithmetic, are the cost.
"""

from __future__ import annotations

import numpy as np

__all__ = ["round_seconds", "pair_rows", "pairs_of", "flow_rows", "flows_of", "stack", "path_finish", "path_seconds", "path_seconds_py"]

INF = float("inf")


def round_seconds(sent: np.ndarray, recv: np.ndarray, bw: float, nvl_bw: float = 0.0) -> np.ndarray:
    """[P, rounds] transfer seconds of each rank in each round from its bytes ``[P, rounds]``, or
    ``[2, P, rounds]`` (network, NVLink: ports that run in parallel): the busier of its ports."""
    if sent.ndim == 3:
        return np.maximum(np.maximum(sent[0], recv[0]) / bw, np.maximum(sent[1], recv[1]) / nvl_bw)
    return np.maximum(sent, recv) / bw


def pair_rows(key: np.ndarray, size: int) -> np.ndarray:
    """[m, 3] ``(round, r, p)`` rows of pair keys ``(round · P + r) · P + p`` (``pairs_of``'s)."""
    return np.stack([key // (size * size), key // size % size, key % size], axis=1)


def flow_rows(key: np.ndarray, size: int) -> np.ndarray:
    """[m, 4] ``(round, src, dst, link)`` rows of flow keys ``((round · 2 + link) · P + src) · P + dst``
    (``flows_of``'s: sorted keys are its row order)."""
    return np.stack([key // (2 * size * size), key // size % size, key % size, key // (size * size) % 2], axis=1)


def pairs_of(rounds: np.ndarray, src: np.ndarray, dst: np.ndarray, size: int) -> np.ndarray:
    """The sorted ``(round, r, p)`` rows, both directions, of the transfers ``src → dst`` in ``rounds``
    (repeats and self-pairs dropped)."""
    rounds, src, dst = (np.asarray(x, dtype=np.int64) for x in (rounds, src, dst))
    keep = src != dst
    rounds, src, dst = rounds[keep], src[keep], dst[keep]
    cells = (int(rounds.max()) + 1) * size * size if len(rounds) else 0
    if cells <= 1 << 22:  # a flag per (round, r, p): no sort
        flags = np.zeros(cells, dtype=bool)
        flags[(rounds * size + src) * size + dst] = True
        flags[(rounds * size + dst) * size + src] = True
        key = np.flatnonzero(flags)
    else:
        key = np.unique(np.concatenate([(rounds * size + src) * size + dst, (rounds * size + dst) * size + src]))
    return pair_rows(key, size)


def flows_of(rounds: np.ndarray, src: np.ndarray, dst: np.ndarray, link: np.ndarray, nbytes: np.ndarray,
             size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(flows, bytes)``: the sorted ``(round, src, dst, link)`` rows of the sends ``src → dst``
    with the bytes of each summed (self-sends and empty ones dropped). Bytes are whole numbers, so
    the sums are exact in any order."""
    rounds, src, dst, link = (np.asarray(x, dtype=np.int64) for x in (rounds, src, dst, link))
    nbytes = np.asarray(nbytes, dtype=np.float64)
    keep = (src != dst) & (nbytes > 0)
    key = ((rounds[keep] * 2 + link[keep]) * size + src[keep]) * size + dst[keep]
    uniq, inv = np.unique(key, return_inverse=True)
    total = np.bincount(inv.reshape(-1), weights=nbytes[keep], minlength=len(uniq))
    return flow_rows(uniq, size).astype(np.int64).reshape(-1, 4), total


def stack(parts: list[tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Independent problems ``(comp, after, flows, bytes)`` (same round count) as one: ranks of
    part ``i`` are offset by the ranks before it."""
    off = np.cumsum([0] + [c.shape[0] for c, _, _, _ in parts])
    comp = np.concatenate([c for c, _, _, _ in parts])
    after = None if all(a is None for _, a, _, _ in parts) else np.concatenate(
        [np.zeros_like(c) if a is None else a for c, a, _, _ in parts])
    flows = np.concatenate([f + np.array([0, o, o, 0]) for (_, _, f, _), o in zip(parts, off)])
    nbytes = np.concatenate([v for _, _, _, v in parts])
    order = np.argsort(flows[:, 0], kind="stable")  # rounds in order; within a round any order prices alike
    return comp, after, flows[order], nbytes[order]


def _by_port(port: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The transfers sorted by ``port`` then ``key``: ``(order, heads, group, ends)`` — each port's
    first row, each row's port index, and where each row's port stops."""
    order = np.lexsort((key, port))
    p = port[order]
    new = np.ones(len(p), dtype=bool)
    new[1:] = p[1:] != p[:-1]
    heads = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    return order, heads, group, np.append(heads[1:], len(p))[group]


def _drain(port: np.ndarray, start: np.ndarray, bw: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per transfer, the drain time of its ``port`` (the module docstring): the port's transfers
    sorted by start, each one's start plus the bytes starting at or after it over the bandwidth
    (of equal starts the first in order carries the most bytes: the maximum is the same)."""
    order, heads, group, ends = _by_port(port, start)
    v = nbytes[order]
    tail = np.append(np.cumsum(v[::-1])[::-1], 0.0)  # bytes from here to the end (exact: whole numbers)
    val = start[order] + (tail[:-1] - tail[ends]) / bw[order]
    out = np.empty(len(order))
    out[order] = np.maximum.reduceat(val, heads)[group]
    return out


def _shared(port: np.ndarray, start: np.ndarray, bw: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per transfer, its processor-sharing bound at its ``port`` (the module docstring): the
    port's transfers sorted by bytes, the ``i``-th of ``m`` has ``Σ_{j ≤ i} v_j + (m − 1 − i)·v_i``
    bytes of the port to share (ties give equal sums; exact: whole numbers)."""
    order, heads, group, ends = _by_port(port, nbytes)
    v = nbytes[order]
    upto = np.cumsum(v)
    upto -= np.append(0.0, upto)[heads[group]]  # bytes of the port's transfers up to this one, itself included
    out = np.empty(len(order))
    out[order] = start[order] + (upto + (ends - np.arange(len(order)) - 1) * v) / bw[order]
    return out


def _port_end(port: np.ndarray, start: np.ndarray, bw: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per transfer, when its ``port`` has carried it: ``min(drain, shared)``."""
    return np.minimum(_drain(port, start, bw, nbytes), _shared(port, start, bw, nbytes))


def path_finish(comp: np.ndarray, after: np.ndarray | None, flows: np.ndarray, nbytes: np.ndarray,
                bws: tuple[float, float], latency: float, flow_bw: float = INF) -> np.ndarray:
    """[P] seconds at which each rank ends the phase (the module docstring's recurrence).

    ``comp`` / ``after``: ``[P, rounds]`` seconds of stage ``k``'s compute (kernels slowed beside
    the round, launches, local merges) and of the merges of round ``k``'s received results (after
    its wait; None: none); ``flows`` / ``nbytes``: ``flows_of``; ``bws``: bandwidth of link 0 and 1;
    ``flow_bw``: the most one link-0 transfer reaches alone (inf: no cap; link 1 never has one)."""
    size, n = comp.shape
    capped = flow_bw < INF
    t = np.zeros(size)
    kk, s, d, c = flows[:, 0], flows[:, 1], flows[:, 2], flows[:, 3]
    bounds = np.searchsorted(kk, np.arange(n + 1))
    bw = np.array([bws[0], bws[1] if bws[1] > 0 else bws[0]])[c]
    out_port, in_port = s * 2 + c, d * 2 + c
    for k in range(n):
        end = t + comp[:, k]
        lo, hi = bounds[k], bounds[k + 1]
        if hi > lo:
            sl = slice(lo, hi)
            a = np.maximum(t[s[sl]], t[d[sl]]) + latency
            fin = np.maximum(_port_end(out_port[sl], a, bw[sl], nbytes[sl]), _port_end(in_port[sl], a, bw[sl], nbytes[sl]))
            if capped:  # a link-1 transfer's own term is a + v / inf = a, below its drain
                fin = np.maximum(fin, a + nbytes[sl] / np.where(c[sl] == 0, flow_bw, INF))
            np.maximum.at(end, s[sl], fin)
            np.maximum.at(end, d[sl], fin)
        t = end if after is None else end + after[:, k]
    return t


def path_seconds(comp: np.ndarray, after: np.ndarray | None, flows: np.ndarray, nbytes: np.ndarray,
                 bws: tuple[float, float], latency: float, flow_bw: float = INF) -> float:
    """Seconds until the last rank ends the phase (``path_finish``)."""
    return float(path_finish(comp, after, flows, nbytes, bws, latency, flow_bw).max(initial=0.0))


def _port_done(xs: list[int], starts: list[float], vs: list[float], b: float, out: list[float]) -> None:
    """``out[x]`` = min(drain, shared) of the port (bandwidth ``b``) carrying two or more transfers
    ``xs`` (indices into ``starts`` / ``vs``): ``path_seconds``' ``_port_end`` term by term. Bytes
    are whole numbers, so every byte sum below is exact in any order: transfers tied on start (or
    on bytes) may be taken in any order and give the same drain (the first of a tie carries the
    most bytes) and the same shared sums (``_shared``'s ties), so one sort key each suffices."""
    if len(xs) == 2:  # (the common multi-transfer port: the two sums written out)
        x, y = xs
        ax, ay, vx, vy = starts[x], starts[y], vs[x], vs[y]
        if ay < ax:  # drain: the later start carries its own bytes, the earlier one both
            best = ax + vx / b
            z = ay + (vx + vy) / b
        else:
            best = ay + vy / b
            z = ax + (vy + vx) / b
        if z > best:
            best = z
        if vy < vx:  # shared: the smaller carries itself twice over, the larger both
            sx = ax + (vy + vx) / b
            sy = ay + (vy + vy) / b
        else:
            sx = ax + (vx + vx) / b
            sy = ay + (vx + vy) / b
        out[x] = sx if sx < best else best
        out[y] = sy if sy < best else best
        return
    xs.sort(key=starts.__getitem__)  # drain: by start, the bytes from each one on
    tail, best = 0.0, -INF
    for x_i in reversed(xs):
        tail += vs[x_i]
        x = starts[x_i] + tail / b
        if x > best:
            best = x
    last, upto = len(xs) - 1, 0.0
    xs.sort(key=vs.__getitem__)  # shared: by bytes
    for n_i, x_i in enumerate(xs):
        v = vs[x_i]
        upto += v
        sh = starts[x_i] + (upto + (last - n_i) * v) / b
        out[x_i] = sh if sh < best else best


def path_seconds_py(comp: list[list[float]], after: list[list[float]] | None, flows: list[list[int]], nbytes: list[float],
                    bws: tuple[float, float], latency: float, flow_bw: float = INF) -> float:
    """``path_seconds`` as a loop over ranks and rounds, for problems of a few hundred cells
    (where numpy's per-round calls cost more than the arithmetic): the same operations on the
    same values (byte sums of whole numbers are exact in any order; maxima are order-free), so
    the same number. Arguments as lists (``tolist`` of the arrays)."""
    size = len(comp)
    n = len(comp[0]) if size else 0
    bw = (bws[0], bws[1] if bws[1] > 0 else bws[0])
    capped = flow_bw < INF
    t = [0.0] * size
    j, m = 0, len(flows)
    for k in range(n):
        end = [tr + row[k] for tr, row in zip(t, comp)]
        while j < m and flows[j][0] < k:
            j += 1
        i = j
        while j < m and flows[j][0] == k:
            j += 1
        if j > i:
            cnt = j - i
            vs = nbytes[i:j]
            rnd = flows[i:j]
            starts = [0.0] * cnt
            # each transfer leaves one out port (src, link) and enters one in port (dst, link):
            # each port's transfers (indices in the round), then when that port has carried each
            outs: dict[int, list[int]] = {}
            ins: dict[int, list[int]] = {}
            for x_i, (_, src, dst, c) in enumerate(rnd):
                ts, td = t[src], t[dst]
                starts[x_i] = (ts if ts > td else td) + latency
                outs.setdefault(src * 2 + c, []).append(x_i)
                ins.setdefault(dst * 2 + c, []).append(x_i)
            d0 = [0.0] * cnt
            d1 = [0.0] * cnt
            for ports, out in ((outs, d0), (ins, d1)):
                for key, xs in ports.items():
                    b = bw[key & 1]
                    if len(xs) == 1:
                        x_i = xs[0]
                        out[x_i] = starts[x_i] + vs[x_i] / b
                    else:
                        _port_done(xs, starts, vs, b, out)
            for x_i, (_, src, dst, c) in enumerate(rnd):
                f, g = d0[x_i], d1[x_i]
                if g > f:
                    f = g
                if capped and c == 0:
                    o = starts[x_i] + vs[x_i] / flow_bw
                    if o > f:
                        f = o
                if f > end[src]:
                    end[src] = f
                if f > end[dst]:
                    end[dst] = f
        t = end if after is None else [e + row[k] for e, row in zip(end, after)]
    return max([0.0] + t)

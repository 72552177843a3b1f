"""Bytes and peers per rank and round of staged blocks, in closed form (docs/design.md §4).

What ``codegen.phase_messages`` would emit for the staged blocks, summed without building the
messages: inputs deduplicated per rank, stage and range; results one per block. The estimate
(``plan/estimate.py``) prices them with ``plan/rank_path.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.rank_path import flow_rows, flows_of, pair_rows, pairs_of

__all__ = ["Traffic", "staged_traffic", "same_node", "both_links", "message_traffic"]


@dataclass(frozen=True, slots=True)
class Traffic:
    """One phase's bytes per ``[rank, round]`` sent and received (``[2, rank, round]``: network,
    NVLink, when some inter ranks share a node), ``pairs``: the sorted ``(round, r, p)`` rows,
    both directions, of the ranks that exchange bytes in a round (``rank_path.pairs_of``), and
    ``flows`` / ``nbytes``: each round's sends per ``(round, src, dst, link)`` with their bytes
    (``rank_path.flows_of``: what the estimate's ports carry)."""

    sent: np.ndarray
    recv: np.ndarray
    pairs: np.ndarray
    flows: np.ndarray
    nbytes: np.ndarray


def same_node(rates: CostRates, size: int) -> np.ndarray | None:
    """[P, P] bool: inter ranks on one node (their P2P traffic runs over NVLink), or None when
    every pair uses the plan's one link."""
    if not rates.node or rates.nvl_bw <= 0:
        return None
    node = np.asarray(rates.node[:size])
    return node[:, None] == node[None, :]


def both_links(a: np.ndarray) -> np.ndarray:
    """Network + NVLink bytes of a [2, P, rounds] array (or ``a`` itself)."""
    return a.sum(axis=0) if a.ndim == 3 else a


def message_traffic(msgs, size: int, n: int, same: np.ndarray | None) -> Traffic:
    """``Traffic`` of codegen's messages (``Message.round / src / dst / nbytes``)."""
    sent = np.zeros((2, size, n))
    recv = np.zeros((2, size, n))
    rnd = np.fromiter((m.round for m in msgs), dtype=np.int64, count=len(msgs))
    src = np.fromiter((m.src for m in msgs), dtype=np.int64, count=len(msgs))
    dst = np.fromiter((m.dst for m in msgs), dtype=np.int64, count=len(msgs))
    nb = np.fromiter((m.nbytes for m in msgs), dtype=np.float64, count=len(msgs))
    link = same[src, dst].astype(np.int64) if same is not None else np.zeros(len(msgs), dtype=np.int64)
    sent.reshape(-1)[:] = np.bincount((link * size + src) * n + rnd, weights=nb, minlength=sent.size)
    recv.reshape(-1)[:] = np.bincount((link * size + dst) * n + rnd, weights=nb, minlength=recv.size)
    if same is None:
        sent, recv = sent[0], recv[0]
    return Traffic(sent, recv, pairs_of(rnd, src, dst, size), *flows_of(rnd, src, dst, link, nb, size))


def staged_traffic(a: np.ndarray, size: int, n: int, rates: CostRates) -> tuple[Traffic, Traffic]:
    """Forward and backward ``Traffic`` of staged remote blocks ``a`` (``block_costs._arrays`` rows).
    Bytes per token are integers, so the sums are exact in any order: every row's bytes go into
    one ``np.bincount`` (called per staging priced: the numpy calls, not the arithmetic, cost).
    Up to ``_PY_ROWS`` blocks the same sums run as a Python loop (``_staged_traffic_py``)."""
    if len(a) <= _PY_ROWS:
        return _staged_traffic_py(a, size, n, rates)
    same = same_node(rates, size)
    cells = 2 * size * n
    idx: list[np.ndarray] = []  # flat [row, link, rank, round] of every byte count, rows: sent fwd,
    wts: list[np.ndarray] = []  # received fwd, sent bwd, received bwd
    pairs: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # fwd, bwd: (round, src, dst) columns
    sends: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # fwd, bwd: (round, src, dst, link, bytes) columns
    rank = a[:, 0]
    # per side: (columns of the range and owner, input bytes fwd, input bytes bwd, result bytes fwd,
    # result bytes bwd) per token; q travels with do/lse/delta in backward and returns o+lse / dq;
    # kv returns dkv in backward
    for lo, hi, oc, f_in, b_in, f_out, b_out in ((2, 3, 8, rates.q, rates.q_bwd, rates.o_lse, rates.dq),
                                               (4, 5, 9, rates.kv, rates.kv, 0.0, rates.dkv)):
        away = np.nonzero(rank != a[:, oc])[0]
        if len(away) == 0:
            continue
        r, k, o, start, stop = a[away][:, (0, 1, oc, lo, hi)].T
        tokens = stop - start
        base = same[r, o].astype(np.int64) * size if same is not None else 0
        k_in = np.mod(k - 1, n)  # the round before the stage (numpy's -1: the last round, as before)
        assert int(k.max()) + 1 < n, "a remote block's results return after the last round"
        k_out = k + 1
        # an input is sent once per rank, stage and range
        order = np.lexsort((stop, start, o, k, r))
        keys = np.stack((r, k, o, start, stop))[:, order]  # one gather, one comparison (not one per key)
        first = np.ones(len(order), dtype=bool)
        first[1:] = (keys[:, 1:] != keys[:, :-1]).any(axis=0)
        once = order[first]
        src_in, dst_in = ((base + o) * n + k_in)[once], ((base + r) * n + k_in)[once]
        src_out, dst_out = (base + r) * n + k_out, (base + o) * n + k_out
        t_once = tokens[once]
        for row, i, toks, per_token in ((0, src_in, t_once, f_in), (1, dst_in, t_once, f_in), (2, src_in, t_once, b_in),
                                        (3, dst_in, t_once, b_in), (0, src_out, tokens, f_out), (1, dst_out, tokens, f_out),
                                        (2, src_out, tokens, b_out), (3, dst_out, tokens, b_out)):
            if per_token:
                idx.append(i + row * cells)
                wts.append(toks * per_token)
        pair_in = np.stack([k_in[once], o[once], r[once]])
        pair_out = np.stack([k_out, r, o])
        link = same[r, o].astype(np.int64) if same is not None else np.zeros(len(r), dtype=np.int64)
        for ph, (p_in, p_out) in enumerate(((f_in, f_out), (b_in, b_out))):
            if p_in:
                pairs[ph].append(pair_in)
                sends[ph].append(np.stack([*pair_in, link[once], t_once * p_in]).astype(np.float64))
            if p_out:
                pairs[ph].append(pair_out)
                sends[ph].append(np.stack([*pair_out, link, tokens * p_out]).astype(np.float64))
    if idx:
        t = np.bincount(np.concatenate(idx), weights=np.concatenate(wts), minlength=4 * cells).reshape(4, 2, size, n)
    else:
        t = np.zeros((4, 2, size, n))
    if same is None:
        t = t[:, 0]
    out = []
    for ph in (0, 1):
        c = np.concatenate(pairs[ph], axis=1) if pairs[ph] else np.zeros((3, 0), dtype=np.int64)
        f = np.concatenate(sends[ph], axis=1) if sends[ph] else np.zeros((5, 0))
        out.append(Traffic(t[2 * ph], t[2 * ph + 1], pairs_of(c[0], c[1], c[2], size), *flows_of(*f[:4].astype(np.int64), f[4], size)))
    return out[0], out[1]


# up to this many staged blocks ``staged_traffic`` runs as a Python loop: the planner prices tens of
# blocks per staging (fineweb 64K, 8 ranks: ~25), where numpy's ~60 calls cost more than the loop
_PY_ROWS = 96


def _staged_traffic_py(a: np.ndarray, size: int, n: int, rates: CostRates) -> tuple[Traffic, Traffic]:
    """``staged_traffic`` as a loop over the rows: the same byte products added into the same
    cells in the same order (``np.bincount`` adds its weights one by one, in input order: per
    side, q then kv, the deduplicated inputs then the results; the four rows sent / received
    fwd / bwd are disjoint cells, so a block may add to all four at once), the same input dedup
    (first of each (rank, stage, owner, range) in sorted order) and the same sorted pair rows."""
    same = same_node(rates, size)
    sm = same.tolist() if same is not None else None
    cells = 2 * size * n
    c2, c3 = 2 * cells, 3 * cells
    flat = [0.0] * (4 * cells)
    rows = a.tolist()
    pairs: tuple[set, set] = (set(), set())
    # fwd, bwd: flow key (``rank_path.flow_rows``' encoding, which sorts in flows_of's order) ->
    # bytes (whole numbers: exact sums)
    sends: tuple[dict, dict] = ({}, {})
    sf, sb = sends
    pp = size * size
    for lo, hi, oc, f_in, b_in, f_out, b_out in ((2, 3, 8, rates.q, rates.q_bwd, rates.o_lse, rates.dq),
                                               (4, 5, 9, rates.kv, rates.kv, 0.0, rates.dkv)):
        away = [(row[0], row[1], row[oc], row[lo], row[hi]) for row in rows if row[0] != row[oc]]
        if not away:
            continue
        assert max(x[1] for x in away) + 1 < n, "a remote block's results return after the last round"
        # inputs: the first of each equal (rank, stage, owner, range) key in sorted order, i.e. the distinct keys
        for grp, fb, bb, k_off, to_owner in ((sorted(set(away)), f_in, b_in, -1, True), (away, f_out, b_out, 1, False)):
            if not (fb or bb):
                continue
            keys: list[int] = []
            for r, k, o, start, stop in grp:
                link = 1 if sm is not None and sm[r][o] else 0
                kk = (k + k_off) % n
                src, dst = (o, r) if to_owner else (r, o)
                s_cell, d_cell = (link * size + src) * n + kk, (link * size + dst) * n + kk
                toks = stop - start
                fk = ((kk * 2 + link) * size + src) * size + dst
                if fb:
                    v = toks * fb
                    flat[s_cell] += v
                    flat[d_cell + cells] += v
                    if src != dst and v > 0:
                        sf[fk] = sf.get(fk, 0.0) + v
                if bb:
                    v = toks * bb
                    flat[s_cell + c2] += v
                    flat[d_cell + c3] += v
                    if src != dst and v > 0:
                        sb[fk] = sb.get(fk, 0.0) + v
                keys.append(kk * pp + src * size + dst)
                keys.append(kk * pp + dst * size + src)
            if fb:
                pairs[0].update(keys)
            if bb:
                pairs[1].update(keys)
    t = np.array(flat).reshape(4, 2, size, n)
    if same is None:
        t = t[:, 0]
    out = []
    for ph in (0, 1):
        fk = sorted(sends[ph])
        out.append(Traffic(t[2 * ph], t[2 * ph + 1], pair_rows(np.array(sorted(pairs[ph]), dtype=np.int64), size),
                           flow_rows(np.array(fk, dtype=np.int64), size), np.array([sends[ph][x] for x in fk], dtype=np.float64)))
    return out[0], out[1]

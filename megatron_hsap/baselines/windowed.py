"""Peers under a causal sliding window ``(left, 0)`` (issue 15 item 6; docs/design.md §4 wire
formats and transfer rule, like ``baselines.flat``). Every peer prices its kernel calls with the
one kernel model (``Hardware.kernel`` through ``baselines/kernel_blocks.py``, as
``baselines.flat`` does: each call at its blocks' shapes, launches, merges where the code makes
them, the kernel slowdown beside an in-flight transfer).

Each model follows what the peer's code does with a window (read at the commits named below),
not what it could do:

* ``te_allgather_swa`` — Transformer Engine ``AttnFuncWithCPAndKVAllGather`` (NVIDIA/TransformerEngine
  ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``, commit
  d0067d0, ``attn_forward_func_with_cp`` accepts sliding windows with ``cp_comm_type`` ``"a2a"``
  or ``"all_gather"`` only). Every document padded to a multiple of 2P and split zigzag (rank r
  holds chunks r and 2P−1−r). The forward all-gathers **every** rank's K and V
  (``gather_along_first_dim`` of the whole local k, v — the window does not shrink the
  collective), then runs its two q chunks against the keys each may see: THD passes the whole
  gathered KV with per-step ``cu_seqlens`` up to the chunk's end and the window re-expressed for
  bottom-right alignment (``get_kv_seq_info_after_all_gather``), so the kernel computes the
  banded pairs only. The backward all-gathers K and V again and reduce-scatters dK, dV (activation
  dtype). So bytes equal the full-causal all-gather's (``flat.allgather_kv_zigzag``); compute is
  the banded pairs of each rank's zigzag rows. Compute waits for the collective (not overlapped).
  THD all-gather needs FusedAttention or FlashAttention 3 (the class docstring).
* ``te_a2a_swa`` — Transformer Engine ``AttnFuncWithCPAndQKVOA2A`` (same file; ``"a2a"`` is the
  other type that accepts windows): the all-to-alls of ``baselines.hierarchical``'s ``te_a2a``
  (documents padded to 2P, head split; the window changes no byte), each rank running the whole
  sequence's banded pairs on H/P heads in ONE call per phase (each document a banded l × l
  block). Needs P | H and P | Hkv (the registry's rule).
* ``magi_swa`` — MagiAttention (SandAI-org/MagiAttention, commit 2c64135): a window becomes
  ``AttnSlice`` ranges per document (``magi_attention/api/functools.py``
  ``infer_attn_mask_from_sliding_window``: a CAUSAL slice for the rows whose window reaches the
  document start, a BICAUSAL parallelogram for the rest), whose ``area`` is the exact banded pair
  count (``magi_attention/meta/container/slice.py``). The dispatcher cuts the (padded) sequence
  into chunks of ``chunk_size`` tokens and assigns them by area with its default min-heap
  (``magi_attention/meta/solver/dispatch_solver.py`` ``_solve_with_minhp``: largest area first to
  the least-loaded rank holding fewer than ⌈n/P⌉ chunks); q stays on its host rank, and each rank
  fetches the remote keys its slices' ``k_range``s touch (group-cast), once in the forward and
  again in the backward, which also group-reduces the fp32 partial dK, dV to their owners
  (``magi_attention/functional/dist_attn.py``: ``_fetch_remote_kv`` in both passes,
  ``reduce_partial_dq_dkv``). The stages are the default ``OverlapConfig(degree=1)``'s
  (``magi_attention/meta/solver/overlap_solver.py``): one ffa call over the keys the rank holds
  beside the fetch, then one over the fetched keys accumulating into the same output in the
  kernel (no separate merge); the backward's dK/dV reduce runs after its last stage, exposed
  (``_magi_swa``).

Where a model favours the peer it says so; dK/dV of TE travel in the activation dtype (HSAP and
MagiAttention send fp32 partials).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.baselines.flat import BaselineCost
from megatron_hsap.baselines.kernel_blocks import _PricingInputs, zigzag_allgather_compute
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.plan.window import normalize_window, staircase_pairs

__all__ = ["WINDOWED_PEERS", "MAGI_CHUNK_SIZE", "price_windowed", "banded_row_pairs", "magi_dispatch", "MagiDispatch",
           "magi_blocks"]

WINDOWED_PEERS = ("te_allgather_swa", "te_a2a_swa", "magi_swa")
MAGI_CHUNK_SIZE = 512  # MagiAttention's examples/transformers README passes chunk_size=512


def banded_row_pairs(n: np.ndarray, left: int) -> np.ndarray:
    """Pairs of the first ``n`` rows of a document under the causal window ``(left, 0)``: row ``i``
    (0-based) sees ``min(i, left) + 1`` keys. float64, same shape as ``n``; ``left = -1``: causal."""
    n = np.asarray(n, dtype=np.float64)
    if left < 0:
        return staircase_pairs(n)  # float64 in, float64 out (n(n-1) is even: exact)
    w = float(left) + 1.0  # keys of a full window row
    head = np.minimum(n, w)
    return staircase_pairs(head) + np.maximum(n - w, 0.0) * w


def _rows_pairs(a: np.ndarray, b: np.ndarray, lengths: np.ndarray, left: int) -> np.ndarray:
    """Banded pairs of document rows ``[a, b)`` clipped to each document's length (per document)."""
    a, b = np.minimum(a, lengths), np.minimum(b, lengths)
    return banded_row_pairs(b, left) - banded_row_pairs(a, left)


@dataclass(frozen=True, slots=True)
class _Env:
    cu: np.ndarray  # int64 [n_docs + 1]
    P: int
    left: int
    shape: HeadShape
    hw: Hardware
    link: LinkClass

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu).astype(np.float64)

    @property
    def pricing(self) -> _PricingInputs:
        """The kernel-model pricing inputs of ``baselines/kernel_blocks.py`` for this batch."""
        return _PricingInputs(cu=self.cu, P=self.P, shape=self.shape, hw=self.hw, link=self.link,
                              impl="fa3")  # only dk/dv accumulations here: 12 B per element in TE's and FA3's alike


def _full(env: _Env, method: str) -> BaselineCost | None:
    """The peer's full-causal flat price (None when it cannot run at this size)."""
    from megatron_hsap.baselines.hierarchical import price

    return price(method, env.cu, intra=1, inter=env.P, shape=env.shape, hardware=env.hw, link=env.link)


def _te_allgather_swa(env: _Env) -> BaselineCost:
    """Zigzag rows per rank, banded compute (one call per q chunk and phase at its blocks' shapes,
    ``flat.zigzag_allgather_compute`` with the window); bytes and collectives of the full-causal
    all-gather."""
    P = env.P
    left = env.left
    work, f_busy, b_busy = zigzag_allgather_compute(env.pricing, lambda n: banded_row_pairs(n, left), left)
    full = _full(env, "allgather_kv_zigzag")  # same gathers and reduce-scatter: the window moves nothing less
    assert full is not None  # runs at every size
    kv_bytes = float(full.bytes_sent[0]) / 3.0  # one all-gather of KV per rank (fwd, bwd; dKV likewise)
    coll = 0.0 if P == 1 else env.hw.latency(env.link)
    ag = kv_bytes / env.hw.bandwidth(env.link) + coll
    return BaselineCost(
        method="te_allgather_swa",
        fwd_time=ag + float(np.max(f_busy)),
        bwd_time=ag + float(np.max(b_busy)) + ag,
        bytes_sent=full.bytes_sent.copy(),
        bytes_recv=full.bytes_recv.copy(),
        work=work,
        steps=full.steps,
        note=f"all of K, V gathered whatever the window; banded compute (kernel-model priced); imbalance {work.max() / max(work.mean(), 1.0):.2f}",
    )


def _te_a2a_swa(env: _Env) -> BaselineCost | None:
    """TE's a2a all-to-alls unchanged; every rank makes ONE call per phase on H/P heads over every
    whole document, each a banded l × l block (the kernel skips the tiles outside the window),
    priced with the kernel model like the full-causal ``te_a2a``."""
    full = _full(env, "te_a2a")
    if full is None:
        return None
    n = env.lengths
    pairs = float(banded_row_pairs(n, env.left).sum()) / env.P
    comm, banded = [], []
    for ph, t in ((Phase.FWD, full.fwd_time), (Phase.BWD, full.bwd_time)):
        causal = env.pricing.calls(n, n, staircase_pairs(n), ph, head_split=env.P)
        band = env.pricing.calls(n, n, banded_row_pairs(n, env.left), ph, head_split=env.P)
        comm.append(t - float(causal.kernel + causal.fixed))  # the all-to-alls (not overlapped)
        banded.append(float(band.kernel + band.fixed))
    return BaselineCost(
        method="te_a2a_swa",
        fwd_time=comm[0] + banded[0],
        bwd_time=comm[1] + banded[1],
        bytes_sent=full.bytes_sent.copy(),
        bytes_recv=full.bytes_recv.copy(),
        work=np.full(env.P, pairs),
        steps=full.steps,
        note="all-to-alls not overlapped; banded compute on H/P heads (kernel-model priced)",
    )


@dataclass(frozen=True, slots=True)
class MagiDispatch:
    """MagiAttention's chunk dispatch of one batch: ``owner[k]`` of chunk ``k``, each rank's banded
    ``area`` (pairs) and the remote key tokens each rank fetches (``remote``) and serves (``served``)."""

    chunk_size: int
    owner: np.ndarray  # int64 [n_chunks]
    area: np.ndarray  # float64 [P]
    remote: np.ndarray  # float64 [P]: keys of other ranks this rank's slices touch (deduplicated)
    served: np.ndarray  # float64 [P]: this rank's keys other ranks fetch (summed over ranks)


def magi_dispatch(cu_seqlens: object, P: int, left: int, chunk_size: int = MAGI_CHUNK_SIZE) -> MagiDispatch:
    """Chunks of ``chunk_size`` tokens (the sequence padded to a multiple of ``chunk_size · P``, as
    MagiAttention's ``apply_padding``; padding has no area) assigned by area with the min-heap rule,
    then the key tokens each rank's q rows see under the window that other ranks hold."""
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    T = int(cu[-1])
    n_chunks = -(-T // (chunk_size * P)) * P
    Tp = n_chunks * chunk_size
    # per token: its document start and banded keys-before-and-including count
    doc = np.searchsorted(cu, np.arange(T), side="right") - 1
    start = cu[doc]
    pos = np.arange(T) - start
    keys = (pos + 1) if left < 0 else np.minimum(pos, left) + 1
    per_chunk = np.zeros(n_chunks)
    np.add.at(per_chunk, np.arange(T) // chunk_size, keys.astype(np.float64))
    limit = n_chunks // P
    order = np.argsort(-per_chunk, kind="stable")
    load, count = np.zeros(P), np.zeros(P, dtype=np.int64)
    owner = np.empty(n_chunks, dtype=np.int64)
    for k in order:  # least-loaded rank that still has room (ties: lowest rank)
        free = np.flatnonzero(count < limit)
        r = int(free[np.argmin(load[free])])
        owner[k] = r
        load[r] += per_chunk[k]
        count[r] += 1
    token_owner = np.repeat(owner, chunk_size)[:Tp]
    first_key = start if left < 0 else np.maximum(start, np.arange(T) - left)
    remote, served = np.zeros(P), np.zeros(P)
    for r in range(P):
        rows = np.flatnonzero(token_owner[:T] == r)
        if rows.size == 0:
            continue
        need = np.zeros(Tp + 1, dtype=np.int64)  # keys [first_key[i], i] of each row, as a difference array
        np.add.at(need, first_key[rows], 1)
        np.add.at(need, rows + 1, -1)
        seen = np.cumsum(need[:Tp]) > 0
        other = seen & (token_owner != r)
        remote[r] = float(other.sum())
        served += np.bincount(token_owner[other], minlength=P)[:P]
    return MagiDispatch(chunk_size=chunk_size, owner=owner, area=load, remote=remote, served=served)


def magi_blocks(cu_seqlens: object, d: MagiDispatch, left: int) -> list[tuple[np.ndarray, ...]]:
    """Per rank, the blocks of its two ffa calls: ``(nq, nk, pairs)`` of the host stage (keys the
    rank holds) then of the remote stage (fetched keys), one block per (chunk, document) piece of
    its q rows — the piece's rows that see such keys, the distinct such keys its rows see, and
    their banded pairs. (MagiAttention's calc meta cuts a piece's keys into one ``AttnSlice`` per
    run of same-side keys; one block per side packs them, which favours it slightly.)"""
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    T = int(cu[-1])
    P = len(d.area)
    tok = np.arange(T)
    doc = np.searchsorted(cu, tok, side="right") - 1
    first_key = cu[doc] if left < 0 else np.maximum(cu[doc], tok - left)
    token_owner = np.repeat(d.owner, d.chunk_size)[:T]
    out = []
    for r in range(P):
        rows = np.flatnonzero(token_owner == r)
        if rows.size == 0:
            out.append(tuple(np.zeros(0) for _ in range(6)))
            continue
        held = np.concatenate(([0], np.cumsum(token_owner == r)))  # keys of rank r before each token
        fk = first_key[rows]
        local = (held[rows + 1] - held[fk]).astype(np.float64)
        remote = (rows - fk + 1) - local
        chunk = rows // d.chunk_size
        start = np.r_[True, (chunk[1:] != chunk[:-1]) | (doc[rows][1:] != doc[rows][:-1])]
        pid = np.cumsum(start) - 1
        a, b = fk[start], rows[np.r_[start[1:], True]]  # each piece's first key and last row
        nk_local = (held[b + 1] - held[a]).astype(np.float64)
        nk_remote = (b - a + 1) - nk_local
        n = int(pid[-1]) + 1

        def per_piece(w: np.ndarray) -> np.ndarray:
            return np.bincount(pid, weights=w.astype(np.float64), minlength=n)

        out.append((per_piece(local > 0), nk_local, per_piece(local), per_piece(remote > 0), nk_remote, per_piece(remote)))
    return out


def _magi_swa(env: _Env, chunk_size: int) -> BaselineCost:
    """MagiAttention with its default ``OverlapConfig`` (``degree=1``: the host stage and ONE remote
    stage, ``magi_attention/meta/solver/overlap_solver.py``) and ``DistAttnFunc``
    (``magi_attention/functional/dist_attn.py``). Forward: the remote kv group-cast runs beside the
    host-stage ffa call over the keys the rank holds (its kernel ``overlap_slowdown`` slower), then
    one remote-stage ffa call over the fetched keys, which accumulates into the host output in
    the kernel (``out=out_acc, lse=lse_acc``: no separate merge). Backward: the kv fetched again
    beside the host-stage backward, the remote-stage backward (dq into ``dq_acc`` in the kernel),
    then the group-reduce of the fp32 partial dk/dv to their owners, exposed
    (``MAGI_ATTENTION_BWD_HIDE_TAIL_REDUCE`` defaults off), each owner summing the received rows
    into its dk/dv at HBM bandwidth (an fp32 accumulation, ``merge_bwd_bytes`` per element). Every
    ffa call priced with the kernel model at its blocks' shapes (``magi_blocks``); a rank's time is
    its own chain of stages, the phase's the slowest rank's."""
    d = magi_dispatch(env.cu, env.P, env.left, chunk_size)
    kv = float(env.shape.token_bytes(Wire.KV))
    dkv = float(env.shape.token_bytes(Wire.DKV))  # fp32 partials
    bw, lat = env.hw.bandwidth(env.link), (0.0 if env.P == 1 else env.hw.latency(env.link))
    f_sent, f_recv = d.served * kv, d.remote * kv
    r_sent, r_recv = d.remote * dkv, d.served * dkv  # the backward's group-reduce of dk/dv
    fetch = np.maximum(f_sent, f_recv) / bw
    reduce = np.maximum(r_sent, r_recv) / bw
    slow = 1.0 + env.hw.overlap_slowdown * (fetch > 0)
    pricing, m = env.pricing, env.pricing.merge
    stage = {ph: np.zeros((2, env.P, 2)) for ph in Phase}  # [host/remote, rank, kernel/fixed]
    for r, blocks in enumerate(magi_blocks(env.cu, d, env.left)):
        for s, (nq, nk, pairs) in enumerate((blocks[:3], blocks[3:])):
            for ph in Phase:
                c = pricing.calls(nq, nk, pairs, ph)
                stage[ph][s, r] = float(c.kernel), float(c.fixed)

    def host(ph: Phase) -> np.ndarray:
        return stage[ph][0, :, 0] * slow + stage[ph][0, :, 1]

    def remote(ph: Phase) -> np.ndarray:
        return stage[ph][1].sum(axis=-1)

    fwd = float(np.max(np.maximum(host(Phase.FWD), fetch) + lat + remote(Phase.FWD)))
    bwd = float(np.max(np.maximum(host(Phase.BWD), fetch) + lat + remote(Phase.BWD) + reduce + lat + d.served * m.dkv))
    return BaselineCost(
        method="magi_swa",
        fwd_time=fwd,
        bwd_time=bwd,
        bytes_sent=f_sent + f_sent + r_sent,
        bytes_recv=f_recv + f_recv + r_recv,
        work=d.area,
        steps=0 if env.P == 1 else 3,
        note=f"chunk {chunk_size}, min-heap dispatch (imbalance {d.area.max() / max(d.area.mean(), 1.0):.2f}); "
        "host + 1 remote ffa stage per phase (kernel-model priced), remote keys fetched in fwd and bwd, fp32 dKV reduced after",
    )


def price_windowed(method: str, cu_seqlens: object, *, world: int, window_size: object, shape: HeadShape,
                   hardware: Hardware, link: LinkClass, chunk_size: int = MAGI_CHUNK_SIZE) -> BaselineCost | None:  # fmt: skip
    """Estimated forward + backward time and bytes of a peer ``method`` (``WINDOWED_PEERS``) on this
    batch with the causal window ``window_size`` (flash-attn's ``(left, 0)``; ``None``: full causal).

    Returns None when the method cannot run at this size (``te_a2a_swa`` needs P | H and P | Hkv).
    Raises ``ConfigError`` for an unknown method or a window HSAP's convention refuses."""
    if method not in WINDOWED_PEERS:
        raise ConfigError(f"unknown windowed peer {method!r}; choose one of {', '.join(WINDOWED_PEERS)}")
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ConfigError(f"world (CP size) must be an integer >= 1, got {world!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    window = normalize_window(window_size)
    left = -1 if window is None else window[0]
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    env = _Env(cu=cu, P=int(world), left=left, shape=shape, hw=hardware, link=link)
    if method == "te_a2a_swa":
        return _te_a2a_swa(env)
    if method == "te_allgather_swa":
        return _te_allgather_swa(env)
    return _magi_swa(env, int(chunk_size))

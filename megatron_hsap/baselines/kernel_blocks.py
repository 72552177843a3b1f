"""Kernel time of the baselines' varlen calls with the one kernel model (docs/design.md §4), and
the inputs every closed-form price of ``baselines/flat.py`` reads (``_PricingInputs``).

The closed-form baselines of ``baselines/flat.py`` price every kernel call the published code
makes with ``Hardware.kernel`` — the ``KernelModel`` of ``plan/hardware.py`` that the planner's
estimate (``plan/estimate.py`` ``block_costs``) and the simulator read — term by term as the
estimate charges HSAP's own blocks:

* every document block at the kernel's rate for its own shape (the tile model;
  ``KernelModel.rate`` with the block's q rows, keys and unmasked pairs);
* ``launch_s`` per call (a call with no pair is not made);
* FlashAttention-3's backward grid, ``cta_s · ⌈longest kv block / 128⌉ · heads`` per block of a
  call, and its GQA fp32 dK/dV atomics, ``⌈nk / tile⌉ · heads · tile · (d + dv) · 4 · 2`` HBM
  bytes per block (both zero for kernels without them, e.g. the A100's FA2);
* merges and accumulations (``merge_rows``) at HBM bandwidth with the bytes per element of the
  baseline's OWN implementation (``_PricingInputs.impl``: TE's ``thd_out_correction``, MagiAttention's
  FA3 rings, LightSeq's Triton rescale), read from the table the simulator reads
  (``sim/config.merge_bytes``, i.e. ``sim/constants.MERGE_BYTES`` plus ``--config`` overrides) — not
  HSAP's ``Hardware.merge_fwd_bytes``, so a change to HSAP's merge cannot move a baseline.

Arrays are ``[..., n_blocks]``: one call per leading index (a step and a rank), its document
blocks on the last axis; blocks with no pair are dropped (not computed, not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.plan.options import kv_heads_per_rank
from megatron_hsap.plan.window import staircase_pairs
from megatron_hsap.sim.config import merge_bytes

__all__ = ["CallCost", "call_cost", "MergeRates", "RingSteps", "zigzag_ring_steps", "zigzag_allgather_compute"]


@dataclass(frozen=True, slots=True)
class CallCost:
    """Seconds of one call per leading index: ``kernel`` (the attention kernel, slowed beside an
    in-flight transfer) and ``fixed`` (launch, grid, GQA atomics: not slowed)."""

    kernel: np.ndarray
    fixed: np.ndarray

    def __add__(self, other: "CallCost") -> "CallCost":
        return CallCost(self.kernel + other.kernel, self.fixed + other.fixed)


def call_cost(hw: Hardware, nq, nk, pairs, phase: Phase | str, *, heads: int, kv_heads: int, flops_per_pair: float,
              head_dim: int, head_dim_v: int) -> CallCost:
    """Price calls of blocks ``nq`` × ``nk`` with ``pairs`` unmasked pairs each (arrays broadcast
    to ``[..., n_blocks]``) in ``phase`` ("fwd" / "bwd"); ``heads`` / ``kv_heads`` the heads one
    call runs (Ulysses: after its all-to-all), ``flops_per_pair`` for those heads."""
    phase = Phase(phase)
    k = hw.kernel
    pairs = np.asarray(pairs, dtype=np.float64)
    nq, nk, pairs = np.broadcast_arrays(np.asarray(nq, dtype=np.float64), np.asarray(nk, dtype=np.float64), pairs)
    live = pairs > 0
    group = max(1, heads // max(1, kv_heads))
    rate = k.rate(nq, nk, phase, group, np.maximum(pairs, 1.0))
    kern = np.where(live, pairs * flops_per_pair / rate, 0.0).sum(axis=-1)
    made = live.any(axis=-1)
    fixed = made * k.launch_s
    if phase != Phase.FWD and k.cta_s > 0:  # FA3's backward grid (KernelModel.grid_time), per block of the call
        maxk = np.where(live, nk, 0.0).max(axis=-1, initial=0.0)
        fixed = fixed + k.cta_s * np.ceil(maxk / 128.0) * heads * live.sum(axis=-1)
    if phase != Phase.FWD and k.gqa_dkv_accum and heads > kv_heads:  # KernelModel.gqa_accum_time
        T = float(k.tile or 128)
        tiles = np.where(live, np.ceil(nk / T), 0.0).sum(axis=-1)
        fixed = fixed + tiles * heads * T * (head_dim + head_dim_v) * 4 * 2 / hw.hbm_bw
    return CallCost(np.asarray(kern, dtype=np.float64), np.asarray(fixed, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class MergeRates:
    """HBM seconds per merged row (``plan/placement.CostRates.of``'s ``merge_o`` / ``merge_dq`` /
    ``merge_dkv``, the same formulas, with implementation ``impl``'s bytes per element): an o row's
    forward LSE merge, a dq row's and a dk/dv row's backward accumulation."""

    o: float
    dq: float
    dkv: float

    @classmethod
    def of(cls, shape: HeadShape, hw: Hardware, impl: str) -> "MergeRates":
        h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
        fwd, bwd = merge_bytes(impl, Phase.FWD), merge_bytes(impl, Phase.BWD)
        return cls(o=h * dv * fwd / hw.hbm_bw, dq=h * d * bwd / hw.hbm_bw, dkv=hkv * (d + dv) * bwd / hw.hbm_bw)


@dataclass(frozen=True, slots=True)
class _PricingInputs:
    """What every pricing function needs: the batch, P and the constants."""

    cu: np.ndarray  # int64 [n_docs + 1], global cu_seqlens (empty documents allowed)
    P: int
    shape: HeadShape
    hw: Hardware
    link: LinkClass
    impl: str = "te"  # whose merge kernel (sim/constants.MERGE_BYTES key): te, fa3, distflashattn

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu)

    @property
    def bw(self) -> float:
        return self.hw.bandwidth(self.link)

    @property
    def p2p_bw(self) -> float:
        """Bytes/s of one point-to-point stream of a ring over the ``P`` ranks: the link's rate,
        across nodes at most NCCL's channels per network peer in a communicator of ``P`` ranks
        (``Hardware.p2p_bandwidth``; the simulator's ``Cluster.p2p_cap``, HSAP's estimate too)."""
        return self.hw.p2p_bandwidth(self.link, self.P)

    @property
    def lat(self) -> float:
        return self.hw.latency(self.link)

    def calls(self, nq, nk, pairs, phase: Phase | str, head_split: int = 1) -> CallCost:
        """Kernel-model seconds of one varlen call per leading index of the ``[..., docs]``
        blocks (``kernel_blocks.call_cost``); ``head_split``: the call runs H/head_split heads."""
        sh, phase = self.shape, Phase(phase)
        fpp = sh.fwd_flops_per_pair if phase == Phase.FWD else sh.bwd_flops_per_pair
        kv = kv_heads_per_rank(sh.num_heads, sh.num_kv_heads, head_split)
        return call_cost(self.hw, nq, nk, pairs, phase, heads=sh.num_heads // head_split, kv_heads=kv,
                         flops_per_pair=fpp / head_split, head_dim=sh.head_dim, head_dim_v=sh.head_dim_v)

    @property
    def merge(self) -> MergeRates:
        return MergeRates.of(self.shape, self.hw, self.impl)

    def row_bytes(self, wire: Wire) -> float:
        return float(self.shape.token_bytes(wire))


def zigzag_allgather_compute(env: _PricingInputs, row_pairs: Callable[[np.ndarray], np.ndarray],
                             left: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank [P]: pairs, forward and backward compute seconds of TE's all-gather CP on the
    per-document zigzag (``flat._price_allgather_kv_zigzag``): one call per q chunk and phase, each
    chunk's rows ``[a, b)`` of every document against keys ``[max(0, a − left), b)`` (``left`` −1:
    from the document start), ``row_pairs(n)`` the pairs of a document's first n rows; the
    backward adds each call's dk/dv rows into the gathered gradient. P = 1: one call per phase."""
    P = env.P
    lengths = env.lengths.astype(np.float64)
    c = np.ceil(lengths / (2 * P)) if P > 1 else lengths / 2.0
    ranks = np.arange(P, dtype=np.float64)[:, None]

    def half(start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(nq, nk, pairs) [P, docs] of the call of the q chunk starting at ``start · c``."""
        a = np.minimum(start * c, lengths)
        b = np.minimum((start + 1) * c, lengths) if P > 1 else np.broadcast_to(lengths, a.shape)
        first = 0.0 if left < 0 else np.maximum(0.0, a - left)  # the call's first key, per document
        return b - a, np.where(b > a, b - first, 0.0), row_pairs(b) - row_pairs(a)

    halves = [half(ranks), half(2 * P - 1 - ranks)] if P > 1 else [half(0 * ranks)]
    work = sum(h[2].sum(axis=-1) for h in halves)
    f_busy = sum((x.kernel + x.fixed for x in (env.calls(*h, Phase.FWD) for h in halves)), np.zeros(P))
    b_busy = sum((x.kernel + x.fixed for x in (env.calls(*h, Phase.BWD) for h in halves)), np.zeros(P))
    if P > 1:
        b_busy = b_busy + sum(np.where(h[2] > 0, h[1], 0.0).sum(axis=-1) for h in halves) * env.merge.dkv
    return work, f_busy, b_busy


@dataclass(frozen=True, slots=True)
class RingSteps:
    """A per-document zigzag KV ring's calls, ``[steps, ring ranks]``: ``fwd`` / ``bwd`` seconds
    (``kernel`` slowed beside a transfer, ``fixed`` = launch, grid, GQA atomics and the step's
    merges, not slowed) and the forward ``pairs`` each call computes (backward: the same)."""

    fwd: CallCost
    bwd: CallCost
    pairs: np.ndarray


def zigzag_ring_steps(env: _PricingInputs, r: int, c: np.ndarray, *, pad_compute: bool,
                      merge_every_fwd_step: bool = False) -> RingSteps:
    """One varlen call per rank and step of the per-document zigzag KV ring over ``r`` ranks,
    on ``env.shape``'s heads (the heads one ring rank holds), each document cut in ``2r`` chunks
    of ``c[doc]`` rows (padded; ring rank i holds chunks i and 2r−1−i). Forward step i: rank i
    holds the kv of rank (i−s) mod r — step 0 the diagonal (both q chunks against both kv
    chunks, causal), an earlier owner the lower triangle (both q chunks × its first kv chunk), a
    later owner the upper one (q chunk 2r−1−i × both kv chunks): Transformer Engine's
    ``AttnFuncWithCPAndKVP2P`` sections (``context_parallel.py``) and MagiAttention's
    ``FA3RingAttnFunc`` (``exps/dist_attn/baselines/ring_attn.py``) alike. Backward step s holds
    the kv of (i+1+s) mod r (ending on its own). ``pad_compute``: the kernel computes the padding
    (TE's FA2 THD path); else real rows only (cuDNN / FA3). Merges, at HBM bandwidth: forward,
    steps 1.. correct the call's q rows by LSE (TE's ``thd_out_correction`` in the loop);
    ``merge_every_fwd_step``: every step's q rows, after the loop (``FA3RingAttnFunc`` starts
    from a zero output and corrects all ``cp_size`` partials at the end: charged to the last
    step, which moves nothing); backward, steps 1.. add the call's dq and dk/dv rows (step 0
    copies), both implementations."""
    lengths = env.lengths.astype(np.float64)
    c = np.asarray(c, dtype=np.float64)
    j = np.arange(2 * r, dtype=np.float64)[:, None]
    real = np.clip(lengths[None, :] - j * c[None, :], 0.0, c[None, :])  # [2r, docs] real rows per chunk
    rows = np.broadcast_to(c, real.shape) if (pad_compute and r > 1) else real
    ranks = np.arange(r)
    lo, hi = rows[ranks], rows[2 * r - 1 - ranks]  # [r, docs]: each rank's first and second q chunk

    def blocks(kv_owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(nq, nk, pairs) [r, docs] of each rank's call when it holds the kv of ``kv_owner``."""
        klo, khi = rows[kv_owner], rows[2 * r - 1 - kv_owner]
        below = (kv_owner < ranks)[:, None]
        diag = (kv_owner == ranks)[:, None]
        nq = np.where(diag | below, lo + hi, hi)
        nk = np.where(diag, lo + hi, np.where(below, klo, klo + khi))
        pairs = np.where(diag, staircase_pairs(lo) + hi * lo + staircase_pairs(hi), nq * nk)
        return nq, nk, pairs

    m = env.merge

    def phase(owners: list[np.ndarray], ph: Phase) -> tuple[CallCost, np.ndarray]:
        """Step by step (a [steps, r, docs] stack would not fit memory at r = 64 with thousands
        of documents)."""
        kern, fixed, merge, work = np.zeros((r, r)), np.zeros((r, r)), np.zeros((r, r)), np.zeros((r, r))
        for i, o in enumerate(owners):
            nq, nk, pairs = blocks(o)
            cost = env.calls(nq, nk, pairs, ph)
            kern[i], fixed[i], work[i] = cost.kernel, cost.fixed, pairs.sum(axis=-1)
            live = pairs > 0
            q_rows, k_rows = np.where(live, nq, 0.0).sum(axis=-1), np.where(live, nk, 0.0).sum(axis=-1)
            if ph == Phase.FWD and merge_every_fwd_step and r > 1:
                merge[r - 1] += q_rows * m.o
            elif i > 0:  # the first step writes, later steps correct (fwd) / accumulate (bwd)
                merge[i] += q_rows * m.o if ph == Phase.FWD else q_rows * m.dq + k_rows * m.dkv
        return CallCost(kern, fixed + merge), work

    fwd, pairs = phase([(ranks - i) % r for i in range(r)], Phase.FWD)
    bwd, _ = phase([(ranks + 1 + i) % r for i in range(r)], Phase.BWD)
    return RingSteps(fwd=fwd, bwd=bwd, pairs=pairs)

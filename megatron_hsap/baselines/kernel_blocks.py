"""Kernel time of the baselines' varlen calls with the one kernel model (docs/design.md §4).

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
* merges and accumulations (``merge_rows``) at HBM bandwidth with the very bytes per element of
  ``Hardware.merge_fwd_bytes`` / ``merge_bwd_bytes`` the estimate uses.

Arrays are ``[..., n_blocks]``: one call per leading index (a step and a rank), its document
blocks on the last axis; blocks with no pair are dropped (not computed, not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import Hardware

__all__ = ["CallCost", "call_cost", "MergeRates"]


@dataclass(frozen=True, slots=True)
class CallCost:
    """Seconds of one call per leading index: ``kernel`` (the attention kernel, slowed beside an
    in-flight transfer) and ``fixed`` (launch, grid, GQA atomics: not slowed)."""

    kernel: np.ndarray
    fixed: np.ndarray

    def __add__(self, other: "CallCost") -> "CallCost":
        return CallCost(self.kernel + other.kernel, self.fixed + other.fixed)


def call_cost(hw: Hardware, nq, nk, pairs, phase: str, *, heads: int, kv_heads: int, flops_per_pair: float,
              head_dim: int, head_dim_v: int) -> CallCost:
    """Price calls of blocks ``nq`` × ``nk`` with ``pairs`` unmasked pairs each (arrays broadcast
    to ``[..., n_blocks]``) in ``phase`` ("fwd" / "bwd"); ``heads`` / ``kv_heads`` the heads one
    call runs (Ulysses: after its all-to-all), ``flops_per_pair`` for those heads."""
    k = hw.kernel
    pairs = np.asarray(pairs, dtype=np.float64)
    nq, nk, pairs = np.broadcast_arrays(np.asarray(nq, dtype=np.float64), np.asarray(nk, dtype=np.float64), pairs)
    live = pairs > 0
    group = max(1, heads // max(1, kv_heads))
    rate = k.rate(nq, nk, phase, group, np.maximum(pairs, 1.0))
    kern = np.where(live, pairs * flops_per_pair / rate, 0.0).sum(axis=-1)
    made = live.any(axis=-1)
    fixed = made * k.launch_s
    if phase != "fwd" and k.cta_s > 0:  # FA3's backward grid (KernelModel.grid_time), per block of the call
        maxk = np.where(live, nk, 0.0).max(axis=-1, initial=0.0)
        fixed = fixed + k.cta_s * np.ceil(maxk / 128.0) * heads * live.sum(axis=-1)
    if phase != "fwd" and k.gqa_dkv_accum and heads > kv_heads:  # KernelModel.gqa_accum_time
        T = float(k.tile or 128)
        tiles = np.where(live, np.ceil(nk / T), 0.0).sum(axis=-1)
        fixed = fixed + tiles * heads * T * (head_dim + head_dim_v) * 4 * 2 / hw.hbm_bw
    return CallCost(np.asarray(kern, dtype=np.float64), np.asarray(fixed, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class MergeRates:
    """HBM seconds per merged row (``plan/placement.Prices.of``'s ``merge_o`` / ``merge_dq`` /
    ``merge_dkv``, the same formulas): an o row's forward LSE merge, a dq row's and a dk/dv row's
    backward accumulation."""

    o: float
    dq: float
    dkv: float

    @classmethod
    def of(cls, shape: HeadShape, hw: Hardware) -> "MergeRates":
        h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
        return cls(o=h * dv * hw.merge_fwd_bytes / hw.hbm_bw, dq=h * d * hw.merge_bwd_bytes / hw.hbm_bw,
                   dkv=hkv * (d + dv) * hw.merge_bwd_bytes / hw.hbm_bw)

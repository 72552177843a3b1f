"""Hardware constants and the attention kernel model (pure data + numpy), the ONE home of both
for the planner's cost model and the simulator (docs/design.md §4).

Sources: ``shared/workloads.md`` ("Hardware constants for the simulator") and docs/design.md §4.
``KernelModel`` prices a kernel block by its shape (the tile model); ``Hardware.kernel`` is the
very object ``sim/config.sim_hardware`` hands the simulator, so the planner's estimate
(``plan/estimate.py``) and the simulated kernels read one curve. The *flat* rates
(``attn_fwd_flops``) remain for the lower bounds and the flat baseline prices
(``baselines/flat.py``), which by definition ignore block shapes.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.window import staircase_pairs


class LinkClass(str, enum.Enum):
    """Which network carries the inter group's P2P traffic."""

    NVLINK = "nvlink"
    INFINIBAND = "ib"


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCurve:
    """Attention kernel efficiency by block shape: rate(n) = peak · n / (n + half_rate_tokens).

    Short documents run below peak (workloads.md: FA2 causal forward at 512 tokens ~57% of its
    16K rate, at 1K ~78%); a saturating curve with ``half_rate_tokens`` ≈ 390 reproduces both
    points within a few percent. ``n`` is the harmonic-ish block size min(q, k) of one call.
    """

    half_rate_tokens: float = 390.0
    launch_s: float = 5e-6  # fixed cost of one kernel call

    def efficiency(self, q_tokens: int, kv_tokens: int) -> float:
        n = max(1, min(q_tokens, kv_tokens))
        return n / (n + self.half_rate_tokens)


class HeadShapeLike(Protocol):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelModel:
    """Attention kernel time by block shape. Rates in FLOP/s (asymptotic peaks of the curve)."""

    fwd_peak: float
    bwd_peak: float
    curve: KernelCurve = field(default_factory=KernelCurve)
    cta_s: float = 0.0  # seconds per grid CTA of a varlen call (see grid_time)
    # FlashAttention-3's forward packs the q heads that share a kv head into the tile's rows for
    # varlen and causal calls (Dao-AILab/flash-attention hopper/heuristics.h ``should_pack_gqa``:
    # ``if (varlen_q || is_causal_or_local) return true``): a block of nq tokens fills nq·H/Hkv rows.
    # Its backward does not pack (one q head per CTA). FA2 never packs.
    pack_gqa: bool = False

    # Tile model (``tile`` > 0; docs/design.md §2.4): FlashAttention walks a block in tiles of
    # ``tile`` × ``tile`` (q rows × keys; FA2/FA3 causal hdim 128: 128 × 128). A block of nq rows
    # (nq·H/Hkv when packed) is ``M = ⌈rows / tile⌉`` row tiles; each row tile visits
    # ``keys per row / tile + ½`` key tiles (the last one half full on average, at least one, at
    # most ⌈nk / tile⌉) and pays ``mblock_overhead`` tiles of prologue / epilogue (load Q, rescale
    # and write O, LSE). Efficiency = useful pairs / pairs of the tiles visited. 0.8 reproduces the
    # short-document points of workloads.md (512 tokens 61% / 1K 75% of the 16K rate; measured 57% /
    # 78%); at 16K causal it is 0.98. ``tile`` = 0 keeps the older saturating curve.
    tile: int = 0
    mblock_overhead: float = 0.8
    gqa_dkv_accum: bool = False  # FA3 backward's fp32 dK/dV atomics per q head (gqa_accum_time)

    def rows(self, nq: np.ndarray | int, group: int, phase: Phase | str) -> np.ndarray | int:
        """Tile rows a block of ``nq`` q tokens fills (``group`` = q heads per kv head)."""
        phase = Phase(phase)
        return nq * group if (self.pack_gqa and phase is Phase.FWD and group > 1) else nq

    def efficiency(self, nq: np.ndarray | int, nk: np.ndarray | int, pairs: np.ndarray | None = None,
                   phase: Phase | str = Phase.FWD, group: int = 1) -> np.ndarray:
        """Kernel efficiency in (0, 1] of blocks ``[n]`` (``nq`` q tokens, ``nk`` keys, ``pairs``
        unmasked (q, k) pairs; ``pairs`` None means a full block). Arrays broadcast."""
        phase = Phase(phase)
        nq = np.maximum(1.0, np.asarray(nq, dtype=np.float64))
        nk = np.maximum(1.0, np.asarray(nk, dtype=np.float64))
        if self.tile <= 0:
            n = np.minimum(self.rows(nq, group, phase), nk)
            return n / (n + self.curve.half_rate_tokens)
        T = float(self.tile)
        pr = nq * nk if pairs is None else np.maximum(1.0, np.asarray(pairs, dtype=np.float64))
        g = group if (self.pack_gqa and phase is Phase.FWD and group > 1) else 1
        m = np.ceil(nq * g / T)
        per_row = np.minimum(np.maximum(pr / nq / T + 0.5, 1.0), np.ceil(nk / T))  # np.clip's values, without its Python wrapper
        return np.minimum(1.0, pr * g / ((m * (per_row + self.mblock_overhead)) * T * T))

    def rate(self, nq: np.ndarray | int, nk: np.ndarray | int, phase: Phase | str, group: int = 1,
             pairs: np.ndarray | None = None) -> np.ndarray:
        peak = self.fwd_peak if Phase(phase) is Phase.FWD else self.bwd_peak
        return peak * self.efficiency(nq, nk, pairs, phase, group)

    def blocks_time(self, nq: np.ndarray, nk: np.ndarray, flops: np.ndarray, phase: Phase | str, group: int = 1,
                    pairs: np.ndarray | None = None) -> float:
        """Seconds for blocks ``[n]`` of ``flops`` each (``pairs`` each), without any launch cost."""
        if len(flops) == 0:
            return 0.0
        return float((np.asarray(flops, dtype=np.float64) / self.rate(nq, nk, phase, group, pairs)).sum())

    def blocks_time_py(self, blocks: list[tuple[int, int, float, float]], phase: Phase | str, group: int = 1) -> float:
        """``blocks_time`` for a short list of ``(nq, nk, flops, pairs)`` without numpy overhead
        (the same formulas, term by term)."""
        if not blocks:
            return 0.0
        phase = Phase(phase)
        peak = self.fwd_peak if phase is Phase.FWD else self.bwd_peak
        g = group if (self.pack_gqa and phase is Phase.FWD and group > 1) else 1
        total = 0.0
        if self.tile <= 0:
            half = self.curve.half_rate_tokens
            for nq, nk, flops, _ in blocks:
                n = max(1.0, min(float(nq) * g, float(nk)))
                total += flops * (n + half) / (peak * n)
            return total
        T = float(self.tile)
        for nq, nk, flops, pairs in blocks:
            nq, nk = max(1.0, float(nq)), max(1.0, float(nk))
            pr = max(1.0, float(pairs))
            m = math.ceil(nq * g / T)
            per_row = min(max(pr / nq / T + 0.5, 1.0), math.ceil(nk / T))
            eff = min(1.0, pr * g / (m * (per_row + self.mblock_overhead) * T * T))
            total += flops / (peak * eff)
        return total

    def grid_time(self, max_nq: float, max_nk: float, n_blocks: int, heads: int, phase: Phase | str) -> float:
        """Scheduling cost of a varlen *backward* call's grid: FlashAttention-3's backward sizes it
        by the longest kv block, ``⌈max_nk / 128⌉ × heads × n_blocks`` CTAs, most of which exit at
        once when blocks differ in length (its forward walks only real tiles with a varlen-aware
        persistent scheduler: no cost). ``cta_s`` per CTA (averaged over the SMs) is fitted in
        ``sim/calibrate.py``; 0 leaves the model as before."""
        if self.cta_s <= 0 or n_blocks == 0 or Phase(phase) is Phase.FWD:
            return 0.0
        return self.cta_s * float(np.ceil(max_nk / 128.0)) * heads * n_blocks

    def gqa_accum_time(self, nk: np.ndarray, shape: "HeadShapeLike", phase: Phase | str, hbm_bw: float) -> float:
        """FlashAttention-3's backward with GQA (``gqa_dkv_accum``): every (kv tile, q head) CTA
        adds its fp32 dK/dV partial (tile × (d + dv) × 4 bytes) into the per-kv-head accumulator
        with atomics (hopper/epilogue_bwd.hpp ``CollectiveEpilogueBwdGQA``), a read-modify-write in
        HBM once the accumulator exceeds L2. Negligible for long blocks (the CTA's own work
        dwarfs it), dominant for skinny ones (a few q rows against many keys). ``nk``: ``[n]``."""
        if not self.gqa_dkv_accum or Phase(phase) is Phase.FWD or shape.num_heads <= shape.num_kv_heads or len(nk) == 0:
            return 0.0
        T = float(self.tile or 128)
        tiles = float(np.ceil(np.asarray(nk, dtype=np.float64) / T).sum())
        return tiles * shape.num_heads * T * (shape.head_dim + shape.head_dim_v) * 4 * 2 / hbm_bw

    @property
    def launch_s(self) -> float:
        """Fixed cost of one kernel call (``KernelCurve.launch_s``)."""
        return self.curve.launch_s

    @property
    def half_rate_tokens(self) -> float:
        """The saturating curve's half-rate block size (``KernelCurve.half_rate_tokens``; used when ``tile`` is 0)."""
        return self.curve.half_rate_tokens

    def min_block_rows(self, loss: float = 0.1, keys: int = 1024) -> int:
        """Fewest q rows a block may be cut to (docs/design.md §4 "minimum tile"): the fewest rows
        whose efficiency against ``keys`` keys is within ``loss`` of one full row tile's. A row
        tile is paid whole (``⌈rows / tile⌉``), so a sliver of ``n < tile`` rows runs at
        ``n / tile`` of the rate; the tile model (tile 128, loss 0.1) gives 116 rows. The saturating
        curve (``tile`` 0) has no tiles: 16 rows. Cached per model."""
        return _min_block_rows(self, loss, keys)

    def call_time(self, nq: np.ndarray, nk: np.ndarray, flops: np.ndarray, phase: Phase | str) -> float:
        """One varlen kernel call over several document blocks (``[n]`` arrays)."""
        return self.curve.launch_s + self.blocks_time(nq, nk, flops, phase)


@functools.lru_cache(maxsize=64)
def _min_block_rows(k: KernelModel, loss: float, keys: int) -> int:
    if k.tile <= 0:
        return 16
    full = float(k.efficiency(k.tile, keys))
    n = np.arange(1, k.tile + 1)
    return int(n[np.nonzero(k.efficiency(n, keys) >= (1 - loss) * full)[0][0]])


# HBM bytes per output element of one merge / accumulate step of HSAP's runtime, as the GPU path
# runs it (sim/constants.MERGE_BYTES["hsap"]; Hardware.merge_fwd_bytes / merge_bwd_bytes). Forward:
# the fused Triton merge (runtime/fused_merge.py, one launch) reads the fp32 accumulator 4 + the
# bf16 part 2 and writes 4 -> 10. The eager fallback (runtime/merge.py without Triton or with
# HSAP_FUSED_MERGE=0: ``out_acc.mul_(w).addcmul_(part, w)``, read 4 + write 4, then read 4 + 2 +
# write 4) moves 18 — MERGE_FWD_BYTES_EAGER, priced only if one sets merge_fwd_bytes to it.
# Backward ``+=`` into fp32 grads: 4 + 4 + 4 = 12.
MERGE_FWD_BYTES = 10.0
MERGE_FWD_BYTES_EAGER = 18.0
MERGE_BWD_BYTES = 12.0

# NCCL's point-to-point model over the network, read from its source (NVIDIA/nccl
# src/graph/paths.cc, 2.20-2.28): ``NCCL_P2P_PER_CHANNEL_NET_BW`` = 14 GB/s is what one p2p channel
# is assumed to drive to a network peer; p2pnChannels = the communicator's channel count, 16 on
# multi-node H100/A100 (one ring per NIC, 8, doubled on sm90: src/graph/connect.cc). The same for
# every GPU type here; ``Hardware.p2p_channel_net_bw`` / ``p2p_channels`` carry them, the
# simulator reads them from there (sim/constants.py).
P2P_CHANNEL_NET_BW = 14e9
P2P_CHANNELS = 16


def net_channels_per_peer(comm_size: int, p2p_channels: int) -> int:
    """NCCL channels a point-to-point stream to a *network* peer runs on in a communicator of
    ``comm_size`` ranks: 2, halved while ``2 · nRanks > 4 · p2pnChannels`` (NVIDIA/nccl
    ``src/graph/paths.cc`` ``ncclTopoGetNchannels``, 2.20–2.28: "start from 2 channels per NIC and
    reduce with scale"; one NIC per GPU keeps the floor at 1). Send/recv is tuned for all-to-all,
    where many peers share the NIC, so a lone ring send gets few channels (NVIDIA/nccl#1272): with
    16 channels, 2 up to 32 ranks, 1 from 33."""
    c = 2
    while c * comm_size > 4 * p2p_channels and c > 1:
        c //= 2
    return c


def net_flow_bw(comm_size: int, ib_bw: float, p2p_channel_net_bw: float, p2p_channels: int) -> float:
    """Bytes/s one point-to-point transfer to a network peer reaches on its own: its channels times
    what one channel drives, at most the NIC (H100, NDR 48 GB/s: 28 GB/s up to 32 ranks, 14 GB/s
    from 33). The planner's estimate (``CostRates.flow_bw``) and the simulator (``Cluster.p2p_cap``)
    both call this."""
    return min(ib_bw, net_channels_per_peer(comm_size, p2p_channels) * p2p_channel_net_bw)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One GPU model and its links. Rates in FLOP/s, bandwidths in bytes/s, latencies in s."""

    name: str
    attn_fwd_flops: float
    attn_bwd_flops: float
    nvlink_bw: float
    ib_bw: float
    nvlink_latency: float
    ib_latency: float
    gpus_per_node: int = 8
    dense_peak_flops: float = 0.0  # bf16 dense matmul peak (GPT FLOP model of the simulator)
    kernel: KernelModel = field(default_factory=lambda: KernelModel(fwd_peak=190e12, bwd_peak=170e12))
    hbm_bw: float = 1.6e12  # achieved HBM bandwidth of memory-bound kernels (LSE merges, accumulations)
    merge_fwd_bytes: float = MERGE_FWD_BYTES  # HBM bytes per element of one forward LSE merge (HSAP's)
    merge_bwd_bytes: float = MERGE_BWD_BYTES  # ... of one backward fp32 accumulation
    # Kernels that run while an NCCL transfer is in flight are this much slower (NCCL holds one CTA
    # per channel, 2–16 of 132 SMs, and a share of HBM): assumed, not fitted (sim/constants.py CALIBRATED).
    overlap_slowdown: float = 0.10
    # NCCL's all-to-all over NVLink reaches this share of the NVLink figure (an all-gather bus
    # bandwidth): fitted on MagiAttention's 8-GPU figures (sim/calibrate.py; sim/constants.CALIBRATED)
    a2a_efficiency: float = 0.45
    # NCCL's per-channel p2p rate over the network and the channels of a communicator (above)
    p2p_channel_net_bw: float = P2P_CHANNEL_NET_BW
    p2p_channels: int = P2P_CHANNELS

    def a2a_bandwidth(self, link: LinkClass) -> float:
        """Bytes/s one rank sends in an all-to-all over ``link`` (the NIC figure is already NDR's
        achieved large-message rate; NVLink's is derated by ``a2a_efficiency``)."""
        return self.nvlink_bw * self.a2a_efficiency if link is LinkClass.NVLINK else self.ib_bw

    def a2a_copy_time(self, tensor_bytes: float) -> float:
        """The ``t h d -> h t d`` rearrange before and the inverse after an all-to-all: a
        ``.contiguous()`` read + write each, 4 × the tensor through HBM (``runtime/ulysses.py``)."""
        return 4.0 * tensor_bytes / self.hbm_bw

    def elementwise_time(self, nbytes: float) -> float:
        """A memory-bound kernel moving ``nbytes`` through HBM (merges, accumulations)."""
        return nbytes / self.hbm_bw if nbytes > 0 else 0.0

    def bandwidth(self, link: LinkClass) -> float:
        return self.nvlink_bw if link is LinkClass.NVLINK else self.ib_bw

    def latency(self, link: LinkClass) -> float:
        return self.nvlink_latency if link is LinkClass.NVLINK else self.ib_latency

    def net_flow_bw(self, comm_size: int) -> float:
        """Bytes/s one point-to-point transfer to a network peer reaches in a communicator of
        ``comm_size`` ranks (``net_flow_bw``: NCCL's channels per peer, at most the NIC)."""
        return net_flow_bw(comm_size, self.ib_bw, self.p2p_channel_net_bw, self.p2p_channels)

    def flow_bandwidth(self, link: LinkClass, comm_size: int) -> float:
        """Ceiling of one point-to-point transfer of a plan over ``link`` whose P2P runs on a
        communicator of ``comm_size`` ranks (HSAP: the inter group, ``P_inter``): ``net_flow_bw``
        over InfiniBand, none (inf) over NVLink, where NCCL's p2p is not channel-bound."""
        return self.net_flow_bw(comm_size) if link is LinkClass.INFINIBAND else float("inf")

    def p2p_bandwidth(self, link: LinkClass, comm_size: int) -> float:
        """Bytes/s one point-to-point stream over ``link`` reaches on its own in a communicator of
        ``comm_size`` ranks: the link's rate, capped by ``flow_bandwidth`` (a ring's send to its
        neighbour; the closed-form baselines price their rings' rounds at it)."""
        return min(self.bandwidth(link), self.flow_bandwidth(link, comm_size))


# --- the kernel model's constants ---------------------------------------------------------
TILE = 128  # FA2/FA3 causal hdim-128 tile edge (flash-attention flash_fwd_launch_template.h, hopper/tile_size.h)
MBLOCK_OVERHEAD = 0.8  # prologue/epilogue tiles per row tile (fitted to workloads.md's short-document points)
HALF_RATE_TOKENS = 390.0  # KernelCurve: efficiency(n) = n / (n + 390) (the older saturating curve)
LAUNCH_S = 5e-6  # fixed cost of one kernel call
# Seconds per CTA of FA3's varlen backward grid (KernelModel.grid_time): fitted on MagiAttention's
# 8-GPU figures by `megatron-hsap simulate calibrate --refit` (sim/calibrate.py), a property of
# the software, so every set carries it.
CTA_S = 6e-9
OVERLAP_SLOWDOWN = 0.10  # Hardware.overlap_slowdown
A2A_EFFICIENCY = 0.45  # Hardware.a2a_efficiency


def tile_efficiency(tokens: int) -> float:
    """The tile model's efficiency of one causal document of ``tokens`` (no GQA packing)."""
    pairs = float(staircase_pairs(tokens))
    m = math.ceil(tokens / TILE)
    per_row = min(max(pairs / tokens / TILE + 0.5, 1.0), math.ceil(tokens / TILE))
    return min(1.0, pairs / (m * (per_row + MBLOCK_OVERHEAD) * TILE * TILE))


def peak_for(rate_at: float, tokens: int) -> float:
    """Asymptotic rate whose tile-model value on one causal document of ``tokens`` is the
    measured ``rate_at`` (the workloads.md figures are causal single-sequence benchmarks)."""
    return rate_at / tile_efficiency(tokens)


def _kernel(fwd_at: float, bwd_at: float, tokens: int, **fa3: bool) -> KernelModel:
    return KernelModel(fwd_peak=peak_for(fwd_at, tokens), bwd_peak=peak_for(bwd_at, tokens),
                       curve=KernelCurve(half_rate_tokens=HALF_RATE_TOKENS, launch_s=LAUNCH_S), cta_s=CTA_S, tile=TILE,
                       mblock_overhead=MBLOCK_OVERHEAD, **fa3)


# workloads.md: FA2 (d 128) ~205 / ~174 TFLOP/s at 8K causal on the A100; FA2 on the H100 ~335–370
# (midpoint 350) / ~322 at 16K; FA3 ~616–648 (midpoint 632) / ~561 at 16K. FA3's forward packs GQA
# heads into tile rows, its backward adds fp32 dK/dV per q head with atomics (KernelModel).
A100_KERNEL = _kernel(205e12, 174e12, 8192)
H100_KERNEL = _kernel(350e12, 322e12, 16384)
H100_FA3_KERNEL = _kernel(632e12, 561e12, 16384, pack_gqa=True, gqa_dkv_accum=True)

# docs/design.md §4 reference constants: FA2 peaks ~205/~174 derated to 190/170; NCCL ~230 GB/s NVLink,
# HDR 200 Gb/s ≈ 23 GB/s per GPU; 10 µs per round inside a node, 15 µs across nodes.
A100 = Hardware(
    name="a100",
    attn_fwd_flops=190e12,
    attn_bwd_flops=170e12,
    nvlink_bw=230e9,
    ib_bw=23e9,
    nvlink_latency=10e-6,
    ib_latency=15e-6,
    dense_peak_flops=312e12,
    kernel=A100_KERNEL,
    hbm_bw=1.6e12,  # A100-SXM4-80GB HBM2e 2,039 GB/s (NVIDIA datasheet); elementwise kernels reach ~80%
)

# H100 SXM: FA2 ~335–370 fwd / ~322 bwd (derated like the A100 set), NVLink NCCL ~370 GB/s,
# NDR 400 Gb/s ≈ 48 GB/s per GPU.
H100 = Hardware(
    name="h100",
    attn_fwd_flops=330e12,
    attn_bwd_flops=300e12,
    nvlink_bw=370e9,
    ib_bw=48e9,
    nvlink_latency=10e-6,
    ib_latency=15e-6,
    dense_peak_flops=989e12,
    kernel=H100_KERNEL,
    hbm_bw=2.7e12,  # H100 SXM HBM3 3.35 TB/s (NVIDIA datasheet), ~80% achieved
)

# H100 running FlashAttention-3 (workloads.md: ~616–648 fwd, ~561 bwd at 16K), derated.
H100_FA3 = Hardware(
    name="h100-fa3",
    attn_fwd_flops=600e12,
    attn_bwd_flops=530e12,
    nvlink_bw=370e9,
    ib_bw=48e9,
    nvlink_latency=10e-6,
    ib_latency=15e-6,
    dense_peak_flops=989e12,
    kernel=H100_FA3_KERNEL,
    hbm_bw=2.7e12,
)

# H200 SXM (NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOP/s dense BF16 like the H100, 141 GB
# HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional; nodes with ConnectX-7 NDR 400 Gb/s per GPU):
# the H100's compute and link figures — attention kernels are compute-bound at these block sizes.
H200 = replace(H100, name="h200")

HARDWARE = {hw.name: hw for hw in (A100, H100, H100_FA3, H200)}

# GPU product names (torch.cuda.get_device_name) -> constant set; the first match wins.
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("A100", "a100"), ("A800", "a100"))


def hardware_for_device(device_name: str) -> str | None:
    """The constant set for a GPU product name (``"NVIDIA H200"`` -> ``"h200"``); None when unknown."""
    upper = device_name.upper()
    return next((name for key, name in _DEVICE_NAMES if key in upper), None)


def link_class_for(cp_world: int, gpus_per_node: int = 8) -> LinkClass:
    """docs/design.md §4: NVLink when the whole CP group (TP × P_intra × P_inter ranks) fits one node."""
    return LinkClass.NVLINK if cp_world <= gpus_per_node else LinkClass.INFINIBAND

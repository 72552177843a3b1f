"""Validated simulator configuration: the modelled GPU, its links and its kernels.

``sim_hardware(name)`` builds a ``SimHardware`` from ``constants.HARDWARE``; ``load_overrides``
reads a YAML file (``{hardware: {a100: {ib_bw: 25e9}}, merge_bytes: {...}}``) so users can
calibrate to their own cluster without editing code. Kernel time of one block of one document:

    t = flops / (peak · eff(min(n_q, n_kv))),   eff(n) = n / (n + half_rate_tokens)

(``KernelCurve`` of ``plan/hardware.py``), plus ``launch_s`` once per kernel call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import KernelCurve, LinkClass
from megatron_hsap.sim import constants

__all__ = ["SimHardware", "KernelModel", "sim_hardware", "load_overrides", "reset_overrides", "merge_bytes", "HARDWARE_NAMES"]

HARDWARE_NAMES = tuple(constants.HARDWARE)


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

    def rows(self, nq: np.ndarray | int, group: int, phase: str) -> np.ndarray | int:
        """Tile rows a block of ``nq`` q tokens fills (``group`` = q heads per kv head)."""
        return nq * group if (self.pack_gqa and phase == "fwd" and group > 1) else nq

    def efficiency(self, nq: np.ndarray | int, nk: np.ndarray | int, pairs: np.ndarray | None = None,
                   phase: str = "fwd", group: int = 1) -> np.ndarray:
        """Kernel efficiency in (0, 1] of blocks ``[n]`` (``nq`` q tokens, ``nk`` keys, ``pairs``
        unmasked (q, k) pairs; ``pairs`` None means a full block). Arrays broadcast."""
        nq = np.maximum(1.0, np.asarray(nq, dtype=np.float64))
        nk = np.maximum(1.0, np.asarray(nk, dtype=np.float64))
        if self.tile <= 0:
            n = np.minimum(self.rows(nq, group, phase), nk)
            return n / (n + self.curve.half_rate_tokens)
        T = float(self.tile)
        pr = nq * nk if pairs is None else np.maximum(1.0, np.asarray(pairs, dtype=np.float64))
        g = group if (self.pack_gqa and phase == "fwd" and group > 1) else 1
        m = np.ceil(nq * g / T)
        per_row = np.clip(pr / nq / T + 0.5, 1.0, np.ceil(nk / T))
        return np.minimum(1.0, pr * g / ((m * (per_row + self.mblock_overhead)) * T * T))

    def rate(self, nq: np.ndarray | int, nk: np.ndarray | int, phase: str, group: int = 1,
             pairs: np.ndarray | None = None) -> np.ndarray:
        peak = self.fwd_peak if phase == "fwd" else self.bwd_peak
        return peak * self.efficiency(nq, nk, pairs, phase, group)

    def blocks_time(self, nq: np.ndarray, nk: np.ndarray, flops: np.ndarray, phase: str, group: int = 1,
                    pairs: np.ndarray | None = None) -> float:
        """Seconds for blocks ``[n]`` of ``flops`` each (``pairs`` each), without any launch cost."""
        if len(flops) == 0:
            return 0.0
        return float((np.asarray(flops, dtype=np.float64) / self.rate(nq, nk, phase, group, pairs)).sum())

    def blocks_time_py(self, blocks: list[tuple[int, int, float, float]], phase: str, group: int = 1) -> float:
        """``blocks_time`` for a short list of ``(nq, nk, flops, pairs)`` without numpy overhead
        (the same formulas, term by term)."""
        if not blocks:
            return 0.0
        peak = self.fwd_peak if phase == "fwd" else self.bwd_peak
        g = group if (self.pack_gqa and phase == "fwd" and group > 1) else 1
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

    def grid_time(self, max_nq: float, max_nk: float, n_blocks: int, heads: int, phase: str) -> float:
        """Scheduling cost of a varlen *backward* call's grid: FlashAttention-3's backward sizes it
        by the longest kv block, ``⌈max_nk / 128⌉ × heads × n_blocks`` CTAs, most of which exit at
        once when blocks differ in length (its forward walks only real tiles with a varlen-aware
        persistent scheduler: no cost). ``cta_s`` per CTA (averaged over the SMs) is fitted in
        ``sim/calibrate.py``; 0 leaves the model as before."""
        if self.cta_s <= 0 or n_blocks == 0 or phase == "fwd":
            return 0.0
        return self.cta_s * float(np.ceil(max_nk / 128.0)) * heads * n_blocks

    def gqa_accum_time(self, nk: np.ndarray, shape: "HeadShapeLike", phase: str, hbm_bw: float) -> float:
        """FlashAttention-3's backward with GQA (``gqa_dkv_accum``): every (kv tile, q head) CTA
        adds its fp32 dK/dV partial (tile × (d + dv) × 4 bytes) into the per-kv-head accumulator
        with atomics (hopper/epilogue_bwd.hpp ``CollectiveEpilogueBwdGQA``), a read-modify-write in
        HBM once the accumulator exceeds L2. Negligible for long blocks (the CTA's own work
        dwarfs it), dominant for skinny ones (a few q rows against many keys). ``nk``: ``[n]``."""
        if not self.gqa_dkv_accum or phase == "fwd" or shape.num_heads <= shape.num_kv_heads or len(nk) == 0:
            return 0.0
        T = float(self.tile or 128)
        tiles = float(np.ceil(np.asarray(nk, dtype=np.float64) / T).sum())
        return tiles * shape.num_heads * T * (shape.head_dim + shape.head_dim_v) * 4 * 2 / hbm_bw

    def call_time(self, nq: np.ndarray, nk: np.ndarray, flops: np.ndarray, phase: str) -> float:
        """One varlen kernel call over several document blocks (``[n]`` arrays)."""
        return self.curve.launch_s + self.blocks_time(nq, nk, flops, phase)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimHardware:
    """One modelled GPU type and its links (bytes/s, seconds, FLOP/s)."""

    name: str
    kernel: KernelModel
    nvlink_bw: float
    ib_bw: float
    nvlink_latency: float
    ib_latency: float
    hbm_bw: float
    dense_peak_flops: float
    gpus_per_node: int = 8
    dense_mfu: float = constants.DENSE_MFU
    # Calibrated efficiencies (sim/calibrate.py fits them on MagiAttention's 8-GPU figures):
    a2a_efficiency: float = 1.0  # NCCL all-to-all: achieved / link bandwidth
    collective_efficiency: float = 1.0  # NCCL ring all-gather / reduce-scatter: achieved / link bandwidth
    te_step_s: float = 0.0  # host + launch overhead of one step of TE's THD p2p ring (seconds)
    overlap_slowdown: float = 0.0  # kernel slowdown while NCCL transfers run beside it (SM/HBM contention)
    # NCCL's own cost model (constants.NCCL; docs/design.md §2.4): point-to-point channels to a network
    # peer and what one drives, ring latencies per step by link, all-to-all peers per round
    # MagiAttention's FA3 baselines call the kernel through exps/dist_attn/baselines/utils_cp.py
    # ``_fa3_varlen_forward`` / ``_backward``: every call first gathers its inputs to real tokens
    # (``fa_varlen_thd_unpad`` of q, k, v; backward also out, dout, lse) and scatters its outputs
    # back into zero-filled padded tensors (``fa_varlen_thd_pad``): HBM copies priced by
    # ``Builder.fa3_wrapper``. True for ``h100-fa3`` (that harness); HSAP never pays them.
    fa3_wrapper_copies: bool = False
    p2p_channel_net_bw: float = float("inf")  # bytes/s one p2p channel drives over the network
    p2p_channels: int = 32  # p2p channels of a communicator (p2pnChannels)
    nccl_base_latency: float = 0.0  # ring collective base latency (Simple protocol)
    nccl_nvlink_step_latency: float = 0.0  # per ring step inside a node
    nccl_net_step_latency: float = 0.0  # per ring step that crosses the network

    def __post_init__(self) -> None:
        for name in ("nvlink_bw", "ib_bw", "hbm_bw", "dense_peak_flops"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("nvlink_latency", "ib_latency"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hardware {self.name}: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"hardware {self.name}: gpus_per_node must be >= 1")
        if not 0 < self.dense_mfu <= 1:
            raise ConfigError(f"hardware {self.name}: dense_mfu must be in (0, 1]")
        if not 0 <= self.overlap_slowdown < 1:
            raise ConfigError(f"hardware {self.name}: overlap_slowdown must be in [0, 1), got {self.overlap_slowdown!r}")
        if self.te_step_s < 0:
            raise ConfigError(f"hardware {self.name}: te_step_s must be >= 0, got {self.te_step_s!r}")
        if not self.p2p_channel_net_bw > 0 or self.p2p_channels < 1:
            raise ConfigError(f"hardware {self.name}: p2p_channel_net_bw must be > 0 and p2p_channels >= 1")
        for name in ("nccl_base_latency", "nccl_nvlink_step_latency", "nccl_net_step_latency"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hardware {self.name}: {name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("a2a_efficiency", "collective_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"hardware {self.name}: {name} must be in (0, 1], got {getattr(self, name)!r}")

    def bandwidth(self, link: LinkClass) -> float:
        return self.nvlink_bw if link is LinkClass.NVLINK else self.ib_bw

    def latency(self, link: LinkClass) -> float:
        return self.nvlink_latency if link is LinkClass.NVLINK else self.ib_latency

    def elementwise_time(self, nbytes: float) -> float:
        """A memory-bound kernel moving ``nbytes`` through HBM (merges, accumulations)."""
        return nbytes / self.hbm_bw if nbytes > 0 else 0.0


_OVERRIDES: dict[str, dict[str, Any]] = {}
_MERGE_OVERRIDES: dict[str, dict[str, float]] = {}


def sim_hardware(name: str) -> SimHardware:
    """The ``SimHardware`` of ``name`` (``a100``, ``h100``, ``h100-fa3``), overrides applied."""
    if name not in constants.HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)}")
    c = {**constants.HARDWARE[name], **_OVERRIDES.get(name, {})}
    curve = KernelCurve(half_rate_tokens=float(c["half_rate_tokens"]), launch_s=float(c["launch_s"]))
    for key in ("attn_fwd_peak", "attn_bwd_peak"):
        if not float(c[key]) > 0:
            raise ConfigError(f"hardware {name}: {key} must be > 0, got {c[key]!r}")
    return SimHardware(
        name=name,
        kernel=KernelModel(fwd_peak=float(c["attn_fwd_peak"]), bwd_peak=float(c["attn_bwd_peak"]), curve=curve,
                           cta_s=float(c.get("cta_s", 0.0)), pack_gqa=bool(c.get("pack_gqa", False)),
                           tile=int(c.get("tile", 0)), mblock_overhead=float(c.get("mblock_overhead", 0.8)),
                           gqa_dkv_accum=bool(c.get("gqa_dkv_accum", False))),
        nvlink_bw=float(c["nvlink_bw"]),
        ib_bw=float(c["ib_bw"]),
        nvlink_latency=float(c["nvlink_latency"]),
        ib_latency=float(c["ib_latency"]),
        hbm_bw=float(c["hbm_bw"]),
        dense_peak_flops=float(c["dense_peak_flops"]),
        gpus_per_node=int(c["gpus_per_node"]),
        dense_mfu=float(c.get("dense_mfu", constants.DENSE_MFU)),
        a2a_efficiency=float(c.get("a2a_efficiency", 1.0)),
        collective_efficiency=float(c.get("collective_efficiency", 1.0)),
        te_step_s=float(c.get("te_step_s", 0.0)),
        overlap_slowdown=float(c.get("overlap_slowdown", 0.0)),
        fa3_wrapper_copies=bool(c.get("fa3_wrapper_copies", False)),
        p2p_channel_net_bw=float(c.get("p2p_channel_net_bw", float("inf"))),
        p2p_channels=int(c.get("p2p_channels", 32)),
        nccl_base_latency=float(c.get("nccl_base_latency", 0.0)),
        nccl_nvlink_step_latency=float(c.get("nccl_nvlink_step_latency", 0.0)),
        nccl_net_step_latency=float(c.get("nccl_net_step_latency", 0.0)),
    )


def merge_bytes(impl: str, phase: str, key: str | None = None) -> float:
    """HBM bytes per element of one merge (``phase`` fwd) or accumulation (bwd) of ``impl``."""
    table = {**constants.MERGE_BYTES.get(impl, {}), **_MERGE_OVERRIDES.get(impl, {})}
    if not table:
        raise ConfigError(f"unknown implementation {impl!r}; choose one of {', '.join(constants.MERGE_BYTES)}")
    return float(table.get(key or phase, 0.0))


def load_overrides(path: str | Path) -> None:
    """Apply a YAML file of overrides (process-wide): ``hardware: {name: {field: value}}`` and
    ``merge_bytes: {impl: {fwd|bwd: value}}``. Unknown names raise ``ConfigError``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read simulator config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys 'hardware' and/or 'merge_bytes'")
    unknown = set(data) - {"hardware", "merge_bytes"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: hardware, merge_bytes")
    for name, fields in (data.get("hardware") or {}).items():
        if name not in constants.HARDWARE:
            raise ConfigError(f"{path}: unknown hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)}")
        bad = set(fields) - set(constants.HARDWARE[name]) - {"dense_mfu"}
        if bad:
            raise ConfigError(f"{path}: hardware {name} has no fields {sorted(bad)}")
        _OVERRIDES.setdefault(name, {}).update({k: float(v) for k, v in fields.items()})
        sim_hardware(name)  # validate now, not at first use
    for impl, fields in (data.get("merge_bytes") or {}).items():
        if impl not in constants.MERGE_BYTES:
            raise ConfigError(f"{path}: unknown implementation {impl!r} in merge_bytes")
        _MERGE_OVERRIDES.setdefault(impl, {}).update({k: float(v) for k, v in fields.items()})


def reset_overrides() -> None:
    """Forget every ``load_overrides`` (tests)."""
    _OVERRIDES.clear()
    _MERGE_OVERRIDES.clear()


def with_links(hw: SimHardware, **changes: Any) -> SimHardware:
    """A copy of ``hw`` with some fields changed (tests, what-if studies)."""
    return replace(hw, **changes)

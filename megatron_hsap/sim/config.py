"""Validated simulator configuration: the modelled GPU, its links and its kernels.

``sim_hardware(name)`` builds a ``SimHardware`` from ``constants.HARDWARE``; ``load_overrides``
reads a YAML file (``{hardware: {a100: {ib_bw: 25e9}}, merge_bytes: {...}}``) so users can
calibrate to their own cluster without editing code. Kernel time of one block of one document:

    t = flops / (peak · eff(min(n_q, n_kv))),   eff(n) = n / (n + half_rate_tokens)

(``KernelCurve`` of ``plan/hardware.py``), plus ``launch_s`` once per kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import KernelCurve, LinkClass
from megatron_hsap.sim import constants

__all__ = ["SimHardware", "KernelModel", "sim_hardware", "load_overrides", "reset_overrides", "merge_bytes", "HARDWARE_NAMES"]

HARDWARE_NAMES = tuple(constants.HARDWARE)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelModel:
    """Attention kernel time by block shape. Rates in FLOP/s (asymptotic peaks of the curve)."""

    fwd_peak: float
    bwd_peak: float
    curve: KernelCurve = field(default_factory=KernelCurve)
    cta_s: float = 0.0  # seconds per grid CTA of a varlen call (see grid_time)

    def efficiency(self, nq: np.ndarray | int, nk: np.ndarray | int) -> np.ndarray:
        """eff(min(nq, nk)) in (0, 1); arrays broadcast. Shapes: ``[n]`` -> ``[n]``."""
        n = np.maximum(1, np.minimum(np.asarray(nq, dtype=np.float64), np.asarray(nk, dtype=np.float64)))
        return n / (n + self.curve.half_rate_tokens)

    def rate(self, nq: np.ndarray | int, nk: np.ndarray | int, phase: str) -> np.ndarray:
        peak = self.fwd_peak if phase == "fwd" else self.bwd_peak
        return peak * self.efficiency(nq, nk)

    def blocks_time(self, nq: np.ndarray, nk: np.ndarray, flops: np.ndarray, phase: str) -> float:
        """Seconds for blocks ``[n]`` of ``flops`` each, without any launch cost."""
        if len(flops) == 0:
            return 0.0
        return float((np.asarray(flops, dtype=np.float64) / self.rate(nq, nk, phase)).sum())

    def blocks_time_py(self, blocks: list[tuple[int, int, float]], phase: str) -> float:
        """``blocks_time`` for a short list of ``(nq, nk, flops)`` without numpy overhead."""
        peak = self.fwd_peak if phase == "fwd" else self.bwd_peak
        half = self.curve.half_rate_tokens
        total = 0.0
        for nq, nk, flops in blocks:
            n = max(1, min(nq, nk))
            total += flops * (n + half) / (peak * n)
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
                           cta_s=float(c.get("cta_s", 0.0))),
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

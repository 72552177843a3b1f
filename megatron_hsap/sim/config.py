"""Validated simulator configuration: the modelled GPU, its links and its kernels.

``sim_hardware(name)`` builds a ``SimHardware`` from ``constants.HARDWARE``; ``load_overrides``
reads a YAML file (``{hardware: {a100: {ib_bw: 25e9}}, merge_bytes: {...}}``) so users can
calibrate to their own cluster without editing code. Kernel time of one block of one document:

    t = flops / (peak · eff(min(n_q, n_kv))),   eff(n) = n / (n + half_rate_tokens)

(``KernelCurve`` of ``plan/hardware.py``), plus ``launch_s`` once per kernel call. The kernel
model (``KernelModel``, the tile model) lives in ``plan/hardware.py`` — one home for the planner
and the simulator; it is re-exported here. Without overrides ``sim_hardware(name).kernel`` equals
``plan.hardware.HARDWARE[name].kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import KernelCurve, KernelModel, LinkClass
from megatron_hsap.plan.ir import Phase
from megatron_hsap.sim import constants

__all__ = ["SimHardware", "KernelModel", "sim_hardware", "load_overrides", "reset_overrides", "merge_bytes", "HARDWARE_NAMES"]

HARDWARE_NAMES = tuple(constants.HARDWARE)


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
    # MagiAttention's FA3 baselines call the kernel through exps/dist_attn/baselines/utils_cp.py
    # ``_fa3_varlen_forward`` / ``_backward``: every call first gathers its inputs to real tokens
    # (``fa_varlen_thd_unpad`` of q, k, v; backward also out, dout, lse) and scatters its outputs
    # back into zero-filled padded tensors (``fa_varlen_thd_pad``): HBM copies priced by
    # ``Builder.fa3_wrapper``. True for ``h100-fa3`` (that harness); HSAP never pays them.
    fa3_wrapper_copies: bool = False
    # NCCL's own cost model (docs/design.md §2.4): point-to-point channels to a network peer and what
    # one drives (plan/hardware.py P2P_*, read through constants._from_plan; these defaults, no cap,
    # serve hand-made sets only), ring latencies per step by link (constants.NCCL)
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


def merge_bytes(impl: str, phase: Phase | str, key: str | None = None) -> float:
    """HBM bytes per element of one merge (``phase`` fwd) or accumulation (bwd) of ``impl``."""
    table = {**constants.MERGE_BYTES.get(impl, {}), **_MERGE_OVERRIDES.get(impl, {})}
    if not table:
        raise ConfigError(f"unknown implementation {impl!r}; choose one of {', '.join(constants.MERGE_BYTES)}")
    return float(table.get(key or Phase(phase), 0.0))


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

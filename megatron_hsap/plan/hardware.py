"""Hardware constants (pure data) shared by the planner's cost model and the simulator.

Sources: ``shared/workloads.md`` ("Hardware constants for the simulator") and docs/design.md §4.
The planner and every bound use the *flat* rates here; the kernel-rate curve by block shape
(``KernelCurve``) is used only by the simulator and the GPU check.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


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
    kernel: KernelCurve = KernelCurve()

    def bandwidth(self, link: LinkClass) -> float:
        return self.nvlink_bw if link is LinkClass.NVLINK else self.ib_bw

    def latency(self, link: LinkClass) -> float:
        return self.nvlink_latency if link is LinkClass.NVLINK else self.ib_latency


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

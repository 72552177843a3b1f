"""Simulator constants (pure data), each with its source.

Most numbers come from ``shared/workloads.md`` ("Hardware constants for the simulator"); the
planner's flat rates (``megatron_hsap.plan.hardware``) are the *derated* versions of the same
figures. The simulator instead uses the measured FlashAttention rates at a reference block size
and spreads them over block shapes with ``KernelCurve`` (rate(n) = peak · n / (n + 390)), so
that short documents run below peak (workloads.md: FA2 causal forward at 512 tokens ~57% of its
16K rate, at 1K ~78%).

Anything not in workloads.md says where it comes from. ``megatron_hsap.sim.config`` turns this
table into a validated ``SimConfig`` and lets a YAML file override any field.
"""

from __future__ import annotations

from typing import Any

# The kernel model's constants live in plan/hardware.py (one home for the planner and the
# simulator): the tile, the prologue overhead, the launch cost, the peaks derived from the
# workloads.md rates, the HBM bandwidth and HSAP's merge bytes. This table reads them.
from megatron_hsap.plan import hardware as _plan_hw
from megatron_hsap.plan.ir import Phase

HALF_RATE_TOKENS = _plan_hw.HALF_RATE_TOKENS
TILE = _plan_hw.TILE
MBLOCK_OVERHEAD = _plan_hw.MBLOCK_OVERHEAD
_tile_efficiency = _plan_hw.tile_efficiency
_peak = _plan_hw.peak_for


def _from_plan(name: str) -> dict[str, Any]:
    """The kernel and link fields of ``plan.hardware.HARDWARE[name]`` in this table's keys."""
    h = _plan_hw.HARDWARE[name]
    k = h.kernel
    return {"attn_fwd_peak": k.fwd_peak, "attn_bwd_peak": k.bwd_peak, "half_rate_tokens": k.curve.half_rate_tokens,
            "launch_s": k.curve.launch_s, "nvlink_bw": h.nvlink_bw, "ib_bw": h.ib_bw, "nvlink_latency": h.nvlink_latency,
            "ib_latency": h.ib_latency, "dense_peak_flops": h.dense_peak_flops, "hbm_bw": h.hbm_bw, "gpus_per_node": h.gpus_per_node,
            "p2p_channel_net_bw": h.p2p_channel_net_bw, "p2p_channels": h.p2p_channels}


HARDWARE: dict[str, dict[str, Any]] = {
    # A100 SXM. workloads.md: FA2 (d 128) ~205 TFLOP/s forward, ~174 backward at 8K causal;
    # NVLink NCCL ~230 GB/s per GPU; HDR 200 Gb/s NIC per GPU ~23 GB/s achieved; NCCL op
    # latency ~8-10 us intra-node, ~10-20 us over the network; bf16 dense peak 312 TFLOP/s.
    "a100": _from_plan("a100"),
    # H100 SXM with FlashAttention-2. workloads.md: FA2 ~335-370 forward (midpoint 350), ~322
    # backward at 16K; NVLink NCCL ~370 GB/s; NDR 400 Gb/s ~48 GB/s; dense peak 989.
    "h100": _from_plan("h100"),
    # H100 SXM with FlashAttention-3 (the class of kernel MagiAttention's benchmark runs).
    # workloads.md: FA3 ~616-648 forward (midpoint 632), ~561 backward at 16K.
    "h100-fa3": _from_plan("h100-fa3"),
}

# NCCL's own cost model, read from its source (NVIDIA/nccl), the same for every GPU type here:
#   src/graph/tuning.cc (2.19-2.28): ring Simple protocol baseLat 8.4 µs, hwLat per step 3.4 µs on
#     NVLink and 14 µs on the network; ring all-gather / reduce-scatter latency
#     = baseLat + (nRanks−1−(nNodes−1))·NVLink step + (nNodes−1)·network step (Cluster.ring_latency).
#   src/graph/paths.cc: the point-to-point channels to a network peer and what one drives
#     (p2p_channel_net_bw 14 GB/s, p2p_channels 16, 2 channels per peer halved with the rank
#     count: a 64-rank communicator drives each network peer with ONE channel, an 8-rank one with
#     two) live in plan/hardware.py (P2P_CHANNEL_NET_BW, net_channels_per_peer) with their
#     citation, shared with the planner's estimate; _from_plan above reads them.
NCCL: dict[str, float] = {"nccl_base_latency": 8.4e-6, "nccl_nvlink_step_latency": 3.4e-6, "nccl_net_step_latency": 14e-6}
for _hw in HARDWARE.values():
    _hw.update(NCCL)
# Kernel time by block shape: the tile model of sim/config.py KernelModel (128 × 128 tiles, FA2
# and FA3 causal hdim 128: Dao-AILab/flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h,
# hopper/tile_size.h), 0.8 tile of prologue / epilogue per row tile (fitted to the two
# short-document points of workloads.md, not to any published CP figure). FlashAttention-3's
# forward packs GQA heads into the tile rows (KernelModel.pack_gqa), its backward adds fp32 dK/dV
# per q head with atomics (KernelModel.gqa_dkv_accum); MagiAttention's harness wraps each FA3 call
# in unpad / pad copies (SimHardware.fa3_wrapper_copies; HSAP's runtime does not).
for _hw in HARDWARE.values():
    _hw.update({"tile": TILE, "mblock_overhead": MBLOCK_OVERHEAD})
HARDWARE["h100-fa3"].update({"pack_gqa": True, "gqa_dkv_accum": True, "fa3_wrapper_copies": True})
assert all(bool(HARDWARE[n].get("pack_gqa")) == _plan_hw.HARDWARE[n].kernel.pack_gqa for n in HARDWARE)

# Software efficiencies no datasheet gives (NCCL's all-to-all and ring all-gather/reduce-scatter
# against the NVLink figure, the empty-CTA cost of FA3's varlen backward grid, a fixed cost per
# communicating step of the FA3/TE THD p2p ring), fitted on MagiAttention's 8-GPU figures by
# `megatron-hsap simulate calibrate --refit` (sim/calibrate.py; its 64-GPU figures are a check,
# never fitted). They are properties of the software, so every hardware set gets them: one set of
# constants for every method and every table (ring-flash-attention's A100 validation stays within
# 15% with them).
CALIBRATED: dict[str, float] = {"a2a_efficiency": _plan_hw.A2A_EFFICIENCY, "collective_efficiency": 0.575, "cta_s": _plan_hw.CTA_S, "te_step_s": 0.925e-3,
                                # assumed, not fitted (no 8-GPU point isolates it): while a transfer is in
                                # flight NCCL holds one CTA per channel (2-16 of 132 SMs) and a share of HBM
                                "overlap_slowdown": _plan_hw.OVERLAP_SLOWDOWN}
for _hw in HARDWARE.values():
    _hw.update(CALIBRATED)

# Bytes of HBM traffic per output element of one merge / accumulate step, by implementation
# (read from each code base; the element counts are n_rows x heads x head_dim):
#   hsap: the fused Triton merge on the GPU (runtime/fused_merge.py): read fp32 acc 4 + bf16
#         part 2 + write 4 -> 10 (the eager fallback, runtime/merge.py ``out_acc.mul_(w).addcmul_
#         (part, w)``, moves 18: plan/hardware.MERGE_FWD_BYTES_EAGER); backward ``+=`` into fp32
#         grads: 4+4+4. Both from plan/hardware.py (one home).
#   te: Transformer Engine's fused ``thd_out_correction``: read fp32 acc 4 + bf16 part 2 +
#       write 4 -> 10; backward adds in place like HSAP (12).
#   ring_flash_attn: ``update_out_and_lse`` under torch.jit.script (fused after warm-up):
#       part .to(fp32) 2+4, then fused exp/mul/add read 4 + 4, write 4 -> 18; the zigzag
#       varlen path also gathers and scatters ``out[half_index1]`` (boolean index: +16 on the
#       back half, i.e. +8 per element). Backward ``dq += buffer`` (fp32 += bf16): 4+2+4 = 10.
#   distflashattn: LightSeq's Triton rescale kernel, like TE: 10 / 12.
MERGE_BYTES: dict[str, dict[str, float]] = {
    "hsap": {Phase.FWD: _plan_hw.MERGE_FWD_BYTES, Phase.BWD: _plan_hw.MERGE_BWD_BYTES},
    "fa3": {Phase.FWD: 10.0, Phase.BWD: 12.0},  # MagiAttention's FA3 ring baselines: a fused correction like TE's
    "te": {Phase.FWD: 10.0, Phase.BWD: 12.0},
    "ring_flash_attn": {Phase.FWD: 18.0, Phase.BWD: 10.0, "half_index_extra": 8.0},
    "distflashattn": {Phase.FWD: 10.0, Phase.BWD: 12.0},
}

# GPT FLOP model for the non-attention part (Table 4): matmul FLOPs at a fixed fraction of the
# dense bf16 peak. 0.52 is Megatron-LM's published A100 figure (Narayanan et al., SC'21:
# 163 TFLOP/s per GPU, 52% of peak, on GPT models up to 1T parameters).
DENSE_MFU = 0.52

# LLaMA-2-7B (Touvron et al. 2023, Table/config on the Hugging Face hub): 32 layers, hidden 4096,
# 32 heads of 128, SwiGLU FFN 11008, vocabulary 32000.
LLAMA2_7B: dict[str, int] = {
    "layers": 32,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 32,
    "head_dim": 128,
    "ffn": 11008,
    "vocab": 32000,
}

SOURCES = (
    "shared/workloads.md 'Hardware constants for the simulator' (rates, links, latencies); "
    "NVIDIA A100/H100 datasheets (HBM); Narayanan et al. SC'21 (MFU 0.52); LLaMA-2 config"
)

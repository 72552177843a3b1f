"""Calibration against published numbers: MagiAttention's varlen-causal H100 benchmark.

One set of physical constants for every method (``constants.HARDWARE["h100-fa3"]``, docs/design.md
§8), in three groups:

* **from datasheets and NCCL's source** (never fitted): link rates and latencies (workloads.md);
  NCCL's ring latency per step by link and its growth with the rank count (``src/graph/tuning.cc``),
  its channels per network peer (2, halved with the communicator's size: a 64-rank ring drives each
  cross-node peer with one channel of ``P2P_PER_CHANNEL_NET_BW`` = 14 GB/s, ``src/graph/paths.cc``),
  all-to-all peers per round; rail-aware rings across nodes (``Cluster.ring_collective_time``);
  small messages are latency-bound through the Hockney form ``latency + bytes / rate`` of every
  transfer;
* **the kernel by block shape**: a tile model (128 × 128 tiles, 0.8 tile of prologue/epilogue per
  row tile, from workloads.md's short-document points), FA3's GQA packing in the forward
  (``hopper/heuristics.h``), its backward's fp32 dK/dV atomics per q head, and the unpad / pad
  copies of MagiAttention's FA3 wrappers (``exps/dist_attn/baselines/utils_cp.py``);
* **four software efficiencies no datasheet gives**, *fitted on the 8-GPU points only* and then
  *checked on the 64-GPU points* (``PARAMS``): ``a2a_efficiency`` (NCCL all-to-all over NVLink),
  ``collective_efficiency`` (NCCL ring all-gather / reduce-scatter), ``cta_s`` (an empty CTA of FA3's
  varlen backward grid, sized by the longest kv block: ⌈max_nk / 128⌉ × heads × documents CTAs) and
  ``te_step_s`` (a fixed cost per communicating step of the FA3/TE THD p2p ring: ``thd_read_half_tensor``
  calls, per-step ``cu_seqlens``, launches from Python). Megatron hybrid CP is fitted by nothing: a
  pure check at both sizes. ``overlap_slowdown`` (SM contention of NCCL kernels beside compute) is
  assumed, not fitted: no 8-GPU point isolates it.

Each efficiency is fitted by a 1-D grid search minimising the worst relative error of the 8-GPU
points that depend on it (one after another: collective efficiency before the CTA cost, since the
backward point depends on both). Batches: ``protocols.magi_batches`` (MagiAttention's histogram,
chunking and packing), the mean of TFLOP/s over ``seeds`` batches — MagiAttention averages over
its masks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megatron_hsap.plan.ir import Phase
from megatron_hsap.sim import paper
from megatron_hsap.sim.config import SimHardware, sim_hardware
from megatron_hsap.sim.methods import run_method
from megatron_hsap.sim.protocols import MAGI_TOKENS_PER_GPU, magi_batches, magi_shape
from megatron_hsap.sim.results import Report, Row, markdown_table

__all__ = ["CalPoint", "simulate_points", "fit", "calibrate", "TOLERANCE", "PARAMS", "MISSING", "DEFAULT_SEEDS"]

TOLERANCE = 0.20  # the issue's "within 20% per point"
DEFAULT_SEEDS = 10  # batches per published point (the mean of TFLOP/s, as MagiAttention averages its masks)
PARAMS = {  # fitted constant -> the (method, phase) 8-GPU points that fit it
    "a2a_efficiency": (("ulysses", Phase.FWD), ("usp", Phase.FWD)),
    "collective_efficiency": (("allgather_kv_zigzag", Phase.FWD),),
    "cta_s": (("allgather_kv_zigzag", Phase.BWD),),
    "te_step_s": (("te_thd_ring", Phase.FWD),),
}
GRIDS = {"cta_s": np.array([0.0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10, 12, 15, 20, 25, 30, 40]) * 1e-9,
         "te_step_s": np.arange(0.0, 1.5001, 0.025) * 1e-3}
# Where a point is out of tolerance, the structural effect the model lacks (read from the sources).
MISSING = {  # keyed by method, or (method, phase) where the phases differ
    "ulysses": "InfiniBand all-to-all below the NIC rate: the model lets each NIC carry its 56 remote peers at "
               "48 GB/s (NCCL: 'alltoall ... should see the performance of a single NIC', nccl-tests#267); the "
               "published figure implies ≈30 GB/s, i.e. fabric contention of 56 concurrent flows per NIC (routing, "
               "congestion control) that no 8-GPU point sees and no public measurement of that cluster gives",
    "te_thd_ring": "the ring's fixed per-step cost at 64 ranks (fitted at 8) and one p2p channel per network peer "
                   "bound the step; a per-step cost that grows with the documents in the batch is not modelled",
    "usp": "the THD ring's per-step cost is fitted on ring-p2p at 8 GPUs (NVLink) and assumed the same across nodes",
    "hybrid_cp": "the BalancedCPScheduler's exact grouping (we place largest-first), its barriers' skew; its "
                 "single-sample rings are modelled without the THD ring's per-step cost (with it: ≈ −29% at 64)",
    ("allgather_kv_zigzag", Phase.FWD): "NCCL's all-gather across 8 nodes by message size (the rail-aware ring is "
                                    "NVLink-bound there at collective_efficiency, fitted at 8)",
    ("allgather_kv_zigzag", Phase.BWD): "FA3's varlen backward grid cost (cta_s per empty CTA, fitted at 8) and its "
                                    "fp32 dK/dV atomics (HBM-bound read-modify-write) at 8× the documents",
}


@dataclass(frozen=True, slots=True)
class CalPoint:
    gpus: int
    method: str
    phase: str
    published: float
    simulated: float

    @property
    def error(self) -> float:
        return self.simulated / self.published - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _set(hw: SimHardware, name: str, value: float) -> SimHardware:
    if name == "cta_s":
        return replace(hw, kernel=replace(hw.kernel, cta_s=value))
    return replace(hw, **{name: value})


def _get(hw: SimHardware, name: str) -> float:
    return hw.kernel.cta_s if name == "cta_s" else float(getattr(hw, name))


def simulate_points(hw: SimHardware, gpus: int, seeds: int, only: tuple[tuple[str, str], ...] | None = None) -> list[CalPoint]:
    """Simulated TFLOP/s per GPU (mean over ``seeds`` batches) at every published point of
    ``gpus`` (or only the ``(method, phase)`` points in ``only``)."""
    shape = magi_shape()
    cus = magi_batches(MAGI_TOKENS_PER_GPU * gpus, seeds, 0)
    out = []
    keys = [(m, ph) for (g, m, ph) in paper.MAGI_PUBLISHED if g == gpus and (only is None or (m, ph) in only)]
    runs: dict[str, list] = {}
    for m, ph in keys:
        if m not in runs:
            runs[m] = [run_method(m, cu, hw=hw, intra=1, inter=gpus, shape=shape) for cu in cus]
        vals = [r.tflops_per_gpu(ph) for r in runs[m] if r is not None]
        out.append(CalPoint(gpus, m, ph, paper.MAGI_PUBLISHED[(gpus, m, ph)], float(np.mean(vals)) if vals else float("nan")))
    return out


def fit(hw: SimHardware, seeds: int) -> tuple[SimHardware, dict[str, float]]:
    """Fit ``PARAMS`` on the 8-GPU points, one after another (collective efficiency before the
    CTA cost, since the backward point depends on both); returns the fitted hardware and values."""
    values: dict[str, float] = {}
    for name, points in PARAMS.items():
        grid = GRIDS.get(name, np.round(np.arange(0.10, 1.0001, 0.025), 3))
        best, best_err = _get(hw, name), float("inf")
        for v in grid:
            pts = simulate_points(_set(hw, name, float(v)), 8, seeds, points)
            err = max(abs(p.error) for p in pts)
            if err < best_err:
                best, best_err = float(v), err
        values[name] = best
        hw = _set(hw, name, best)
    return hw, values


def calibrate(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, refit: bool = False) -> Report:
    """Print the constants and both errors (fit on 8 GPUs, check on 64); ``refit`` re-runs the
    grid search instead of using the committed constants."""
    n = 1 if quick else (seeds or DEFAULT_SEEDS)
    hw = sim_hardware("h100-fa3")
    fitted = {k: _get(hw, k) for k in PARAMS}
    if refit:
        hw, fitted = fit(hw, n)
    pts = simulate_points(hw, 8, n) + ([] if quick else simulate_points(hw, 64, n))
    rows: list[Row] = []
    for p in pts:
        link = "nvlink" if p.gpus <= 8 else "ib"
        T = MAGI_TOKENS_PER_GPU * p.gpus
        rows.append(Row("sim", "magiattention", T, 1, p.gpus, link, "64/8", "mean", p.method, f"{p.phase}_tflops_per_gpu", p.simulated, "TFLOP/s"))
        rows.append(Row("paper:magiattention", "magiattention", T, 1, p.gpus, link, "64/8", "-", p.method, f"{p.phase}_tflops_per_gpu", p.published, "TFLOP/s"))
        rows.append(Row("sim", "magiattention", T, 1, p.gpus, link, "64/8", "mean", p.method, f"{p.phase}_calibration_error", 100 * p.error, "%"))
    k = hw.kernel
    consts = [["attn fwd / bwd peak (FA3)", f"{k.fwd_peak / 1e12:.0f} / {k.bwd_peak / 1e12:.0f} TFLOP/s", "workloads.md FA3 at 16K"],
              ["kernel tile, prologue/epilogue per row tile, launch", f"{k.tile}², {k.mblock_overhead:.1f} tile, {k.curve.launch_s * 1e6:.0f} µs",
               "FA2/FA3 causal hdim-128 tiles; workloads.md short-document points"],
              ["FA3 GQA packing (fwd), fp32 dK/dV atomics (bwd)", f"{'on' if k.pack_gqa else 'off'}, {'on' if k.gqa_dkv_accum else 'off'}",
               "flash-attention hopper/heuristics.h, epilogue_bwd.hpp"],
              ["MagiAttention FA3 wrapper unpad/pad copies", "on" if hw.fa3_wrapper_copies else "off", "MagiAttention exps/dist_attn/baselines/utils_cp.py"],
              ["NVLink / NIC per GPU", f"{hw.nvlink_bw / 1e9:.0f} / {hw.ib_bw / 1e9:.0f} GB/s", "workloads.md (NCCL achieved)"],
              ["p2p latency NVLink / IB", f"{hw.nvlink_latency * 1e6:.0f} / {hw.ib_latency * 1e6:.0f} µs", "workloads.md"],
              ["NCCL ring latency: base, per NVLink step, per network step",
               f"{hw.nccl_base_latency * 1e6:.1f} / {hw.nccl_nvlink_step_latency * 1e6:.1f} / {hw.nccl_net_step_latency * 1e6:.1f} µs",
               "NVIDIA/nccl src/graph/tuning.cc (ring, Simple)"],
              ["p2p channel over the network, channels of a communicator", f"{hw.p2p_channel_net_bw / 1e9:.0f} GB/s, {hw.p2p_channels}",
               "NVIDIA/nccl src/graph/paths.cc (P2P_PER_CHANNEL_NET_BW; 2 per peer, halved with the rank count)"],
              ["HBM (elementwise)", f"{hw.hbm_bw / 1e12:.1f} TB/s", "H100 datasheet, 80%"]]
    consts.append(["overlap_slowdown (SM contention under overlap)", f"{hw.overlap_slowdown:.2f}",
                   "assumed: NCCL holds one CTA per channel (2-16 of 132 SMs) and HBM; not fitted, no 8-GPU point isolates it"])
    consts += [[k, f"{v * 1e9:.1f} ns" if k == "cta_s" else (f"{v * 1e6:.0f} µs" if k == "te_step_s" else f"{v:.3f}"), "fitted on 8 GPUs: " + ", ".join(f"{m} {ph}" for m, ph in PARAMS[k])]
               for k, v in fitted.items()]
    tab = [[p.gpus, p.method, p.phase, p.published, p.simulated, f"{100 * p.error:+.0f}%", "yes" if p.ok else "NO",
            "" if p.ok else MISSING.get((p.method, p.phase), MISSING.get(p.method, ""))] for p in pts]
    errs = {g: [abs(p.error) for p in pts if p.gpus == g] for g in (8, 64)}
    summary = "; ".join(f"{g} GPUs: worst {100 * max(e):.0f}%, median {100 * float(np.median(e)):.0f}%" for g, e in errs.items() if e)
    from megatron_hsap.sim.validate import RFA_SOURCE, ring_flash_attention_check

    rfa = ring_flash_attention_check(sim_hardware("a100"))
    rfa_tab = [[c.method, f"{c.fwd_pct:.1f} / {c.published_fwd:.1f}", f"{c.fwd_bwd_pct:.1f} / {c.published_fwd_bwd:.1f}",
                "yes" if c.ok else "NO"] for c in rfa]
    md = [f"### Calibration — MagiAttention's varlen-causal H100 protocol (mean of {n} batch(es); fit on 8 GPUs, check on 64)", "",
          markdown_table(["constant", "value", "source"], consts), "",
          markdown_table(["GPUs", "method", "phase", "published TFLOP/s", "simulated", "error", f"within {TOLERANCE:.0%}", "missing structural effect"], tab),
          "", f"Errors — {summary}.", "",
          f"The same constants on ring-flash-attention's 8×A100 varlen figures ({RFA_SOURCE}; % of single-GPU FlashAttention):", "",
          markdown_table(["method", "fwd sim / published", "fwd+bwd sim / published", "within 15%"], rfa_tab)]
    return Report("calibrate", rows, "\n".join(md), []).write(out_dir)

"""Timed sections of the GPU check (:mod:`megatron_hsap.bench.gpu_check`): the kernel-rate
calibration by block shape and the per-rank kernel-time vs planned-work comparison.

Timing uses CUDA events around one kernel call (median of repeats after a warm-up). On the dry
run the calls still run (``cpu`` backend, small shapes) but their seconds come from
``DRY_TRUTH``, a known kernel model with ±1% deterministic noise, so every downstream step —
the fit, the YAML, the simulator and planner loads, the per-rank comparison — has a known
right answer that is asserted. ``ctx`` is the check's result collector (``add(section, name,
error, tol, detail)``, ``dry``, ``device``, ``out``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_hsap.bench import gpu_calibration as gc
from megatron_hsap.plan.ir import Phase
from megatron_hsap.runtime import kernels

__all__ = ["DRY_TRUTH", "calibrate", "check_ranks", "hardware_name"]

# the synthetic kernel model of the dry run (the GPU curve's shape at rates that make the dry
# run's small blocks compute-dominated): the fit must recover it
DRY_TRUTH = gc.Calibration(attn_fwd_peak=4.0e10, attn_bwd_peak=3.2e10, half_rate_tokens=390.0, launch_s=8e-6,
                           cta_s=2e-6, max_rel_error=0.0, median_rel_error=0.0)  # fmt: skip


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=device)


class _Clock:
    """Seconds of one kernel call: CUDA events (median of repeats), or on the dry run the
    synthetic model ``DRY_TRUTH`` with ±1% deterministic noise (the call still runs on CPU)."""

    def __init__(self, ctx: Any, backend: str, reps: int) -> None:
        self.ctx, self.backend, self.reps, self.calls = ctx, backend, reps, 0

    def time(self, phase: Phase | str, items: list[tuple[int, int, bool]], heads: tuple[int, int], d: int, dv: int,
             dtype: torch.dtype) -> float:  # fmt: skip
        h, hkv = heads
        causal = items[0][2]
        lq, lk = [nq for nq, _, _ in items], [nk for _, nk, _ in items]
        dev = self.ctx.device
        q = torch.randn(sum(lq), h, d, device=dev, dtype=dtype)
        k = torch.randn(sum(lk), hkv, d, device=dev, dtype=dtype)
        v = torch.randn(sum(lk), hkv, dv, device=dev, dtype=dtype)
        args = dict(cu_seqlens_q=_cu(lq, dev), cu_seqlens_k=_cu(lk, dev), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                    causal=causal, softmax_scale=d**-0.5, backend=self.backend)  # fmt: skip
        out, lse = kernels.attn_forward(q, k, v, **args)
        run: Callable[[], Any] = (lambda: kernels.attn_forward(q, k, v, **args)) if phase == Phase.FWD else \
            (lambda: kernels.attn_backward(out, q, k, v, out, lse, **args))  # fmt: skip
        self.calls += 1
        if self.ctx.dry:
            run()
            blocks = list(zip(lq, lk))
            exact = DRY_TRUTH.call_seconds(phase, blocks, gc.call_flops(blocks, causal, h, d, dv, phase), h)
            return exact * (1 + 0.01 * math.sin(self.calls))
        run()  # warm-up (and the first call's lazy initialisation)
        times = []
        for _ in range(self.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return float(np.median(times))


def hardware_name(device: torch.device, override: str | None) -> str:
    """The constant set the calibration overrides: ``override``, else from the GPU's name (one
    the simulator and the planner both know; h100 for an unknown GPU)."""
    from megatron_hsap.plan.hardware import HARDWARE
    from megatron_hsap.sim.constants import HARDWARE as SIM

    if override:
        return override
    gpu = torch.cuda.get_device_name(device).upper() if device.type == "cuda" else "H100"
    wanted = ["h200"] if "H200" in gpu else []
    wanted += ["a100"] if ("A100" in gpu or "A800" in gpu) else ["h100"]
    return next(n for n in wanted if n in HARDWARE and n in SIM)


def calibrate(ctx: Any, backend: str, hardware: str, header: list[str]) -> gc.Calibration:
    sizes, per_call = ([16, 64, 256, 1024], 1024) if ctx.dry else ([128, 512, 2048, 8192], 32768)
    heads, d = ((2, 1), 16) if ctx.dry else ((32, 8), 128)
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    clock = _Clock(ctx, backend, reps=5)
    rows = []
    for phase, causal, blocks in gc.grid(sizes, per_call):
        secs = clock.time(phase, [(nq, nk, causal) for nq, nk in blocks], heads, d, d, dtype)
        flops = sum(gc.call_flops(blocks, causal, heads[0], d, d, phase))
        rows.append(gc.Measurement(phase=phase, causal=causal, blocks=blocks, heads=heads[0], flops=flops, seconds=secs))
    cal = gc.fit(rows)
    with open(ctx.out / "calibration.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["phase", "mask", "blocks", "flops", "seconds", "tflops", "model_seconds", "model_error"])
        for m in rows:
            model = cal.call_seconds(m.phase, m.blocks, gc.call_flops(m.blocks, m.causal, heads[0], d, d, m.phase), m.heads)
            w.writerow([m.phase, "causal" if m.causal else "rect", m.label, f"{m.flops:.6g}", f"{m.seconds:.6g}",
                        f"{m.flops / m.seconds / 1e12:.3f}", f"{model:.6g}", f"{model / m.seconds - 1:+.3f}"])  # fmt: skip
    path = gc.write_calibration(ctx.out / "calibration.yaml", cal, hardware, header)
    ctx.add("calibrate", f"fit over {len(rows)} shapes ({backend})", cal.median_rel_error, 0.25,
            f"peak fwd {cal.attn_fwd_peak:.3g} bwd {cal.attn_bwd_peak:.3g} FLOP/s, "
            f"half-rate {cal.half_rate_tokens:.0f} tokens, launch {cal.launch_s * 1e6:.1f} us, "
            f"CTA {cal.cta_s * 1e9:.1f} ns")  # fmt: skip
    _check_yaml_loads(ctx, path, cal, hardware)
    if ctx.dry:  # the synthetic model must come back (±1% noise: 5% margin)
        for name in ("attn_fwd_peak", "attn_bwd_peak", "half_rate_tokens", "cta_s"):
            got, want = getattr(cal, name), getattr(DRY_TRUTH, name)
            ctx.add("calibrate", f"dry fit recovers {name}", abs(got / want - 1), 0.05, f"{got:.4g} vs {want:.4g}")
    return cal


def _check_yaml_loads(ctx: Any, path: Path, cal: gc.Calibration, hardware: str) -> None:
    name, fields = gc.read_calibration(path)
    roundtrip = max(abs(fields[k] / getattr(cal, k) - 1) if getattr(cal, k) else abs(fields[k]) for k in gc.CALIBRATION_FIELDS)
    ctx.add("calibrate", "yaml round trip (no PyYAML)", roundtrip if name == hardware else math.inf, 1e-12)
    try:
        import yaml  # noqa: F401  (not on the GPU box; the CPU venv has it)
    except ImportError:
        ctx.add("calibrate", "simulator --config load", math.nan, math.nan, "ok: skipped, no PyYAML here (load it on the CPU machine)")
    else:
        from megatron_hsap.sim import config as sim_config

        try:
            sim_config.load_overrides(path)
            got = sim_config.sim_hardware(hardware).kernel
            err = max(abs(got.fwd_peak / cal.attn_fwd_peak - 1), abs(got.bwd_peak / cal.attn_bwd_peak - 1),
                      abs(got.curve.half_rate_tokens / cal.half_rate_tokens - 1), abs(got.cta_s - cal.cta_s) / max(cal.cta_s, 1e-30),
                      0.0 if got.tile == 0 else math.inf)  # the fitted curve prices kernels, not the tile model  # fmt: skip
            ctx.add("calibrate", "simulator --config load", err, 1e-12)
        finally:
            sim_config.reset_overrides()
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.hardware import HARDWARE

    registered = gc.register_planner_hardware(path)
    try:
        hw = HARDWARE[registered]
        stats = compile_plan([0, 1000, 4096], 2, 1, num_heads=8, head_dim=64, hardware=registered, flatten="never").stats()
        base = compile_plan([0, 1000, 4096], 2, 1, num_heads=8, head_dim=64, hardware=hardware, flatten="never").stats()
        # compute bound = work · (c/rate_fwd + 2.5c/rate_bwd): priced with the calibrated rates
        ref = HARDWARE[hardware]
        want = (1 / hw.attn_fwd_flops + 2.5 / hw.attn_bwd_flops) / (1 / ref.attn_fwd_flops + 2.5 / ref.attn_bwd_flops)
        ratio = (stats.compute_bound_s / base.compute_bound_s) / want
        ctx.add("calibrate", f"planner prices with {registered}", abs(ratio - 1), 0.05,
                f"flat fwd {hw.attn_fwd_flops:.3g} bwd {hw.attn_bwd_flops:.3g} FLOP/s")  # fmt: skip
    finally:
        HARDWARE.pop(registered, None)


def check_ranks(ctx: Any, cal: gc.Calibration, backend: str, hardware: str) -> None:
    from megatron_hsap.plan import compile_plan

    if ctx.dry:
        cu, inter, heads, d, dtype = [0, 30, 100, 101, 256], 4, (2, 1), 16, torch.float32
    else:  # a FineWeb-like 64K micro-batch at P_inter = 8, GQA 32/8, d 128
        gen = np.random.default_rng(0)
        lens = np.minimum(gen.lognormal(6.5, 1.2, 400).astype(int) + 1, 16384)
        cu = [0, *np.cumsum(lens).tolist()]
        cu = [c for c in cu if c < 65536] + [65536]
        inter, heads, d, dtype = 8, (32, 8), 128, torch.bfloat16
    clock = _Clock(ctx, backend, reps=3)
    plan = compile_plan(cu, inter, 1, num_heads=heads[0], num_kv_heads=heads[1], head_dim=d, hardware=hardware,
                        flatten="never",  # the SAP programs' per-rank kernel times
                        dtype_bytes=torch.tensor([], dtype=dtype).element_size())  # fmt: skip
    rows = gc.compare_ranks(plan, cal, heads[0], d, d, lambda ph, items: clock.time(ph, items, heads, d, d, dtype))
    with open(ctx.out / "ranks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ratios = [r["measured_over_predicted"] for r in rows]
    spread = max(ratios) / min(ratios) - 1
    detail = " ".join(f"r{r['rank']} {r['measured_s'] * 1e3:.2f}ms/{r['predicted_s'] * 1e3:.2f}ms" for r in rows)
    # Across ranks the calibrated model should be off by the same factor; a spread over 50% means
    # the planner's balance is not what the GPU sees (dry run: fitted vs true launch cost, 15%).
    ctx.add("ranks", f"{inter} ranks: measured/predicted spread", spread, 0.15 if ctx.dry else 0.5, detail)
    if ctx.dry:  # the plumbing exactly: the true model predicts the synthetic clock to its ±1% noise
        truth = gc.compare_ranks(plan, DRY_TRUTH, heads[0], d, d, lambda ph, items: clock.time(ph, items, heads, d, d, dtype))
        ctx.add("ranks", "dry: true model predicts every rank", max(abs(r["measured_over_predicted"] - 1) for r in truth), 0.015)

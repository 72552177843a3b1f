"""Scale: plan and simulate 1024 GPUs (P_intra 8 × P_inter 128) with 1M–4M-token batches.

Reports the planner's compile time and plan quality (placement, imbalance, bytes over the
necessary traffic, rounds, the planner's own estimate) and the simulated forward/backward time,
TFLOP/s per GPU and % of ideal, with the time split into ``breakdown.TERMS``; USP (all-to-all
over 8 GPUs × per-document zigzag ring over 128 nodes) runs on the same batch for reference.
H100 (FA3-class kernels), GQA 64:8, d 128, ``slimpajama`` documents (not capped).

Layouts side by side on the same batch: the paper's contiguous layout (method
``hsap-contiguous``; the first table and the breakdown) and the document-aware balanced one,
forced (``layout="balanced", layout_fallback=False``; method ``hsap-balanced``). "kept" names the
one ``layout="balanced"`` (with its fallback) ships: the lower estimate. A balanced plan that
fails is reported in its cell, not hidden.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim.breakdown import phase_breakdown
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.methods import full_shape, hsap_plan, ideal_seconds, run_method, useful_flops
from megatron_hsap.sim.reproduce import Point, attempt, method_rows, progress
from megatron_hsap.sim.results import Report, Row, markdown_table

__all__ = ["scale"]

M = 1 << 20
CONTIGUOUS = {"layout": "contiguous"}  # explicit: compile_plan's default layout may change
BALANCED = {"layout": "balanced", "layout_fallback": False}


def scale(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str = "slimpajama",
          with_baseline: bool = True) -> Report:
    hw = sim_hardware("h100-fa3")
    shape = full_shape(64, 8)
    configs = [(8, 16, M // 4)] if quick else [(8, 128, M), (8, 128, 2 * M), (8, 128, 4 * M)]
    rows: list[Row] = []
    table, terms_tab, side = [], [], []
    for intra, inter, T in progress(configs, "scale"):
        P = intra * inter
        cu = pack_batches(workload, T, 1, 0)[0]
        pt = Point(workload, T, intra, inter, "ib", "64/8", 0)
        t0 = time.perf_counter()
        run = run_method("hsap", cu, hw=hw, intra=intra, inter=inter, shape=shape, plan_options=CONTIGUOUS)
        wall = time.perf_counter() - t0
        assert run is not None
        run = replace(run, method="hsap-contiguous")
        rows += method_rows(pt, run)
        plan = run.extra["plan"]
        rows += [pt.row("hsap-contiguous", k, v, u) for k, v, u in (
            ("bytes_over_necessary", plan["bytes_total"] / max(plan["necessary_bytes"], 1), "ratio"),
            ("rounds_fwd", plan["rounds_fwd"], "rounds"), ("plan_and_simulate_wall", wall, "s"))]
        uf = useful_flops(cu, shape)
        ideal = {ph: ideal_seconds(cu, shape, hw, P, ph) for ph in Phase}
        ideal_tf = {Phase.FWD: uf / ideal[Phase.FWD] / P / 1e12, Phase.BWD: 2.5 * uf / ideal[Phase.BWD] / P / 1e12}
        bal, err = attempt(run_method, "hsap", cu, hw=hw, intra=intra, inter=inter, shape=shape, plan_options=BALANCED)
        cells = ["failed"] * 5
        if bal is None:
            rows.append(pt.row("hsap-balanced", "error", err, "text"))
            print(f"warning: balanced layout failed at {intra}x{inter} {T}: {err}")
        else:
            bal = replace(bal, method="hsap-balanced")
            bp = bal.extra["plan"]
            rows += method_rows(pt, bal) + [pt.row("hsap-balanced", k, v, u) for k, v, u in (
                ("bytes_over_necessary", bp["bytes_total"] / max(bp["necessary_bytes"], 1), "ratio"),
                ("rounds_fwd", bp["rounds_fwd"], "rounds"), ("balanced_over_contiguous", bal.seconds / run.seconds, "ratio"))]
            kept = hsap_plan(cu, hw=hw, intra=intra, inter=inter, shape=shape).stats().layout  # the planner's own choice
            cells = [bp["imbalance"], f"{bal.fwd.seconds * 1e3:.2f} / {bal.bwd.seconds * 1e3:.2f}",
                     f"{bal.tflops_per_gpu(Phase.FWD):.0f} / {bal.tflops_per_gpu(Phase.BWD):.0f}", f"{bal.seconds / run.seconds:.2f}×", kept]
        side.append([f"{T / M:g}M", plan["imbalance"], f"{run.fwd.seconds * 1e3:.2f} / {run.bwd.seconds * 1e3:.2f}",
                     f"{run.tflops_per_gpu(Phase.FWD):.0f} / {run.tflops_per_gpu(Phase.BWD):.0f}"] + cells)
        usp = run_method("usp", cu, hw=hw, intra=intra, inter=inter, shape=shape) if with_baseline else None
        if usp is not None:
            rows += method_rows(pt, usp)
        table.append([f"{intra}x{inter}", f"{T / M:g}M", len(cu) - 1, run.extra["compile_s"], plan["placement"], plan["imbalance"],
                      plan["bytes_total"] / max(plan["necessary_bytes"], 1), plan["rounds_fwd"], run.fwd.seconds * 1e3, run.bwd.seconds * 1e3,
                      f"{run.tflops_per_gpu(Phase.FWD):.0f} / {run.tflops_per_gpu(Phase.BWD):.0f}",
                      f"{100 * run.tflops_per_gpu(Phase.FWD) / ideal_tf[Phase.FWD]:.0f}% / {100 * run.tflops_per_gpu(Phase.BWD) / ideal_tf[Phase.BWD]:.0f}%",
                      f"{usp.tflops_per_gpu(Phase.FWD):.0f} / {usp.tflops_per_gpu(Phase.BWD):.0f}" if usp else "-"])
        for r in (run, bal) if bal is not None else (run,):
            for ph in Phase:
                b = phase_breakdown(r, ph, ideal[ph], hw.latency(LinkClass.INFINIBAND))
                terms_tab.append([f"{T / M:g}M", "contiguous" if r is run else "balanced", ph] + [1e3 * v for v in b.values()])
                rows += [pt.row(r.method, f"{ph}_term_{k}", 1e3 * v, "ms") for k, v in b.items()]
    md = ["### Scale — HSAP (contiguous layout) on 1024 simulated H100s (8 × 128), GQA 64:8, d 128, `" + workload + "`", "",
          markdown_table(["topology", "T", "docs", "compile s", "placement", "imbalance", "bytes / necessary", "rounds fwd",
                          "fwd ms", "bwd ms", "TFLOP/s/GPU fwd / bwd", "% ideal", "USP TFLOP/s fwd / bwd"], table), "",
          "Token layouts side by side (the table above is the contiguous layout; balanced is forced, "
          "`layout_fallback=False`; kept: what `layout=\"balanced\"` with its fallback ships, the lower estimate):", "",
          markdown_table(["T", "contig. imbalance", "contig. fwd / bwd ms", "contig. TFLOP/s fwd / bwd", "balanced imbalance",
                          "balanced fwd / bwd ms", "balanced TFLOP/s fwd / bwd", "balanced / contig.", "kept"], side), "",
          "Where the time goes (critical rank, ms):", "",
          markdown_table(["T", "layout", "phase", "ideal", "kernel eff.", "imbalance", "merges", "all-to-all", "latency", "exposed comm."], terms_tab)]
    return Report("scale", rows, "\n".join(md), []).write(out_dir)

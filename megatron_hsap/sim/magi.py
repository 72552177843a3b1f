"""MagiAttention's context-parallel benchmark protocol, simulated, with the issue's targets.

Protocol (workloads.md): H100, 8→64 GPUs, 8K tokens per GPU, GQA 64:8:8, head dim 128, causal
varlen masks packed from a length distribution (``slimpajama``) with every document cut to at
most 1/4 of the batch (``max_doc_fraction=0.25``); forward and backward TFLOP/s per GPU of the
useful (document-causal) FLOPs. Kernels: the FlashAttention-3 class (``h100-fa3``), as
MagiAttention and its baselines run on Hopper.

ideal = Σ over the batch's documents of FLOPs / kernel rate at that document's shape, / P.
Targets (issue 6), at 8 and 64 GPUs, per phase: HSAP ≥ min(1.2 × best baseline, 0.9 × ideal)
and HSAP ≥ 0.85 × ideal; all-to-all time counts against HSAP (it is not overlapped). Where a
target is missed the report lists ``breakdown.TERMS`` for HSAP's critical rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim import paper
from megatron_hsap.sim.breakdown import TERMS, phase_breakdown
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.methods import full_shape, ideal_seconds, run_method, useful_flops
from megatron_hsap.sim.reproduce import Point, _plot, hsap_topologies, method_rows, progress
from megatron_hsap.sim.results import Report, Row, markdown_table

__all__ = ["magi", "BASELINES"]

BASELINES = {  # our method -> the name in MagiAttention's tables
    "te_thd_ring": "ring-p2p (TE THD)",
    "allgather_kv": "ring-allgather (Llama-3)",
    "ulysses": "Ulysses",
    "usp": "USP",
    "te_a2a_p2p": "TE a2a+p2p",
    "distflashattn": "DistFlashAttn",
}
TOKENS_PER_GPU = 8192


def magi(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str = "slimpajama") -> Report:
    hw = sim_hardware("h100-fa3")
    shape = full_shape(64, 8)
    sizes = (8,) if quick else (8, 16, 32, 64)
    n_seeds = 1 if quick else (seeds or 3)
    rows: list[Row] = []
    table, verdicts, notes = [], [], []
    plot_series: dict[str, list[float]] = {}
    for P in progress(list(sizes), "magi"):
        T = TOKENS_PER_GPU * P
        link = "nvlink" if P <= 8 else "ib"
        tf: dict[str, dict[str, list[float]]] = {}
        terms: dict[str, dict[str, list[float]]] = {"fwd": {k: [] for k in TERMS}, "bwd": {k: [] for k in TERMS}}
        ideal_tf: dict[str, list[float]] = {"fwd": [], "bwd": []}
        topo_seen: list[str] = []
        bounds: list[tuple[float, float]] = []
        for seed in range(n_seeds):
            cu = pack_batches(workload, T, 1, seed, max_doc_fraction=0.25)[0]
            uf = useful_flops(cu, shape)
            for ph, mult in (("fwd", 1.0), ("bwd", 2.5)):
                ideal_tf[ph].append(mult * uf / ideal_seconds(cu, shape, hw, P, ph) / P / 1e12)
            runs = {m: run_method(m, cu, hw=hw, intra=min(P, 8) if m == "te_a2a_p2p" else 1,
                                  inter=P // min(P, 8) if m == "te_a2a_p2p" else P, shape=shape) for m in BASELINES}
            all_hsap = hsap_topologies(cu, hw=hw, P=P, shape=shape)
            if not all_hsap:
                notes.append(f"- {P} GPUs, seed {seed}: the planner failed at every topology (see warnings)")
                continue
            best = min(all_hsap, key=lambda r: r.seconds)
            topo_seen.append(best.topology)
            plan = best.extra["plan"]
            bounds.append((plan["traffic_bound_s"], plan["compute_bound_s"]))
            runs["hsap"] = best
            for r in all_hsap:
                pt = Point(workload, T, *(int(x) for x in r.topology.split("x")), link, "64/8", seed)
                rows += method_rows(pt, r)
            for name, run in runs.items():
                if run is None:
                    continue
                if name != "hsap":
                    pt = Point(workload, T, *(int(x) for x in run.topology.split("x")), link, "64/8", seed)
                    rows += method_rows(pt, run)
                for ph in ("fwd", "bwd"):
                    tf.setdefault(name, {"fwd": [], "bwd": []})[ph].append(run.tflops_per_gpu(ph))
            for ph in ("fwd", "bwd"):
                b = phase_breakdown(best, ph, ideal_seconds(cu, shape, hw, P, ph), hw.latency(best_link(P)))
                for k, v in b.items():
                    terms[ph][k].append(v)
        med = {m: {ph: float(np.median(v)) for ph, v in d.items()} for m, d in tf.items()}
        ideal = {ph: float(np.median(v)) for ph, v in ideal_tf.items()}
        pt = Point(workload, T, 1, P, link, "64/8", "median")
        for ph in ("fwd", "bwd"):
            rows.append(pt.row("ideal", f"{ph}_tflops_per_gpu", ideal[ph], "TFLOP/s"))
        for m, v in paper.MAGI_FWD.get(P, {}).items():
            rows.append(Point(workload, T, 1, P, link, "64/8", "paper").row(m, "fwd_tflops_per_gpu", v, "TFLOP/s", "paper:magiattention"))
        for m in ["hsap", *BASELINES]:
            if m not in med:
                table.append([P, BASELINES.get(m, m), "n/a", "n/a", "", ""])
                continue
            label = f"HSAP ({max(set(topo_seen), key=topo_seen.count)})" if m == "hsap" else BASELINES[m]
            pub = paper.MAGI_FWD.get(P, {}).get({"te_thd_ring": "ring_p2p", "hsap": "magiattention"}.get(m, m), "")
            if m == "hsap" and pub:
                pub = f"MagiAttention itself: {pub:.0f}"
            table.append([P, label, med[m]["fwd"], med[m]["bwd"], f"{100 * med[m]['fwd'] / ideal['fwd']:.0f}% / {100 * med[m]['bwd'] / ideal['bwd']:.0f}%", pub])
            plot_series.setdefault(label.split(" (")[0], []).append(med[m]["fwd"])
        table.append([P, "ideal", ideal["fwd"], ideal["bwd"], "100%", ""])
        plot_series.setdefault("ideal", []).append(ideal["fwd"])
        if bounds:
            tb, cb = (float(np.median([b[i] for b in bounds])) for i in (0, 1))
            notes.append(f"- {P} GPUs: the plan's necessary inter-rank traffic needs ≥ {1e3 * tb:.2f} ms (fwd + bwd, planner's "
                         f"flat bandwidth) against a compute bound of {1e3 * cb:.2f} ms: "
                         + ("communication-bound — 85% of the compute ideal is out of reach for any placement of this batch"
                            if tb > cb else "compute-dominated"))
        if P in (8, 64) or quick:
            for ph in ("fwd", "bwd"):
                best_base = max(med[m][ph] for m in BASELINES if m in med)
                h = med["hsap"][ph]
                goal1 = min(1.2 * best_base, 0.9 * ideal[ph])
                ok1, ok2 = h >= goal1, h >= 0.85 * ideal[ph]
                avg = {k: float(np.mean(v)) for k, v in terms[ph].items()}
                total = sum(avg.values())
                cost = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.2f} ms ({100 * v / total:.0f}%)" for k, v in avg.items() if k != "ideal" and v > 0.005 * total)
                verdicts.append([P, ph, f"{h:.0f}", f"{goal1:.0f}", "met" if ok1 else "missed", f"{0.85 * ideal[ph]:.0f}", "met" if ok2 else "missed",
                                 "" if ok1 and ok2 else cost])
                for name, ok in (("target_vs_best_baseline", ok1), ("target_85pct_ideal", ok2)):
                    rows.append(pt.row("hsap", f"{ph}_{name}", "met" if ok else "missed", "verdict"))
                for k, v in avg.items():
                    rows.append(pt.row("hsap", f"{ph}_term_{k}", 1e3 * v, "ms"))
    md = [f"### MagiAttention protocol — simulated H100 (FA3-class kernels), 8K tokens/GPU, GQA 64:8, d 128, `{workload}` ≤ 1/4 of the batch; "
          f"TFLOP/s per GPU, median of {n_seeds} seed(s)", "",
          markdown_table(["GPUs", "method", "fwd", "bwd", "% of ideal (fwd / bwd)", "published fwd (MagiAttention's benchmark)"], table), "",
          "Targets (HSAP at its fastest topology; terms of its critical rank when missed):", "",
          markdown_table(["GPUs", "phase", "HSAP", "min(1.2×best, 0.9×ideal)", "target 1", "0.85×ideal", "target 2", "where the time goes"], verdicts)]
    md += [""] + notes if notes else []
    labels = [f"{P} GPUs" for P in sizes]
    png = _plot(Path(out_dir) / "magi.png", labels, plot_series, "forward TFLOP/s per GPU", "MagiAttention protocol (simulated)")
    return Report("magi", rows, "\n".join(md), [png]).write(out_dir)


def best_link(P: int):  # noqa: ANN201
    from megatron_hsap.plan.hardware import LinkClass

    return LinkClass.NVLINK if P <= 8 else LinkClass.INFINIBAND

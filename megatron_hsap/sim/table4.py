"""Table 4: end-to-end LLaMA-2-7B training throughput on 8 GPUs, HSAP vs packing vs batching.

Per micro-batch of ``T`` tokens on the 8-GPU CP group (tokens/s per GPU, the unit the paper's
figures imply: its tokens/s ≈ iter/s × T / 8):

    step = layers × (attention forward + backward, simulated)
         + 3 × non-attention forward FLOPs of T/8 tokens / (dense peak × MFU)

Non-attention FLOPs per token (forward, matmuls only): ``2·layers·(h·(h + 2·Hkv·d) + h·h +
3·h·ffn) + 2·h·vocab`` (q/k/v and output projections, SwiGLU MLP, LM head); backward = 2×.
Gradient synchronisation and the optimizer step are not modelled (identical for all three).

* HSAP: the compiled plan at the column's topology (intra×inter).
* packing: the same packed batch under document-blind CP — Megatron's a2a+p2p zigzag ring over
  the batch as ONE causal sequence (cross-document pairs computed), same topology.
* batching: one document per sample padded to ``T`` (our reading of the paper's §4.2): the same
  step time as packing (a full causal ``T``), but only ``E[min(length, T)]`` real tokens.
* best baseline: the fastest *document-aware* baseline on the same batch (TE THD ring, TE
  a2a+p2p and LoongTrain at the column's topology, USP, Ulysses, all-gather KV zigzag, Megatron
  hybrid CP), named — the headline; "packing" is document-blind, the paper's comparison.

Datasets: the paper's three plus ``full`` (one document filling each batch). HSAP runs its
shipped default (balanced) layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_hsap.baselines.registry import REGISTRY
from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.plan.workloads import pack_batches, sample_lengths
from megatron_hsap.sim import constants, paper
from megatron_hsap.sim.config import SimHardware, sim_hardware
from megatron_hsap.sim.breakdown import LossTable, run_terms
from megatron_hsap.sim.methods import full_shape, run_method
from megatron_hsap.sim.reproduce import Point, _plot, attempt, best_baseline, progress
from megatron_hsap.sim.results import Report, Row, flattened_cell, markdown_table

__all__ = ["nonattention_flops_per_token", "table4", "step_seconds"]

P = 8
DOC_AWARE = ("te_thd_ring", "te_a2a", "te_a2a_p2p", "loongtrain", "usp", "ulysses", "allgather_kv_zigzag", "hybrid_cp")


def nonattention_flops_per_token(cfg: dict[str, int] = constants.LLAMA2_7B) -> float:
    """Forward matmul FLOPs per token outside attention (see the module docstring)."""
    h, d, hkv, ffn, vocab = cfg["hidden"], cfg["head_dim"], cfg["kv_heads"], cfg["ffn"], cfg["vocab"]
    per_layer = h * (h + 2 * hkv * d) + h * h + 3 * h * ffn
    return 2.0 * (cfg["layers"] * per_layer + h * vocab)


def step_seconds(attn_fwd_bwd_s: float, T: int, hw: SimHardware, cfg: dict[str, int] = constants.LLAMA2_7B) -> float:
    """One training step of a ``T``-token micro-batch on the P-GPU CP group."""
    dense = 3.0 * nonattention_flops_per_token(cfg) * T / P / (hw.dense_peak_flops * hw.dense_mfu)
    return cfg["layers"] * attn_fwd_bwd_s + dense


def table4(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None) -> Report:
    hw = sim_hardware("a100")
    cfg = constants.LLAMA2_7B
    shape = full_shape(cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
    datasets = ["fineweb", "full"] if quick else [*paper.TABLE4, "full"]
    lengths = (16384,) if quick else paper.TABLE4_LENGTHS
    topologies = ("1x8", "8x1") if quick else paper.TABLE4_TOPOLOGIES
    n_seeds = 1 if quick else (seeds or 10)
    grid = [(ds, T, topo) for ds in datasets for T in lengths for topo in topologies]
    rows: list[Row] = []
    table = []
    rng = np.random.default_rng(0)
    real_frac = {}
    losses = LossTable()
    for ds, T, topo in progress(grid, "table4"):
        intra, inter = (int(x) for x in topo.split("x"))
        if (ds, T) not in real_frac:
            # batching pads one document per sample to T; "full" documents already fill T
            docs = sample_lengths(ds, 20000, rng) if ds != "full" else np.array([T])
            real_frac[(ds, T)] = float(np.minimum(docs, T).mean()) / T
        hsap_tps, pack_tps, best_tps, best_names = [], [], [], []
        flat: list[str] = []  # per batch HSAP's plan ran flattened: the one-level topology it ran as (plan/flatten.py)
        kept = []  # (batch, HSAP's run, every document-aware baseline's run): the loss breakdown
        for seed in range(n_seeds):
            cu = pack_batches(ds, T, 1, seed)[0]
            pt = Point(ds, T, intra, inter, "nvlink", f"{cfg['heads']}/{cfg['kv_heads']}", seed)
            hsap, err = attempt(run_method, "hsap", cu, hw=hw, intra=intra, inter=inter, shape=shape)
            pack = run_method("blind_ring", cu, hw=hw, intra=intra, inter=inter, shape=shape)
            assert pack is not None
            cands = {m: run_method(m, cu, hw=hw, intra=intra if m in ("te_a2a_p2p", "loongtrain") else 1,
                                   inter=inter if m in ("te_a2a_p2p", "loongtrain") else P, shape=shape) for m in DOC_AWARE}
            bname, brun = best_baseline(cands)  # type: ignore[misc]
            b_tps = T / step_seconds(brun.seconds, T, hw) / P
            best_tps.append(b_tps)
            best_names.append(bname)
            rows += [pt.row(bname, "best_baseline_tokens_per_s_per_gpu", b_tps, "tokens/s")]
            p_tps = T / step_seconds(pack.seconds, T, hw) / P
            pack_tps.append(p_tps)
            rows += [pt.row("packing", "tokens_per_s_per_gpu", p_tps, "tokens/s"), pt.row("packing", "attention_time", pack.seconds * 1e3, "ms"),
                     pt.row("batching", "tokens_per_s_per_gpu", p_tps * real_frac[(ds, T)], "tokens/s")]
            if hsap is None:  # a planner failure is reported in the table, not hidden
                rows.append(pt.row("hsap", "error", err, "text"))
                print(f"warning: HSAP {topo} failed on {ds} {T} seed {seed}: {err}")
                hsap_tps.append(float("nan"))
                continue
            h_tps = T / step_seconds(hsap.seconds, T, hw) / P
            hsap_tps.append(h_tps)
            kept.append((cu, hsap, cands))
            rows += [pt.row("hsap", "tokens_per_s_per_gpu", h_tps, "tokens/s"), pt.row("hsap", "attention_time", hsap.seconds * 1e3, "ms"),
                     pt.row("hsap", "flattened", int(hsap.extra["flattened"]), "bool"),
                     pt.row("hsap", "ran_as", hsap.extra["ran_as"], "topology")]
            if hsap.extra["flattened"]:
                flat.append(hsap.extra["ran_as"])
        h, p, bb = float(np.median(hsap_tps)), float(np.median(pack_tps)), float(np.median(best_tps))
        bn = max(sorted(set(best_names)), key=best_names.count)  # ties: by name, not by set order (hash seed)
        b = p * real_frac[(ds, T)]
        mp = Point(ds, T, intra, inter, "nvlink", f"{cfg['heads']}/{cfg['kv_heads']}", "median")
        rows += [mp.row("hsap", "ratio_to_best_baseline", h / bb, "x"), mp.row(bn, "best_baseline_tokens_per_s_per_gpu", bb, "tokens/s")]
        if h / bb < 1:  # HSAP loses here: measure why (attention only; the rest of the step is the same for both)
            lat = hw.latency(LinkClass.NVLINK)
            for cu_s, h_run, c_runs in kept:
                if c_runs.get(bn) is not None:
                    losses.add((ds, f"{T // 1024}K", topo), bn, run_terms(h_run, cu_s, shape, hw, P, lat), run_terms(c_runs[bn], cu_s, shape, hw, P, lat))
            losses.close((ds, f"{T // 1024}K", topo), bn, REGISTRY[bn].label, h / bb)
        if ds in paper.TABLE4:
            ph, pp, pb = paper.table4_cell(ds, T, topo)
            pt = Point(ds, T, intra, inter, "nvlink", f"{cfg['heads']}/{cfg['kv_heads']}", "paper")
            rows += [pt.row(m, "tokens_per_s_per_gpu", v, "tokens/s", "paper:hsap-table4") for m, v in (("hsap", ph), ("packing", pp), ("batching", pb))]
            paper_cells = [f"{ph:.0f}/{pp:.0f}/{pb:.0f}", f"{ph / pp:.2f}×"]
        else:
            paper_cells = ["-", "-"]
        table.append([ds, f"{T // 1024}K", topo, h, flattened_cell(flat, n_seeds), f"{REGISTRY[bn].label}: {bb:.0f}", f"{h / bb:.2f}×", p, b, f"{h / p:.2f}×", *paper_cells])
    md = [f"### Table 4 — LLaMA-2-7B end to end, 8 simulated A100s, tokens/s per GPU (median of {n_seeds} seed(s); "
          f"non-attention at {hw.dense_mfu:.0%} of {hw.dense_peak_flops / 1e12:.0f} TFLOP/s)", "",
          markdown_table(["dataset", "T", "topology", "HSAP", "HSAP flattened", "best document-aware baseline", "HSAP / best", "packing (document-blind)",
                          "batching", "HSAP/packing", "paper H/P/B", "paper H/P"], table), "",
          *losses.markdown(["dataset", "T", "topology"])]
    labels = [f"{r[0][:4]} {r[1]} {r[2]}" for r in table]
    png = _plot(Path(out_dir) / "table4.png", labels, {"HSAP": [r[3] for r in table],
                "best document-aware baseline": [float(r[5].split(": ")[1]) for r in table], "packing": [r[7] for r in table],
                "batching": [r[8] for r in table]}, "tokens/s per GPU", "Table 4 (simulated)")
    return Report("table4", rows, "\n".join(md), [png]).write(out_dir)

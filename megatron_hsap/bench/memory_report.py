"""``megatron-hsap memory``: the tables, plot and command line of the per-GPU memory planner
(the estimates themselves are ``memory.py``'s)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_hsap.bench.memory import (DEFAULT_RESERVE_GIB, GIB, MemoryBreakdown, MemoryOptions, Method, PoolFn,
                                        best_max_seq_length, best_peak, config_layout, estimate, max_seq_length,
                                        plan_pool)
from megatron_hsap.argtypes import (HelpFormatter, link_line, nonnegative_float, positive_float, positive_int,
                                   writable_file)
from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import LaunchConfig, load_config

__all__ = ["main", "breakdown_table", "comparison_tables", "plot_peaks"]


def _tok(n: int) -> str:
    if n == 0:
        return "OOM"
    return f"{n / 2**20:g}M" if n >= 2**20 and n % 2**17 == 0 else f"{n // 1024}K"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def breakdown_table(b: MemoryBreakdown, caps: Sequence[float], reserve: float) -> str:
    rows = [("parameters (bf16)", b.params), ("gradients (fp32 main grads)", b.grads),
            ("optimizer (fp32 params + Adam moments)", b.optimizer),
            ("activations kept for backward", b.activations),
            ("recompute working set", b.recompute_working),
            (f"{b.layout.method.title} buffers", b.attention), ("logits + loss", b.logits)]
    lines = ["| component | GiB |", "|---|---:|"] + [f"| {k} | {_gib(v)} |" for k, v in rows]
    lines.append(f"| **total** | **{_gib(b.total)}** |")
    for cap in caps:
        verdict = "fits" if b.fits(cap, reserve) else "**OOM**"
        lines.append(f"| {cap:g} GiB GPU (usable {cap - reserve:g}) | {verdict} |")
    return "\n".join(lines)


def comparison_tables(cfg: LaunchConfig, caps: Sequence[float], seqs: Sequence[int],
                      opts: MemoryOptions, pool: PoolFn) -> str:
    """Markdown: longest sequence per method and GPU size, and the Figure 5 fit grid."""
    head = "| method | " + " | ".join(f"{c:g} GiB: longest | layout" for c in caps) + " |"
    lines = [head, "|---|" + "---:|---|" * len(caps)]
    notes: list[str] = []
    for method in Method:
        cells = []
        for cap in caps:
            lay, n, why = best_max_seq_length(cfg, method, cap, opts, pool)
            cells.append(f"{_tok(n)} | {lay.label() if lay else 'n/a'}")
            if why and why not in notes:
                notes.append(why)
        lines.append(f"| {method.title} | " + " | ".join(cells) + " |")
    grid = ["| seq | " + " | ".join(m.title for m in Method) + " |", "|---:|" + "---:|" * len(Method)]
    usable = (min(caps) - opts.reserve_gib) * GIB
    for seq in seqs:
        cells = []
        for method in Method:
            b = best_peak(cfg, method, seq, opts, pool)
            cells.append("n/a" if b is None else f"{_gib(b.total)}{'' if b.total <= usable else ' OOM'}")
        grid.append(f"| {_tok(seq)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + ("\n\n" + "\n".join(f"Note: {n}." for n in notes) if notes else "")
    text += (f"\n\nPeak GiB per GPU at each method's best layout (OOM above {min(caps):g} GiB "
             f"− {opts.reserve_gib:g} GiB reserve):\n\n" + "\n".join(grid))
    return text


def plot_peaks(cfg: LaunchConfig, caps: Sequence[float], seqs: Sequence[int], opts: MemoryOptions,
               pool: PoolFn, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method in Method:
        points = [(seq, b.total / GIB) for seq in seqs if (b := best_peak(cfg, method, seq, opts, pool))]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=method.title)
    for cap in caps:
        ax.axhline(cap - opts.reserve_gib, linestyle="--", color="grey", linewidth=0.8)
        ax.text(seqs[-1], cap - opts.reserve_gib, f"{cap:g} GiB GPU ", va="bottom", ha="right", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(seqs), [_tok(s) for s in seqs])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("estimated peak GiB per GPU")
    ax.set_title(f"{cfg.name}: {cfg.world_size} GPUs, best layout per method")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megatron-hsap memory", description=__doc__.split("\n\n")[0] +
                                 " The topology (TP, P_intra × P_inter) is the config's. Seconds.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--config", required=True, help="launch config YAML (configs/*.yaml)")
    ap.add_argument("--gpu-mem-gib", type=positive_float, nargs="+", help="GPU sizes (default: the config's)")
    ap.add_argument("--reserve-gib", type=nonnegative_float, default=DEFAULT_RESERVE_GIB,
                    help="CUDA context, NCCL buffers, fragmentation")
    ap.add_argument("--seq-lengths", nargs="+", default=["32K", "64K", "128K", "256K", "512K", "1M", "2M"],
                    help="sequence lengths of the comparison tables")
    ap.add_argument("--mean-doc-tokens", type=positive_int, help="TE ring document padding (default: one document)")
    ap.add_argument("--no-plan", action="store_true", help="pool from the formula, not compile_plan")
    ap.add_argument("--plot", type=writable_file, help="write a PNG of peak memory vs sequence length (default: none)")
    ns = ap.parse_args(argv)
    from megatron_hsap.launch.config import parse_tokens

    try:
        cfg = load_config(ns.config)
        seqs = [parse_tokens(v, "--seq-lengths") for v in ns.seq_lengths]
    except ConfigError as exc:
        print(f"megatron-hsap memory: error: {exc}", file=sys.stderr)
        return 2
    caps = ns.gpu_mem_gib or [cfg.cluster.gpu_mem_gib]
    opts = MemoryOptions(reserve_gib=ns.reserve_gib, use_plan=not ns.no_plan,
                         mean_doc_tokens=ns.mean_doc_tokens)
    pool = plan_pool(cfg, opts)
    lay = config_layout(cfg)
    b = estimate(cfg, lay, cfg.training.seq_length, opts, pool)
    print(f"# Memory plan: {cfg.name} ({cfg.world_size} GPUs, "
          f"{cfg.model.num_parameters() / 1e9:.2f}B parameters)\n")
    print(f"## This config: {lay.method.title} {lay.label()}, seq {_tok(cfg.training.seq_length)}, "
          f"recompute {cfg.training.recompute.value}, sharding {cfg.parallel.sharding.value}\n")
    par = cfg.parallel
    print(link_line(intra=par.hsap_intra_size, inter=par.hsap_inter_size, tp=par.tensor,
                    gpus_per_node=cfg.cluster.gpus_per_node) + "\n")
    print(breakdown_table(b, caps, opts.reserve_gib))
    if b.pool_source:
        print(f"\nHSAP pool: {b.pool_source}.")
    print("\n## Longest sequence that fits (best layout per method; same sharding and recompute)\n")
    print(comparison_tables(cfg, caps, seqs, opts, pool))
    fits = [(max_seq_length(cfg, lay, cap, opts, pool), cap) for cap in caps]
    own = ", ".join(f"up to {_tok(n)} on {cap:g} GiB" if n else f"no sequence on {cap:g} GiB (not even its shortest, "
                    f"{lay.granule()} tokens)" for n, cap in fits)
    print(f"\nThis config's own layout ({lay.method.title} {lay.label()}) fits {own}.")
    if ns.plot:
        plot_peaks(cfg, caps, seqs, opts, pool, ns.plot)
        print(f"\nwrote {ns.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

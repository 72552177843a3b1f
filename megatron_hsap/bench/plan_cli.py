"""``megatron-hsap plan``: compile one packed batch, print a rank's program, the plan's figures and
the verifier's verdict; optionally draw the paper's Figure 3 picture.

    megatron-hsap plan --sample                      # Figure-3-like batch: 8 ranks, 6 documents
    megatron-hsap plan --cu-seqlens 0,3000,9000,16384 --inter-size 4 --rank 2 --phase bwd
    megatron-hsap plan --workload fineweb --tokens 65536 --intra-size 2 --inter-size 8 --seed 3 --json
    megatron-hsap plan --sample --plot figure3.png   # mask blocks coloured by computing rank
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from megatron_hsap.argtypes import (HelpFormatter, add_topology_args, link_line, nonnegative_int, positive_int,
                                   writable_file)
from megatron_hsap.errors import HSAPError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.options import FLATTEN
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.stats import PlanStats

__all__ = ["main", "sample_cu_seqlens", "plot_plan"]

SAMPLE_CHUNK = 4096


def sample_cu_seqlens(chunk: int = SAMPLE_CHUNK) -> list[int]:
    """A Figure-3-like batch for 8 inter ranks of ``chunk`` tokens: 6 documents, one spanning
    ranks 0–3, one spanning ranks 3–5, one ending on a chunk edge, two sharing rank 6 and one
    filling rank 7."""
    c = chunk
    return [0, 3 * c + c // 2, 5 * c + c // 2, 6 * c, 6 * c + (9 * c) // 16, 7 * c, 8 * c]


def _parse_cu(text: str) -> list[int]:
    """argparse type of ``--cu-seqlens``: an empty value is an error, never the sample batch."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers 0,l0,l0+l1,...,T, got {text!r}") from None
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"needs at least two entries 0,...,T, got {text!r}")
    return values


def plot_plan(plan, path: Path, *, max_labels: int = 400) -> Path:
    """Figure 3: the document-causal mask (x: key, y: query), each compute block coloured by the
    inter rank computing it and labelled with its stage; chunk edges dashed, documents marked on
    both axes. Uses matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon

    T = plan.padded_tokens
    units = plan.compute_units()
    cmap = plt.get_cmap("tab10" if plan.inter_size <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(7.5, 7.0))
    total = float(T) * T / 2
    big = sorted(units, key=lambda u: -(len(u[2]) * len(u[3])))[:max_labels]
    labelled = {id(u) for u in big}
    for u in units:
        rank, stage, q, kv, causal = u
        if causal:
            pts = [(kv.start, q.start), (q.start, q.start), (q.stop, q.stop), (kv.start, q.stop)]
            area = (q.start - kv.start) * len(q) + len(q) ** 2 / 2
        else:
            pts = [(kv.start, q.start), (kv.stop, q.start), (kv.stop, q.stop), (kv.start, q.stop)]
            area = len(q) * len(kv)
        ax.add_patch(Polygon(pts, closed=True, facecolor=cmap(rank % cmap.N), edgecolor="white", linewidth=0.3))
        if id(u) in labelled and area > total * 2e-3:
            cx = (kv.start + (q.start + q.stop) / 2) / 2 if causal else (kv.start + kv.stop) / 2
            cy = (q.start + 2 * q.stop) / 3 if causal else (q.start + q.stop) / 2
            ax.text(cx, cy, str(stage), ha="center", va="center", fontsize=7, color="black")
    chunk = plan.chunk_tokens
    for i in range(1, plan.inter_size):
        ax.axhline(i * chunk, color="grey", lw=0.6, ls="--")
        ax.axvline(i * chunk, color="grey", lw=0.6, ls="--")
    starts = plan.batch.doc_starts
    for d in range(plan.batch.num_docs):
        a, b = int(starts[d]), int(starts[d + 1])
        shade = "0.85" if d % 2 else "0.6"
        ax.plot([a, b], [-0.012 * T, -0.012 * T], color=shade, lw=5, solid_capstyle="butt", clip_on=False)
        ax.plot([-0.012 * T, -0.012 * T], [a, b], color=shade, lw=5, solid_capstyle="butt", clip_on=False)
        if b - a > 0.04 * T:
            ax.text((a + b) / 2, -0.03 * T, f"S{d + 1}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, T)
    ax.set_ylim(T, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key token (KV)")
    ax.set_ylabel("query token (Q)")
    s = plan.stats()
    ax.set_title(f"SAP plan: {plan.inter_size} inter ranks, {s.placement}\n"
                 f"colour = computing rank, number = stage; imbalance {s.imbalance:.3f}, "
                 f"efficiency {s.efficiency:.3f}", fontsize=9, pad=24)
    handles = [plt.Line2D([], [], marker="s", ls="", color=cmap(r % cmap.N), label=f"rank {r}") for r in range(plan.inter_size)]
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncol=2 if plan.inter_size > 8 else 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _stats_lines(s: PlanStats) -> list[str]:
    keys = [
        ("placement", "{}"), ("imbalance", "{:.3f}"), ("owner_imbalance", "{:.3f}"), ("estimated_time_s", "{:.4g} s"),
        ("owner_computes_time_s", "{:.4g} s"), ("lower_bound_s", "{:.4g} s"), ("efficiency", "{:.3f}"),
        ("compute_efficiency", "{:.3f}"), ("compute_dominated", "{}"), ("bytes_total", "{:,} B"),
        ("necessary_bytes", "{:,} B"), ("bytes_over_necessary", "{:.3f}"), ("stages", "{}"), ("rounds_fwd", "{}"),
        ("rounds_bwd", "{}"), ("pool_capacity_bytes", "{:,} B"), ("pool_peak_bytes", "{:,} B"), ("pool_use", "{:.2f}"),
        ("compute_items", "{}"), ("messages_fwd", "{}"), ("messages_bwd", "{}"), ("head_chunks", "{}"),
        ("flattened_from", "{}"),
    ]
    return [f"  {k:<24} {fmt.format(getattr(s, k))}" for k, fmt in keys]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-hsap plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--sample", action="store_true", help="the Figure-3-like batch (the default when no batch is given)")
    src.add_argument("--cu-seqlens", type=_parse_cu, help="global cu_seqlens, comma-separated: 0,l0,l0+l1,...,T")
    src.add_argument("--workload", choices=("fineweb", "slimpajama", "ultrachat", "sharegpt", "full"),
                     help="pack a seeded batch of --tokens tokens from this workload")
    ap.add_argument("--tokens", type=positive_int, default=65536, help="T for --workload")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="seed for --workload")
    add_topology_args(ap, intra=1, inter=8)
    ap.add_argument("--tp", type=positive_int, default=1,
                    help="tensor-parallel size: only enters the link rule (the CP group is TP × P_intra × P_inter GPUs)")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node, for the link rule")
    ap.add_argument("--heads", type=positive_int, default=32, help="q heads per TP rank")
    ap.add_argument("--kv-heads", type=positive_int, default=None, help="kv heads per TP rank (default: --heads; fewer = GQA)")
    ap.add_argument("--head-dim", type=positive_int, default=128, help="q/k head dimension")
    ap.add_argument("--head-dim-v", type=positive_int, default=None, help="v head dimension (default: --head-dim)")
    ap.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per element (2: bf16)")
    ap.add_argument("--link", choices=("nvlink", "ib"), default=None,
                    help="force the link class (default: NVLink when the CP group fits one node, docs/design.md §4)")
    ap.add_argument("--pool-bytes", type=positive_int, default=None,
                    help="receive-pool capacity (default: the planner's, 4 inter chunks)")
    ap.add_argument("--head-chunks", type=positive_int, default=None,
                    help="head chunks the intra all-to-all is pipelined over (default: the planner's choice)")
    ap.add_argument("--flatten", choices=FLATTEN, default=None,
                    help="plan the batch as pure SAP over all CP ranks (1 x P) or one all-to-all over them (P x 1) "
                         "when estimated faster (auto), always 1 x P, always P x 1 (all-to-all) "
                         "(default: never; plan/flatten.py)")
    ap.add_argument("--layout", choices=("contiguous", "balanced"), default=None,
                    help="token layout (default: compile_plan's, balanced; the --sample batch: contiguous, as in Figure 3)")
    ap.add_argument("--rank", type=nonnegative_int, default=None, help="inter rank whose program to print (default: the busiest)")
    ap.add_argument("--phase", choices=[p.value for p in Phase], default=Phase.FWD.value, help="which program to print")
    ap.add_argument("--max-lines", type=nonnegative_int, default=120, help="truncate the printed program (0: all)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (stats, program, verification)")
    ap.add_argument("--plot", type=writable_file, default=None, help="write the Figure-3 picture to this PNG (default: none)")
    ap.add_argument("--no-verify", action="store_true", help="skip the verifier")
    return ap


def layout_line(plan) -> str:  # noqa: ANN001
    """Which token layout the plan kept, and why (``balanced`` falls back to ``contiguous`` where
    the paper's layout is estimated faster, docs/design.md §2.1)."""
    asked, kept = plan.options.layout, plan.layout.name
    if asked == kept:
        why = "as requested" if asked == "contiguous" or not plan.options.layout_fallback else \
            "estimated faster than the contiguous one"
        return f"layout {kept} ({why})"
    return f"layout {kept} (requested {asked}; the contiguous plan was estimated at least as fast, so it was kept)"


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    # without --flatten the plan keeps the topology asked for: a rank it lacks is known before compiling
    if args.rank is not None and args.flatten in (None, "never") and args.rank >= args.inter_size:
        ap.error(f"--rank {args.rank} is out of range for --inter-size {args.inter_size} (inter ranks 0..{args.inter_size - 1})")

    if args.cu_seqlens is not None:
        cu = args.cu_seqlens
    elif args.workload:
        from megatron_hsap.plan.workloads import pack_batches

        cu = pack_batches(args.workload, args.tokens, 1, args.seed)[0].tolist()
    else:
        cu = sample_cu_seqlens()
        if args.inter_size != 8:
            print("note: the sample batch is laid out for 8 inter ranks", file=sys.stderr)
    options: dict[str, object] = {"tp_size": args.tp, "gpus_per_node": args.gpus_per_node}
    if args.link:
        options["link"] = args.link
    if args.pool_bytes:
        options["pool_bytes"] = args.pool_bytes
    if args.head_chunks:
        options["head_chunks"] = args.head_chunks
    options["flatten"] = args.flatten or "never"  # the CLI shows the topology it was asked for unless told
    layout = args.layout or ("contiguous" if cu == sample_cu_seqlens() else None)
    if layout:
        options["layout"] = layout
    try:
        t0 = time.perf_counter()
        plan = compile_plan(cu, args.inter_size, args.intra_size, num_heads=args.heads, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, head_dim_v=args.head_dim_v, dtype_bytes=args.dtype_bytes, **options)
        compile_s = time.perf_counter() - t0
        stats = plan.stats()
        rank = args.rank if args.rank is not None else int(np.argmax(stats.work_per_rank))
        if not 0 <= rank < plan.inter_size:  # (--flatten changed the topology)
            print(f"megatron-hsap plan: error: --rank {rank} is out of range for the {plan.intra_size}x{plan.inter_size} "
                  f"plan --flatten {args.flatten} compiled (inter ranks 0..{plan.inter_size - 1})", file=sys.stderr)
            return 2
        verdict = "skipped"
        if not args.no_verify:
            t0 = time.perf_counter()
            plan.verify()
            verdict = f"verified in {time.perf_counter() - t0:.3f} s (rounds match, data present, no live slot reused, every pair once)"
    except HSAPError as exc:
        print(f"megatron-hsap plan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    program = plan.dump(rank, Phase(args.phase))
    lines = program.splitlines()
    if args.max_lines and len(lines) > args.max_lines + 1:
        program = "\n".join(lines[: args.max_lines + 1] + [f"      ... {len(lines) - 1 - args.max_lines} more lines (--max-lines 0 prints all)"])
    try:
        plot_path = plot_plan(plan, args.plot) if args.plot else None
    except OSError as exc:
        print(f"megatron-hsap plan: cannot write --plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    links = link_line(intra=plan.intra_size, inter=plan.inter_size, tp=args.tp, gpus_per_node=args.gpus_per_node,
                      forced=args.link)
    if args.json:
        out = {"cu_seqlens": list(cu), "compile_s": compile_s, "rank": rank, "phase": args.phase,
               "link": plan.link.value, "link_reason": links, "layout": plan.layout.name,
               "layout_requested": plan.options.layout,
               "stats": stats.as_dict(), "program": program, "verification": verdict,
               "plot": str(plot_path) if plot_path else None}
        print(json.dumps(out, indent=2, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
        return 0
    n_docs = plan.batch.num_docs
    flat = plan.options.flattened_from
    flat_note = f", flattened from {flat[0]}x{flat[1]}: plan/flatten.py" if flat else ""
    print(f"batch: T={plan.num_tokens} (padded {plan.padded_tokens}), {n_docs} documents, "
          f"topology {plan.intra_size}x{plan.inter_size} (intra×inter{flat_note}), chunk {plan.chunk_tokens} tokens, "
          f"heads {plan.shape.num_heads}/{plan.shape.num_kv_heads} per rank")
    print(links)
    print(layout_line(plan))
    print(f"compiled in {compile_s * 1e3:.1f} ms\n")
    print(program)
    print("\nplan:")
    print("\n".join(_stats_lines(stats)))
    print(f"  {'work_per_rank':<24} {list(stats.work_per_rank)}")
    print(f"\nverification: {verdict}")
    if plot_path:
        print(f"plot: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

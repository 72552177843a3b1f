"""Sliding-window plan quality (issue 15 item 6): ``python -m megatron_hsap.bench.window_quality``.

On the docs/design.md §4 measurement set (the four workloads of ``workloads.md`` plus ``full``, one
document filling the batch; bf16, d 128, MHA 32/32 and GQA 32/8, ``P_intra`` 1, seeded batches),
each batch is planned twice with the same options — full causal, and with a sliding window of
``--window`` keys (default 4096, ``window_size=(4096, 0)``) — and the two plans are compared:
bytes moved (forward + backward), estimated time (docs/design.md §4 model, A100 constants) and
total work. Both plans choose their own layout (``layout="balanced"`` with its fallback, the
default); ``--shared-layout`` compiles the windowed plan on the full plan's layout instead
(``Plan.with_window``, what a model mixing full and windowed layers runs).

Writes ``window_quality.csv`` (the docs/design.md §4 columns) and ``window_quality.md`` (median and
worst over the seeds of windowed / full ratios) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import numpy as np

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.hardware import link_class_for
from megatron_hsap.plan.workloads import pack_batches

__all__ = ["measure", "main"]

COLUMNS = ("source", "workload", "T", "P_intra", "P_inter", "link", "heads", "seed", "method", "metric", "value", "unit")
WORKLOADS = ("fineweb", "slimpajama", "ultrachat", "sharegpt", "full")
POINTS = ((64 * 1024, 8), (256 * 1024, 16))
HEADS = {"mha": (32, 32), "gqa": (32, 8)}


def measure(window: int, seeds: int, points=POINTS, workloads=WORKLOADS, shared_layout: bool = False) -> list[tuple]:
    """CSV rows: per batch, the full and windowed plans' bytes, estimated time and work."""
    rows = []
    for workload in workloads:
        for T, P in points:
            batches = pack_batches(workload, T, seeds, 0) if workload != "full" else [np.array([0, T])]
            link = link_class_for(P).value
            for name, (hq, hkv) in HEADS.items():
                for seed, cu in enumerate(batches):
                    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=128, link=link)
                    full = compile_plan(cu, P, **kw)
                    win = full.with_window((window, 0)) if shared_layout else compile_plan(cu, P, window_size=(window, 0), **kw)
                    for method, plan in (("hsap-full", full), (f"hsap-window{window}", win)):
                        s = plan.stats()
                        base = ("window_quality", workload, T, 1, P, link, f"{hq}/{hkv}", seed, method)
                        rows += [base + ("bytes", float(s["bytes_total"]), "B"),
                                 base + ("estimated_time", float(s["estimated_time_s"]), "s"),
                                 base + ("total_work", float(s["total_work"]), "pairs"),
                                 base + ("imbalance", float(s["imbalance"]), "ratio")]
    return rows


def markdown(rows: list[tuple], window: int) -> str:
    """Median (worst) over the seeds of windowed / full, per workload, point and head shape."""
    table: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        key = (r[1], r[2], r[4], r[6])
        table.setdefault(key, {}).setdefault(f"{r[8]}:{r[9]}", {})[r[7]] = r[10]
    out = [f"| workload | T | P_inter | heads | bytes window/full | est. time window/full | work window/full |",
           "|---|---|---|---|---|---|---|"]
    for (wl, T, P, heads), d in table.items():
        cells = []
        for metric in ("bytes", "estimated_time", "total_work"):
            full, win = d[f"hsap-full:{metric}"], d[f"hsap-window{window}:{metric}"]
            ratios = [win[s] / full[s] if full[s] else 1.0 for s in full]
            cells.append(f"{statistics.median(ratios):.3f} ({max(ratios):.3f})")
        out.append(f"| {wl} | {T // 1024}K | {P} | {heads} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=4096, help="keys each token attends back (window_size=(W, 0))")
    ap.add_argument("--seeds", type=int, default=5, help="seeded batches per point")
    ap.add_argument("--shared-layout", action="store_true", help="windowed plan on the full plan's layout")
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    rows = measure(args.window, args.seeds, shared_layout=args.shared_layout)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_shared" if args.shared_layout else ""
    with open(args.out / f"window_quality{suffix}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    md = markdown(rows, args.window)
    (args.out / f"window_quality{suffix}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

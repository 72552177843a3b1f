"""Picture of the contiguous and balanced layouts of one batch (README "Layouts").

``python -m megatron_hsap.bench.layout_plot --out docs/layouts.png`` draws, for one packed batch,
which inter rank holds each token under both layouts (documents marked), and each rank's exact
owner-computes work before any SAP move.
"""

from __future__ import annotations

import argparse

import numpy as np

from megatron_hsap.plan.balanced import balanced_layout
from megatron_hsap.plan.layout import Batch, Layout, contiguous_layout
from megatron_hsap.plan.units import build_units
from megatron_hsap.plan.workloads import WORKLOADS, pack_batches

__all__ = ["main", "rank_work"]


def rank_work(batch: Batch, layout: Layout) -> np.ndarray:
    """Owner-computes pairs per inter rank (q rows × every earlier key of their document)."""
    _, units = build_units(batch, layout)
    work = np.zeros(layout.inter_size)
    for u in units:
        work[u.q_owner] += u.work
    return work


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_hsap.bench.layout_plot", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="slimpajama", choices=list(WORKLOADS))
    p.add_argument("--tokens", type=int, default=1 << 16)
    p.add_argument("--inter-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/layouts.png")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cu = pack_batches(args.workload, args.tokens, 1, args.seed)[0]
    batch = Batch.build(cu, args.inter_size)
    layouts = [contiguous_layout(batch, args.inter_size, 1), balanced_layout(batch, args.inter_size, 1)]
    cmap = plt.get_cmap("tab10" if args.inter_size <= 10 else "tab20")
    fig, axes = plt.subplots(2, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [4, 1]})
    for row, layout in enumerate(layouts):
        owner, _ = layout.owner_array(batch.padded_tokens)
        ax = axes[row][0]
        ax.imshow(owner[None, :], aspect="auto", cmap=cmap, vmin=0, vmax=max(cmap.N, args.inter_size) - 1,
                  interpolation="nearest", extent=(0, batch.padded_tokens, 0, 1))
        for s in batch.doc_starts[1:-1]:
            ax.axvline(s, color="black", lw=0.4)
        ax.set_yticks([])
        ax.set_title(f"{layout.name}: owner inter rank of each token (lines: document boundaries)", fontsize=9)
        work = rank_work(batch, layout)
        bx = axes[row][1]
        bx.bar(range(args.inter_size), work / work.mean(), color=[cmap(r % cmap.N) for r in range(args.inter_size)])
        bx.axhline(1.0, color="black", lw=0.6)
        bx.set_title(f"work / mean (max {work.max() / work.mean():.2f})", fontsize=9)
        bx.set_xticks(range(args.inter_size))
    axes[1][0].set_xlabel(f"global token ({args.workload}, T={args.tokens}, {batch.num_docs} documents, P_inter={args.inter_size})")
    fig.tight_layout()
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-rank timelines (Gantt charts) of simulated runs, as PNG.

Each rank is one row: kernels (compute), merges, all-to-alls, blocking collectives, and exposed
waits on P2P rounds in distinct colours; thin bars under each row show when the rank's outgoing
transfers were on the wire. ``gantt()`` draws HSAP next to TE's THD ring on the same batch.
"""

from __future__ import annotations

from pathlib import Path

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.engine import Timeline
from megatron_hsap.sim.methods import MethodRun, full_shape, run_method, unavailable
from megatron_hsap.sim.results import Report, markdown_table

__all__ = ["draw_timelines", "gantt"]

COLOURS = {
    "compute": "#4C72B0",
    "merge": "#DD8452",
    "a2a": "#8172B3",
    "collective": "#937860",
    "sync": "#CCCCCC",
    "wait": "#C44E52",
    "transfer": "#55A868",
}


def draw_timelines(panels: list[tuple[str, Timeline]], path: str | Path) -> Path:
    """One panel per (title, timeline), shared time axis in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [max(1.5, 0.35 * len(tl.finish) + 0.8) for _, tl in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False)
    horizon = max(tl.makespan for _, tl in panels) * 1e3
    for ax, (title, tl) in zip(axes[:, 0], panels):
        for s in tl.spans:
            ax.barh(s.rank, (s.end - s.start) * 1e3, left=s.start * 1e3, height=0.6, color=COLOURS.get(s.kind, "#999999"), linewidth=0)
        for src, _dst, start, end, _nb, _label in tl.transfers:
            ax.barh(src + 0.38, (end - start) * 1e3, left=start * 1e3, height=0.12, color=COLOURS["transfer"], linewidth=0)
        ax.set_ylim(len(tl.finish) - 0.5, -0.6)
        ax.set_yticks(range(len(tl.finish)), [f"rank {r}" for r in range(len(tl.finish))], fontsize=7)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{title} — {tl.makespan * 1e3:.2f} ms", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower center", ncol=len(COLOURS), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gantt(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str = "slimpajama",
          topology: str = "1x8", tokens: int | None = None) -> Report:
    """HSAP (forward and backward) and TE's THD ring (forward) on one batch of the MagiAttention
    protocol (H100, GQA 64:8, 8K tokens per GPU, documents ≤ 1/4 of the batch)."""
    intra, inter = (int(x) for x in topology.split("x"))
    shape = full_shape(64, 8)
    why = unavailable("hsap", intra=intra, inter=inter, shape=shape)
    if why:
        raise ConfigError(f"gantt: HSAP cannot run {topology} with {shape.num_heads}/{shape.num_kv_heads} heads: {why}; "
                          f"choose an --intra-size dividing {shape.num_heads}")
    if quick:  # a smaller picture: 4 GPUs, 4K tokens each
        intra, inter = (1, 4) if intra == 1 else (intra, max(1, 4 // intra))
        topology = f"{intra}x{inter}"
    P = intra * inter
    T = tokens or (4096 if quick else 8192) * P
    hw = sim_hardware("h100-fa3")
    cu = pack_batches(workload, T, 1, 0, max_doc_fraction=0.25)[0]
    hsap = run_method("hsap", cu, hw=hw, intra=intra, inter=inter, shape=shape)
    ring = run_method("te_thd_ring", cu, hw=hw, intra=1, inter=P, shape=shape)
    assert hsap is not None and ring is not None  # (the flat ring runs at every P)
    panels = [(f"HSAP {topology} forward (inter group 0)", hsap.fwd.timeline), (f"HSAP {topology} backward", hsap.bwd.timeline),
              (f"TE THD ring 1x{P} forward", ring.fwd.timeline)]
    png = draw_timelines(panels, Path(out_dir) / "gantt.png")
    md = ["### Per-rank timeline (simulated)", "", f"![gantt]({png.name})", "",
          markdown_table(["run", "forward ms", "backward ms"], [[_label(r), r.fwd.seconds * 1e3, r.bwd.seconds * 1e3] for r in (hsap, ring)])]
    return Report("gantt", [], "\n".join(md), [png]).write(out_dir)


def _label(run: MethodRun) -> str:
    return f"{run.method} {run.topology}"

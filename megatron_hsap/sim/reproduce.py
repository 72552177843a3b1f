"""Reproductions of the paper's Tables 2 and 3 (Table 4 and MagiAttention's protocol live in
``table4.py`` and ``magi.py``), each one call returning a ``Report`` (CSV rows, markdown, PNG).

Batches: ``pack_batches(workload, T, 1, seed)`` for seeds ``0..n−1`` (docs/design.md §4: median and
worst over seeded batches). The paper does not say how its "hybrid-context" batches were packed;
we use the ``slimpajama`` mixture (short web documents plus ArXiv/Books tails) by default.
Our SAP balances exact (q, k) pairs, not the paper's block counts (docs/design.md §2.1), so per-point
differences from the paper come partly from that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim import paper
from megatron_hsap.sim.config import SimHardware, sim_hardware
from megatron_hsap.sim.methods import MethodRun, full_shape, run_method, unavailable
from megatron_hsap.sim.results import Report, Row, markdown_table

__all__ = ["table2", "table3", "best_hsap", "hsap_topologies", "method_rows", "Point", "progress"]


def progress(items: list, desc: str) -> Any:
    """tqdm on stderr at a terminal; otherwise one line per item on stderr (logs, CI)."""
    import sys

    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="pt", leave=False, file=sys.stderr)
    return _lines(items, desc)


def _lines(items: list, desc: str) -> Any:
    import sys

    for i, item in enumerate(items):
        print(f"{desc}: {i + 1}/{len(items)} {item}", file=sys.stderr, flush=True)
        yield item


@dataclass(frozen=True, slots=True)
class Point:
    """Fields shared by every CSV row of one simulated configuration."""

    workload: str
    T: int
    P_intra: int
    P_inter: int
    link: str
    heads: str
    seed: int | str

    def row(self, method: str, metric: str, value: float | str, unit: str, source: str = "sim") -> Row:
        return Row(source, self.workload, self.T, self.P_intra, self.P_inter, self.link, self.heads, self.seed, method, metric, value, unit)


def method_rows(pt: Point, run: MethodRun) -> list[Row]:
    """The standard metrics of one simulated run."""
    rows = [
        pt.row(run.method, "fwd_time", run.fwd.seconds * 1e3, "ms"),
        pt.row(run.method, "bwd_time", run.bwd.seconds * 1e3, "ms"),
        pt.row(run.method, "time", run.seconds * 1e3, "ms"),
        pt.row(run.method, "fwd_tflops_per_gpu", run.tflops_per_gpu("fwd"), "TFLOP/s"),
        pt.row(run.method, "bwd_tflops_per_gpu", run.tflops_per_gpu("bwd"), "TFLOP/s"),
        pt.row(run.method, "topology", run.topology, "intra x inter"),
    ]
    if "compile_s" in run.extra:
        rows.append(pt.row(run.method, "compile_time", run.extra["compile_s"], "s"))
        rows.append(pt.row(run.method, "plan_imbalance", run.extra["plan"]["imbalance"], "ratio"))
        rows.append(pt.row(run.method, "planner_estimate", run.extra["plan"]["estimated_time_s"] * 1e3, "ms"))
        rows.append(pt.row(run.method, "merge_time_max_rank", 1e3 * max(run.fwd.timeline.busy("merge").max(), 0.0)
                           + 1e3 * run.bwd.timeline.busy("merge").max(), "ms"))
    return rows


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """``(fn(...), "")``, or ``(None, "ErrorType: message")`` when it raises: one failing plan
    must not hide a whole table; the failure is printed in its cell and counted as a miss."""
    try:
        return fn(*args, **kwargs), ""
    except Exception as exc:  # noqa: BLE001 - reported in the output, never swallowed silently
        return None, f"{type(exc).__name__}: {exc}"[:160]


def hsap_topologies(cu: np.ndarray, *, hw: SimHardware, P: int, shape: Any, intras: tuple[int, ...] = (1, 2, 4, 8)) -> list[MethodRun]:
    """HSAP at every valid topology (P_intra inside one node and dividing the heads)."""
    runs = []
    for intra in intras:
        if P % intra or intra > hw.gpus_per_node or unavailable("hsap", intra=intra, inter=P // intra, shape=shape):
            continue
        run, err = attempt(run_method, "hsap", cu, hw=hw, intra=intra, inter=P // intra, shape=shape)
        if run is not None:
            runs.append(run)
        elif err:
            print(f"warning: HSAP {intra}x{P // intra} failed on this batch: {err}")
    return runs


def best_hsap(cu: np.ndarray, *, hw: SimHardware, P: int, shape: Any, intras: tuple[int, ...] = (1, 2, 4, 8)) -> MethodRun | None:
    """HSAP at the fastest valid topology (forward + backward)."""
    runs = hsap_topologies(cu, hw=hw, P=P, shape=shape, intras=intras)
    return min(runs, key=lambda r: r.seconds) if runs else None


def _seeds(quick: bool, seeds: int | None) -> list[int]:
    return list(range(1 if quick else (seeds or 3)))


def _link(P: int) -> str:
    return "nvlink" if P <= 8 else "ib"


def _plot(path: Path, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, log: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(labels) + 2), 3.6))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for i, (name, vals) in enumerate(series.items()):
        ax.bar(x + i * width - 0.4 + width / 2, [v if v == v else 0 for v in vals], width, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left", frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table2(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str = "slimpajama") -> Report:
    """Table 2: SAP (P_intra 1) vs DistFlashAttn, attention forward + backward, A100, 16 heads
    of 128, SP 2–16; target: our speed-up ≥ the paper's at every point."""
    hw = sim_hardware("a100")
    shape = full_shape(16, 16)
    points = list(paper.TABLE2)[: 3 if quick else None]
    rows: list[Row] = []
    table = []
    errors: list[str] = []
    dfa_col: list[float] = []
    for sp, T in progress(points, "table2"):
        sap_t, dfa_t = [], []
        for seed in _seeds(quick, seeds):
            cu = pack_batches(workload, T, 1, seed)[0]
            pt = Point(workload, T, 1, sp, _link(sp), "16/16", seed)
            sap, err = attempt(run_method, "hsap", cu, hw=hw, intra=1, inter=sp, shape=shape)
            dfa = run_method("distflashattn", cu, hw=hw, intra=1, inter=sp, shape=shape)
            assert dfa is not None
            rows += method_rows(pt, dfa)
            dfa_t.append(dfa.seconds * 1e3)
            if sap is None:
                errors.append(f"SP {sp}, T {T}, seed {seed}: planner failed — {err}")
                rows.append(pt.row("hsap", "error", err, "text"))
                sap_t.append(float("nan"))
                continue
            rows += method_rows(pt, sap)
            rows.append(pt.row("hsap", "speedup_vs_distflashattn", dfa.seconds / sap.seconds, "x"))
            sap_t.append(sap.seconds * 1e3)
        p_dfa, p_sap = paper.TABLE2[(sp, T)]
        pt = Point(workload, T, 1, sp, _link(sp), "16/16", "paper")
        rows += [pt.row("distflashattn", "time", p_dfa, "ms", "paper:hsap-table2"), pt.row("hsap", "time", p_sap, "ms", "paper:hsap-table2")]
        ratios = np.array(dfa_t) / np.array(sap_t)  # NaN where the planner failed: counts as a miss
        med, worst = float(np.median(ratios)), float(np.min(ratios))
        target = p_dfa / p_sap
        dfa_col.append(float(np.median(dfa_t)))
        table.append([sp, f"{T // 1024}K", float(np.median(dfa_t)), float(np.median(sap_t)), f"{med:.2f}× [{worst:.2f}×]",
                      p_dfa, p_sap, f"{target:.2f}×", "met" if worst >= target else ("met (median)" if med >= target else "missed")])
        rows.append(Point(workload, T, 1, sp, _link(sp), "16/16", "median").row("hsap", "target_speedup_vs_paper", table[-1][-1], "verdict"))
    md = [f"### Table 2 — SAP vs DistFlashAttn (simulated A100, 16 heads × 128, `{workload}` packing, "
          f"{len(_seeds(quick, seeds))} seed(s); ms forward + backward; speed-up median [worst])", "",
          markdown_table(["SP", "T", "DistFlashAttn ms", "SAP ms", "speed-up", "paper DFA ms", "paper SAP ms", "paper speed-up", "target"], table)]
    # The shape of the DistFlashAttn column: growth per point, ours vs the paper's.
    pub = [paper.TABLE2[p][0] for p in points]
    shape_rows = [[f"{points[i][0]}/{points[i][1] // 1024}K → {points[i + 1][0]}/{points[i + 1][1] // 1024}K", pub[i + 1] / pub[i], dfa_col[i + 1] / dfa_col[i]]
                  for i in range(len(points) - 1)]
    md += ["", "Differences from the paper: our SAP balances exact (q, k) pairs, the paper block counts "
           "(docs/design.md §2.1); DistFlashAttn is simulated document-blind (it has no varlen support), so its time "
           "depends on T only, while SAP's depends on the packed documents; the paper's SP-16 DistFlashAttn "
           "times are ~20× its SP-8 ones, which no InfiniBand model reproduces (see `simulate validate`)."]
    md += [f"- {e}" for e in errors]
    md += ["", "DistFlashAttn column shape (ratio of consecutive points):", "",
           markdown_table(["step", "paper", "simulated"], shape_rows)]
    labels = [f"SP{sp} {T // 1024}K" for sp, T in points]
    png = _plot(Path(out_dir) / "table2.png", labels, {"simulated": [r[2] / r[3] for r in table],
                "paper": [paper.TABLE2[p][0] / paper.TABLE2[p][1] for p in points]}, "speed-up over DistFlashAttn", "Table 2: SAP vs DistFlashAttn")
    return Report("table2", rows, "\n".join(md), [png]).write(out_dir)


def table3(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str | None = None) -> Report:
    """Table 3: HSAP (fastest topology) vs Ulysses vs DistFlashAttn, 8/16/64 GPUs, 4K–32K tokens
    per GPU, A100, 16 heads of 128; Ulysses is n/a when P > H.

    Two workloads by default: ``full`` (one document filling the batch — the paper's figures
    match full-causal compute: e.g. 32K × 8 GPUs, Ulysses 664 ms ≈ the FLOPs of one 256K-token
    causal document at FA2 rates) and ``slimpajama`` (packed documents)."""
    hw = sim_hardware("a100")
    shape = full_shape(16, 16)
    points = [(4096, 8), (4096, 16), (8192, 64)] if quick else list(paper.TABLE3)
    workloads = (workload,) if workload else (("slimpajama",) if quick else ("full", "slimpajama"))
    rows: list[Row] = []
    md: list[str] = []
    labels: list[str] = []
    series: dict[str, list[float]] = {}
    for wl in workloads:
        table = []
        n_seeds = 1 if wl == "full" else len(_seeds(quick, seeds))  # "full" has one batch per T
        for per_gpu, P in progress(points, f"table3 {wl}"):
            T = per_gpu * P
            times: dict[str, list[float]] = {"ulysses": [], "distflashattn": [], "hsap": []}
            topo = "-"
            for seed in range(n_seeds):
                cu = pack_batches(wl, T, 1, seed)[0]
                runs: dict[str, MethodRun | None] = {
                    "hsap": best_hsap(cu, hw=hw, P=P, shape=shape),
                    "ulysses": run_method("ulysses", cu, hw=hw, intra=P, inter=1, shape=shape),
                    "distflashattn": run_method("distflashattn", cu, hw=hw, intra=1, inter=P, shape=shape),
                }
                for name, run in runs.items():
                    if run is None:
                        continue
                    intra, inter = (int(x) for x in run.topology.split("x"))
                    rows += method_rows(Point(wl, T, intra, inter, _link(P), "16/16", seed), run)
                    times[name].append(run.seconds * 1e3)
                topo = runs["hsap"].topology if runs["hsap"] else "planner failed"
            pub = paper.TABLE3[(per_gpu, P)]
            pt = Point("unknown", T, 1, P, _link(P), "16/16", "paper")
            for name, v in zip(("ulysses", "distflashattn", "hsap"), pub):
                if v is not None and wl == workloads[0]:
                    rows.append(pt.row(name, "time", v, "ms", "paper:hsap-table3"))
            med = {k: float(np.median(v)) if v else float("nan") for k, v in times.items()}
            uly = "n/a (P > H)" if not times["ulysses"] else med["ulysses"]
            best_base = min(v for k, v in med.items() if k != "hsap" and v == v)
            table.append([f"{per_gpu // 1024}K", P, uly, med["distflashattn"], med["hsap"], topo, f"{best_base / med['hsap']:.2f}×",
                          "OOM" if pub[0] is None else pub[0], pub[1], pub[2]])
            labels.append(f"{wl[:4]} {per_gpu // 1024}K×{P}")
            for name, key in (("Ulysses", "ulysses"), ("DistFlashAttn", "distflashattn"), ("HSAP", "hsap")):
                series.setdefault(name, []).append(med[key])
        md += [f"### Table 3 — HSAP vs Ulysses vs DistFlashAttn (simulated A100, 16 heads × 128, `{wl}`, ms fwd + bwd, median of {n_seeds} seed(s))", "",
               markdown_table(["per GPU", "GPUs", "Ulysses", "DistFlashAttn", "HSAP", "HSAP topology", "HSAP vs best", "paper Ulysses", "paper DFA", "paper HSAP"], table), ""]
    png = _plot(Path(out_dir) / "table3.png", labels, series, "ms (fwd+bwd)", "Table 3 (simulated)", log=True)
    return Report("table3", rows, "\n".join(md), [png]).write(out_dir)


REPRODUCTIONS: dict[str, Callable[..., Report]] = {"table2": table2, "table3": table3}

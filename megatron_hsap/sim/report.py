"""``megatron-hsap report``: the README's benchmark tables, generated from the committed
``results/*.csv`` only, written into marked regions of the README and nowhere else.

A region is ``<!-- report:NAME -->`` ... ``<!-- /report -->``; everything outside the markers is
left byte for byte. ``--check`` exits 1 when a region differs from what the CSVs produce (the
test suite runs the same check). Plots (PNG) of HSAP vs the best document-aware baseline go to
``results/report_<name>.png``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np

from megatron_hsap.plan.ir import Phase
from megatron_hsap.sim.results import flattened_cell, markdown_table, read_csv, size_label

__all__ = ["REGIONS", "render", "update_readme", "main"]

_RE = re.compile(r"(<!-- report:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)


def _f(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return float("nan")


def _calibration(rows: list[dict[str, str]]) -> str:
    sim = {(r["P_inter"], r["method"], r["metric"]): _f(r["value"]) for r in rows if r["source"] == "sim"}
    pub = {(r["P_inter"], r["method"], r["metric"]): _f(r["value"]) for r in rows if r["source"].startswith("paper:")}
    tab, errs = [], defaultdict(list)
    for (g, m, metric), p in sorted(pub.items(), key=lambda kv: (int(kv[0][0]), kv[0][1], kv[0][2])):
        s = sim.get((g, m, metric), float("nan"))
        e = s / p - 1
        errs[g].append(abs(e))
        tab.append([g, m, metric.split("_")[0], f"{p:.0f}", f"{s:.0f}", f"{100 * e:+.0f}%", "yes" if abs(e) <= 0.20 else "NO"])
    summary = "; ".join(f"{g} GPUs ({'fit' if g == '8' else 'check'}): worst {100 * max(v):.0f}%, median {100 * float(np.median(v)):.0f}%"
                        for g, v in sorted(errs.items(), key=lambda kv: int(kv[0])))
    return "\n".join([markdown_table(["GPUs", "method", "phase", "MagiAttention published TFLOP/s", "simulated", "error", "within 20%"], tab),
                      "", f"Calibration errors — {summary}."])


def _magi_means(rows: list[dict[str, str]]) -> dict[str, dict[str, dict[str, float]]]:
    acc: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r["source"] == "sim" and r["metric"] in ("fwd_tflops_per_gpu", "bwd_tflops_per_gpu") and r["seed"].isdigit():
            P = str(int(r["P_intra"]) * int(r["P_inter"]))
            acc[P][r["method"]][r["metric"][:3]].append(_f(r["value"]))
    return {P: {m: {ph: float(np.mean(v)) for ph, v in d.items()} for m, d in ms.items()} for P, ms in acc.items()}


def _magi(rows: list[dict[str, str]]) -> str:
    from megatron_hsap.baselines.registry import REGISTRY
    from megatron_hsap.sim import paper

    means = _magi_means(rows)
    seeds: dict[tuple[str, str], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["source"] == "sim" and r["metric"] in ("fwd_tflops_per_gpu", "bwd_tflops_per_gpu") and r["seed"].isdigit():
            seeds[(str(int(r["P_intra"]) * int(r["P_inter"])), r["metric"][:3])][r["seed"]][r["method"]] = _f(r["value"])
    tab, loses = [], []
    for P in sorted(means, key=int):
        med = means[P]
        for ph in Phase:
            aware = {m: v[ph] for m, v in med.items() if m in REGISTRY and REGISTRY[m].document_aware}
            best = max(aware, key=aware.__getitem__)
            h, hc = med["hsap"][ph], med.get("hsap_contiguous", {}).get(ph, float("nan"))
            magi = paper.MAGI_SELF.get(int(P), (float("nan"),) * 2)[0 if ph == Phase.FWD else 1]
            blind = med.get("distflashattn", {}).get(ph, float("nan"))
            tab.append([P, ph, f"{h:.0f}", f"{hc:.0f}", f"{REGISTRY[best].label}: {aware[best]:.0f}", f"{h / aware[best]:.2f}×",
                        _ratio_spread(seeds[(P, ph)], False), f"{magi:.0f}", f"{blind:.0f}"])
            if h < aware[best]:
                loses.append(f"{P} GPUs {ph} ({h:.0f} vs {REGISTRY[best].label} {aware[best]:.0f})")
            if h < magi:
                loses.append(f"{P} GPUs {ph} vs MagiAttention's published {magi:.0f}")
    out = [markdown_table(["GPUs", "phase", "HSAP (balanced)", "HSAP contiguous", "best document-aware baseline", "HSAP / best",
                           "HSAP / best min–max over seeds", "MagiAttention (published)", "DistFlashAttn (document-blind)"], tab), ""]
    out.append("**Where HSAP loses:** " + ("; ".join(loses) + "." if loses else "nowhere on this protocol."))
    return "\n".join(out)


def _medians(rows: list[dict[str, str]], metric: str, keys: tuple[str, ...]) -> dict[tuple[str, ...], dict[str, float]]:
    """Median over seeds of ``metric`` per (``keys`` columns) and method (simulated rows only)."""
    acc: dict[tuple[str, ...], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["source"] == "sim" and r["metric"] == metric and r["seed"].isdigit():
            acc[tuple(r[k] for k in keys)][r["method"]].append(_f(r["value"]))
    return {k: {m: float(np.median(v)) for m, v in d.items()} for k, d in acc.items()}


def _per_seed(rows: list[dict[str, str]], metric: str, keys: tuple[str, ...]) -> dict[tuple[str, ...], dict[str, dict[str, float]]]:
    """``{key: {seed: {method: value}}}`` of ``metric`` (simulated rows only)."""
    acc: dict[tuple[str, ...], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["source"] == "sim" and r["metric"] == metric and r["seed"].isdigit():
            acc[tuple(r[k] for k in keys)][r["seed"]][r["method"]] = _f(r["value"])
    return acc


def _spread(values: list[float], fmt: str = "{:.2f}", suffix: str = "") -> str:
    """``min–max`` of per-seed values, ``–`` for a single batch."""
    v = [x for x in values if x == x]
    if len(v) < 2:
        return "–"
    return f"{fmt.format(min(v))}–{fmt.format(max(v))}{suffix}"


def _ratio_spread(seeds: dict[str, dict[str, float]], lower_is_better: bool, hsap: str = "hsap") -> str:
    """Spread over seeds of HSAP's speed-up over that seed's best document-aware baseline."""
    out = []
    for d in seeds.values():
        if hsap in d:
            _, b = _best(d, lower_is_better)
            out.append(b / d[hsap] if lower_is_better else d[hsap] / b)
    return _spread(out, suffix="×")


def _best(med: dict[str, float], lower_is_better: bool) -> tuple[str, float]:
    from megatron_hsap.baselines.registry import REGISTRY

    aware = {m: v for m, v in med.items() if m in REGISTRY and REGISTRY[m].document_aware and v == v}
    name = (min if lower_is_better else max)(aware, key=aware.__getitem__)
    return name, aware[name]


def _table2(rows: list[dict[str, str]]) -> str:
    from megatron_hsap.baselines.registry import REGISTRY
    from megatron_hsap.sim import paper

    med = _medians(rows, "time", ("workload", "P_inter", "T"))
    seeds = _per_seed(rows, "time", ("workload", "P_inter", "T"))
    order = sorted(med, key=lambda k: (k[0] == "full", int(k[1]), int(k[2])))
    tab, loses = [], []
    for wl, sp, T in order:
        d = med[(wl, sp, T)]
        name, best = _best(d, lower_is_better=True)
        h = d["hsap"]
        p_dfa, p_sap = paper.TABLE2[(int(sp), int(T))]
        tab.append([wl, sp, f"{int(T) // 1024}K", f"{h:.2f}", _spread([v["hsap"] for v in seeds[(wl, sp, T)].values() if "hsap" in v]),
                    f"{d.get('hsap_contiguous', float('nan')):.2f}",
                    f"{REGISTRY[name].label}: {best:.2f}", f"{best / h:.2f}×", _ratio_spread(seeds[(wl, sp, T)], True),
                    f"{d['distflashattn']:.2f}", f"{d['distflashattn'] / h:.2f}×", f"{p_dfa / p_sap:.2f}×"])
        if h > best:
            loses.append(f"{wl} SP {sp} {int(T) // 1024}K ({best / h:.2f}× of {REGISTRY[name].label})")
    out = [markdown_table(["workload", "SP", "T", "SAP (balanced) ms", "SAP min–max over seeds", "SAP contiguous ms",
                           "best document-aware baseline ms", "SAP speed-up over best", "speed-up min–max over seeds",
                           "DistFlashAttn ms (document-blind)", "SAP over DistFlashAttn", "paper SAP over DistFlashAttn"], tab), ""]
    out.append("**Where SAP loses to the best document-aware baseline:** " + ("; ".join(loses) + "." if loses else "nowhere."))
    return "\n".join(out)


def _table4(rows: list[dict[str, str]]) -> str:
    from megatron_hsap.baselines.registry import REGISTRY

    acc: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["source"] == "sim" and r["seed"].isdigit() and r["metric"] in ("tokens_per_s_per_gpu", "best_baseline_tokens_per_s_per_gpu"):
            key = (r["workload"], r["T"], f"{r['P_intra']}x{r['P_inter']}")
            name = r["method"] if r["metric"] == "tokens_per_s_per_gpu" else "best:" + r["method"]
            acc[key][name].append(_f(r["value"]))
    ratio: dict[tuple[str, str, str], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["source"] == "sim" and r["seed"].isdigit() and r["metric"] in ("tokens_per_s_per_gpu", "best_baseline_tokens_per_s_per_gpu"):
            key = (r["workload"], r["T"], f"{r['P_intra']}x{r['P_inter']}")
            if r["metric"] == "best_baseline_tokens_per_s_per_gpu" or r["method"] == "hsap":
                ratio[key][r["seed"]]["best" if r["metric"].startswith("best") else "hsap"] = _f(r["value"])
    ran_as: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # plan/flatten.py: the topology each seed ran as
    for r in rows:
        if r["source"] == "sim" and r["seed"].isdigit() and r["method"] == "hsap" and r["metric"] == "ran_as":
            ran_as[(r["workload"], r["T"], f"{r['P_intra']}x{r['P_inter']}")].append(r["value"])
    tab, loses = [], []
    for key in sorted(acc, key=lambda k: (k[0] == "full", k[0], int(k[1]), k[2])):
        d = {m: float(np.median(v)) for m, v in acc[key].items()}
        spread = _spread([v["hsap"] / v["best"] for v in ratio[key].values() if "hsap" in v and "best" in v], suffix="×")
        bests = [(m[5:], v) for m, v in d.items() if m.startswith("best:")]
        bname = max(bests, key=lambda kv: len(acc[key]["best:" + kv[0]]))[0]
        bb = float(np.median([v for m, vs in acc[key].items() if m.startswith("best:") for v in vs]))
        h = d["hsap"]
        fl = flattened_cell([t for t in ran_as[key] if t != key[2]], len(ran_as[key])) if ran_as.get(key) else "–"
        tab.append([key[0], f"{int(key[1]) // 1024}K", key[2], f"{h:.0f}", fl, f"{REGISTRY[bname].label}: {bb:.0f}", f"{h / bb:.2f}×",
                    spread, f"{d['packing']:.0f}", f"{d['batching']:.0f}", f"{h / d['packing']:.2f}×"])
        if h < bb:
            loses.append(f"{key[0]} {int(key[1]) // 1024}K {key[2]} ({h / bb:.2f}×)")
    out = [markdown_table(["dataset", "T", "topology", "HSAP", "HSAP flattened", "best document-aware baseline", "HSAP / best",
                           "HSAP / best min–max over seeds", "packing (document-blind)", "batching", "HSAP / packing"], tab), ""]
    out.append("**Where HSAP loses to the best document-aware baseline:** " + ("; ".join(loses) + "." if loses else "nowhere."))
    return "\n".join(out)


def _table3(rows: list[dict[str, str]]) -> str:
    from megatron_hsap.baselines.registry import REGISTRY
    from megatron_hsap.sim import paper
    from megatron_hsap.sim.reproduce import topology_cell

    acc: dict[tuple[str, int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    topo: dict[tuple[str, int, int], str] = {}
    for r in rows:
        if r["source"] == "sim" and r["metric"] == "time" and r["seed"].isdigit():
            P = int(r["P_intra"]) * int(r["P_inter"])
            key = (r["workload"], int(r["T"]) // P, P)
            acc[key][r["method"]].append(_f(r["value"]))
            if r["method"] == "hsap":
                topo[key] = f"{r['P_intra']}x{r['P_inter']}"
    ran_as: dict[tuple[str, int, int], list[str]] = defaultdict(list)  # plan/flatten.py: the topology each seed ran on
    for r in rows:
        if r["source"] == "sim" and r["method"] == "hsap" and r["metric"] == "ran_as" and r["seed"].isdigit():
            P = int(r["P_intra"]) * int(r["P_inter"])
            ran_as[(r["workload"], int(r["T"]) // P, P)].append(r["value"])
    tab, loses = [], []
    by_seed: dict[tuple[str, int, int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["source"] == "sim" and r["metric"] == "time" and r["seed"].isdigit():
            P = int(r["P_intra"]) * int(r["P_inter"])
            by_seed[(r["workload"], int(r["T"]) // P, P)][r["seed"]][r["method"]] = _f(r["value"])
    for key in sorted(acc, key=lambda k: (k[0] != "full", k[0], k[1], k[2])):
        d = {m: float(np.median(v)) for m, v in acc[key].items()}
        name, best = _best(d, lower_is_better=True)
        h = d.get("hsap", float("nan"))
        pub = paper.TABLE3[(key[1], key[2])]
        tab.append([key[0], f"{key[1] // 1024}K", key[2], f"{h:.1f}", topology_cell(topo[key], ran_as[key]) if key in topo else "-", f"{REGISTRY[name].label}: {best:.1f}",
                    f"{best / h:.2f}×", _ratio_spread(by_seed[key], True),
                    f"{d['ulysses']:.1f}" if "ulysses" in d else "n/a (P > H)", f"{d['distflashattn']:.1f}", f"{pub[2]:.1f}"])
        if h > best:
            loses.append(f"{key[0]} {key[1] // 1024}K×{key[2]} ({best / h:.2f}×)")
    out = [markdown_table(["workload", "per GPU", "GPUs", "HSAP ms", "HSAP topology (tuned)", "best document-aware baseline ms",
                           "HSAP speed-up over best", "speed-up min–max over seeds", "Ulysses ms", "DistFlashAttn ms (document-blind)",
                           "paper HSAP ms"], tab), ""]
    out.append("**Where HSAP loses to the best document-aware baseline:** " + ("; ".join(loses) + "." if loses else "nowhere."))
    return "\n".join(out)


def _validate(rows: list[dict[str, str]]) -> str:
    vals: dict[tuple[str, str, str], float] = {}
    for r in rows:
        if r["workload"] == "ring-flash-attention-varlen":
            vals[("sim" if r["source"] == "sim" else "pub", r["method"], r["metric"])] = _f(r["value"])
    tab = []
    for m in ("ring", "zigzag", "llama3"):
        cells = []
        ok = True
        for metric in ("fwd_pct_of_ideal", "fwd_bwd_pct_of_ideal"):
            sim, pub = vals[("sim", m, metric)], vals[("pub", m, metric)]
            ok &= abs(sim / pub - 1) <= 0.15
            cells.append(f"{sim:.1f} / {pub:.1f} ({100 * (sim / pub - 1):+.0f}%)")
        tab.append([m, *cells, "yes" if ok else "NO"])
    return markdown_table(["method", "fwd % sim / published", "fwd+bwd % sim / published", "within 15%"], tab)


def _layout_measures(rows: list[dict[str, str]]) -> str:
    """The layout grid of ``plan-quality`` (``results/plan_layouts.csv``) as one pivot: per
    workload and T, per (P_inter, link), the median over seeds of the shipped plan's estimated time
    over the contiguous plan's, its imbalance and its kernel efficiency (docs/design.md §4)."""
    per: dict[tuple[str, ...], dict[str, dict[tuple[str, str], float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["source"] == "plan_quality" and r["seed"].isdigit():
            per[(r["workload"], r["T"], r["heads"], r["P_inter"], r["link"])][r["seed"]][(r["method"], r["metric"])] = _f(r["value"])
    order = {w: i for i, w in enumerate(("fineweb", "slimpajama", "ultrachat", "sharegpt", "full"))}
    cols = sorted({(k[3], k[4]) for k in per}, key=lambda c: (int(c[0]), c[1] != "nvlink"))
    cells: dict[tuple[str, str, str], dict[tuple[str, str], str]] = defaultdict(dict)
    for (w, T, heads, P, link), seeds in per.items():
        ratio, imb, eff = [], [], []
        for d in seeds.values():
            if ("hsap-kept", "balanced_kept") not in d:
                continue
            src = "hsap-balanced" if d[("hsap-kept", "balanced_kept")] else "hsap"
            ratio.append(d[("hsap-kept", "kept_over_contiguous")])
            imb.append(d[(src, "imbalance")])
            eff.append(d[(src, "kernel_efficiency")])
        if ratio:
            cells[(w, T, heads)][(P, link)] = f"{np.median(ratio):.2f} · {np.median(imb):.2f} · {np.median(eff):.2f}"
    tab = []
    for w, T, heads in sorted(cells, key=lambda k: (order.get(k[0], 99), int(k[1]), k[2])):
        t = int(T)
        tab.append([w, size_label(t), heads, *[cells[(w, T, heads)].get(c, "-") for c in cols]])
    head = ["workload", "T", "heads", *[f"P {P} {'NVLink' if link == 'nvlink' else 'IB'}" for P, link in cols]]
    return markdown_table(head, tab)


def _compile_times(rows: list[dict[str, str]]) -> str:
    """The compiler's timing table (``plan-quality --compile-times-only``: ``results/compile_times.csv``),
    laid out and judged against the budgets by ``bench/plan_quality.compile_markdown``."""
    from megatron_hsap.bench.plan_quality import compile_markdown

    typed = [(r["source"], r["workload"], int(r["T"]), int(r["P_intra"]), int(r["P_inter"]), r["link"], r["heads"],
              r["seed"], r["method"], r["metric"], _f(r["value"]), r["unit"]) for r in rows]
    return "\n".join(compile_markdown(typed))


def _layouts(rows: list[dict[str, str]]) -> str:
    """Kept / contiguous simulated time over InfiniBand (``megatron-hsap simulate layouts``:
    ``results/layouts.csv``), by ``sim/layouts.kept_table``."""
    from megatron_hsap.sim.layouts import kept_table

    return kept_table(rows)


def _scale(rows: list[dict[str, str]]) -> str:
    """The 1,024-GPU scale run (``megatron-hsap simulate scale``: ``results/scale.csv``), laid out and
    judged against issue 14's targets by ``sim/scale.scale_markdown`` (which writes scale.md too)."""
    from megatron_hsap.sim.scale import scale_markdown

    return scale_markdown(rows)


def _plan_worker(rows: list[dict[str, str]]) -> str:
    """What a prefetched compile costs the training thread, on a thread or in the plan worker process
    (``python -m megatron_hsap.bench.plan_worker``: ``results/plan_worker.csv``)."""
    from megatron_hsap.bench.plan_worker import markdown

    return markdown([(r["T"], r["P_inter"], r["mode"], r["metric"], r["value"], r["unit"]) for r in rows])


_SIM = "megatron-hsap simulate "
# region -> (its CSV in results/, how the CSV renders, the command that writes the CSV)
REGIONS: dict[str, tuple[str, Callable[[list[dict[str, str]]], str], str]] = {
    "calibration": ("calibrate.csv", _calibration, _SIM + "calibrate"),
    "magi": ("magi.csv", _magi, _SIM + "magi"),
    "table2": ("table2.csv", _table2, _SIM + "table2"),
    "table3": ("table3.csv", _table3, _SIM + "table3"),
    "validate": ("validate.csv", _validate, _SIM + "validate"),
    "table4": ("table4.csv", _table4, _SIM + "table4"),
    "layout_measures": ("plan_layouts.csv", _layout_measures,
                        "megatron-hsap plan-quality with README's \"Measures\" flags (its plan_quality.csv, saved as plan_layouts.csv)"),
    "compile_times": ("compile_times.csv", _compile_times, "megatron-hsap plan-quality --compile-times-only"),
    "plan_worker": ("plan_worker.csv", _plan_worker, "python -m megatron_hsap.bench.plan_worker"),
    "scale": ("scale.csv", _scale, _SIM + "scale"),
    "layouts": ("layouts.csv", _layouts, _SIM + "layouts"),
}


def render(name: str, results: Path) -> str:
    """Region ``name``'s body from its CSV in ``results`` (``FileNotFoundError`` when it is missing)."""
    csv_name, fn, _ = REGIONS[name]
    return fn(read_csv(results / csv_name))


def missing(text: str, results: Path) -> list[str]:
    """The CSVs of ``text``'s regions that ``results`` lacks (their regions cannot be rendered)."""
    names = {m.group("name") for m in _RE.finditer(text)} & set(REGIONS)
    return sorted({REGIONS[n][0] for n in names if not (results / REGIONS[n][0]).exists()})


def update_readme(text: str, results: Path) -> str:
    """``text`` with every known region's body replaced by what ``results`` produce; a region whose
    CSV is missing keeps its body (``missing`` names them): a results folder without it never wipes
    the committed tables."""
    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in REGIONS or not (results / REGIONS[name][0]).exists():
            return m.group(0)
        return m.group(1) + render(name, results).rstrip("\n") + "\n" + m.group(4)

    return _RE.sub(sub, text)


def _plots(results: Path) -> list[Path]:
    from megatron_hsap.sim.reproduce import _plot

    path = results / "magi.csv"
    if not path.exists():
        return []
    from megatron_hsap.baselines.registry import REGISTRY

    out = []
    t2 = results / "table2.csv"
    if t2.exists():
        med = _medians(read_csv(t2), "time", ("workload", "P_inter", "T"))
        keys = sorted(med, key=lambda k: (k[0] == "full", int(k[1]), int(k[2])))
        series: dict[str, list[float]] = {}
        for k in keys:
            series.setdefault("SAP / best document-aware baseline (speed-up)", []).append(_best(med[k], True)[1] / med[k]["hsap"])
        out.append(_plot(results / "report_table2.png", [f"{k[0][:4]} SP{k[1]} {int(k[2]) // 1024}K" for k in keys], series,
                         "speed-up (>1: SAP faster)", "Table 2: SAP vs the best document-aware baseline, by SP and T"))
    means = _magi_means(read_csv(path))
    Ps = sorted(means, key=int)
    best = [max(v[Phase.FWD] for m, v in means[P].items() if m in REGISTRY and REGISTRY[m].document_aware) for P in Ps]
    out.append(_plot(results / "report_magi.png", [f"{P} GPUs" for P in Ps],
                     {"HSAP": [means[P]["hsap"][Phase.FWD] for P in Ps], "best document-aware baseline": best},
                     "forward TFLOP/s per GPU", "MagiAttention protocol: HSAP vs best baseline (simulated)"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-hsap report", description="Regenerate the README's marked benchmark "
                                "regions from results/*.csv (a second or two; no simulation) and the PNG plots.")
    p.add_argument("--results", default="results", help="directory of the CSVs (default results/)")
    p.add_argument("--readme", default="README.md", help="README to update (default README.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a region is stale")
    args = p.parse_args(argv)
    readme, results = Path(args.readme), Path(args.results)
    if not results.is_dir():
        p.error(f"--results {args.results}: no such folder")
    if not readme.is_file():
        p.error(f"--readme {args.readme}: no such file")
    text = readme.read_text()
    new = update_readme(text, results)
    lacking = missing(text, results)
    made_by = {csv: cmd for csv, _, cmd in REGIONS.values()}
    for name in lacking:
        print(f"megatron-hsap report: no {results / name}: its README region is {'unchecked' if args.check else 'kept as it is'} "
              f"(made by {made_by[name]})", file=sys.stderr)
    if args.check:
        if new != text:
            print(f"megatron-hsap report: {readme} regions differ from {args.results}/*.csv; run `megatron-hsap report`",
                  file=sys.stderr)
            return 1
        return 1 if lacking else 0
    readme.write_text(new)
    files = _plots(results)
    print(f"updated {readme}" + (f"; wrote {', '.join(map(str, files))}" if files else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

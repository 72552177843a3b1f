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

from megatron_hsap.sim.results import markdown_table, read_csv

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
    tab, loses = [], []
    for P in sorted(means, key=int):
        med = means[P]
        for ph in ("fwd", "bwd"):
            aware = {m: v[ph] for m, v in med.items() if m in REGISTRY and REGISTRY[m].document_aware}
            best = max(aware, key=aware.__getitem__)
            h, hc = med["hsap"][ph], med.get("hsap_contiguous", {}).get(ph, float("nan"))
            magi = paper.MAGI_SELF.get(int(P), (float("nan"),) * 2)[0 if ph == "fwd" else 1]
            blind = med.get("distflashattn", {}).get(ph, float("nan"))
            tab.append([P, ph, f"{h:.0f}", f"{hc:.0f}", f"{REGISTRY[best].label}: {aware[best]:.0f}", f"{h / aware[best]:.2f}×",
                        f"{magi:.0f}", f"{blind:.0f}"])
            if h < aware[best]:
                loses.append(f"{P} GPUs {ph} ({h:.0f} vs {REGISTRY[best].label} {aware[best]:.0f})")
            if h < magi:
                loses.append(f"{P} GPUs {ph} vs MagiAttention's published {magi:.0f}")
    out = [markdown_table(["GPUs", "phase", "HSAP (balanced)", "HSAP contiguous", "best document-aware baseline", "HSAP / best",
                           "MagiAttention (published)", "DistFlashAttn (document-blind)"], tab), ""]
    out.append("**Where HSAP loses:** " + ("; ".join(loses) + "." if loses else "nowhere on this protocol."))
    return "\n".join(out)


REGIONS: dict[str, tuple[str, Callable[[list[dict[str, str]]], str]]] = {
    "calibration": ("calibration.csv", _calibration),
    "magi": ("magi.csv", _magi),
}


def render(name: str, results: Path) -> str:
    csv_name, fn = REGIONS[name]
    path = results / csv_name
    if not path.exists():
        return f"_(no {path.name}: run `megatron-hsap simulate {csv_name.removesuffix('.csv')} --out {results}`)_"
    return fn(read_csv(path))


def update_readme(text: str, results: Path) -> str:
    """``text`` with every known region's body replaced by what ``results`` produce."""
    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in REGIONS:
            return m.group(0)
        return m.group(1) + render(name, results).rstrip("\n") + "\n" + m.group(4)

    return _RE.sub(sub, text)


def _plots(results: Path) -> list[Path]:
    from megatron_hsap.sim.reproduce import _plot

    path = results / "magi.csv"
    if not path.exists():
        return []
    from megatron_hsap.baselines.registry import REGISTRY

    means = _magi_means(read_csv(path))
    Ps = sorted(means, key=int)
    best = [max(v["fwd"] for m, v in means[P].items() if m in REGISTRY and REGISTRY[m].document_aware) for P in Ps]
    return [_plot(results / "report_magi.png", [f"{P} GPUs" for P in Ps],
                  {"HSAP": [means[P]["hsap"]["fwd"] for P in Ps], "best document-aware baseline": best},
                  "forward TFLOP/s per GPU", "MagiAttention protocol: HSAP vs best baseline (simulated)")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-hsap report", description="Regenerate the README's marked benchmark "
                                "regions from results/*.csv (a second or two; no simulation) and the PNG plots.")
    p.add_argument("--results", default="results", help="directory of the CSVs (default results/)")
    p.add_argument("--readme", default="README.md", help="README to update (default README.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a region is stale")
    args = p.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    new = update_readme(text, Path(args.results))
    if args.check:
        if new != text:
            print(f"megatron-hsap report: {readme} regions differ from {args.results}/*.csv; run `megatron-hsap report`",
                  file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    files = _plots(Path(args.results))
    print(f"updated {readme}" + (f"; wrote {', '.join(map(str, files))}" if files else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

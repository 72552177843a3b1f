"""Layouts: the paper's contiguous token layout vs the document-aware ``balanced`` one, simulated
over InfiniBand (issue 8).

Target: the shipped plan (``layout="balanced"``, which keeps the contiguous plan where that is
*estimated* faster) simulates in ≤ 0.8× the contiguous plan's attention time (forward + backward)
wherever the contiguous layout's owner imbalance is ≥ 1.3 — medians over the seeded batches,
worst reported (docs/design.md §4).

Grid: A100 and H100 models with one GPU per node (HSAP's inter group always has one GPU per node,
so ``1 × P_inter`` with every rank on its own node IS the inter group over InfiniBand); workloads
fineweb, slimpajama, ultrachat, sharegpt and ``full`` (one document); T 64K, 256K, 1M; P_inter 8,
16, 64; GQA 32/8, d 128, bf16; 2 seeds (``full`` has one batch per T; more cost over an hour here). Per point two plans are
simulated: contiguous and the forced balanced one (``layout_fallback=False``). The shipped plan is
exactly one of them, the one with the lower estimate, so its time is derived, not re-simulated.

CSV (docs/design.md §4 columns, which have none for the GPU model): ``link`` is ``ib-a100`` / ``ib-h100``.
Methods ``hsap-contiguous`` and ``hsap-balanced`` (``method_rows`` plus ``owner_imbalance`` and
``bytes_total``; ratios ``balanced_over_contiguous`` and ``estimate_balanced_over_contiguous`` on
``hsap-balanced``) and ``hsap-kept`` (``kept_over_contiguous``, ``kept_layout``).

Cost: 162 points, ~9 minutes on one (shared) CPU core; ``full`` at P_inter 64 is half of it (its
balanced plan has ~10⁴ work units: ~45 s per point to compile and simulate). ``jobs > 1`` runs
points in worker processes; ``quick`` (A100, fineweb + full, 64K, P_inter 8 and 16) takes seconds.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim.breakdown import TERMS, phase_breakdown
from megatron_hsap.sim.config import SimHardware, sim_hardware, with_links
from megatron_hsap.sim.methods import full_shape, hsap_plan, ideal_seconds, run_method
from megatron_hsap.sim.reproduce import Point, attempt, method_rows, progress
from megatron_hsap.sim.results import Report, Row, markdown_table, size_label

__all__ = ["kept_table", "target_met", "layouts", "compare_layouts", "LayoutRun", "LayoutPair", "plan_options", "ib_hardware"]

K = 1024
WORKLOADS = ("fineweb", "slimpajama", "ultrachat", "sharegpt", "full")
TOKENS = (64 * K, 256 * K, 1024 * K)
INTER = (8, 16, 64)
SHAPE = full_shape(32, 8)
TARGET_IMBALANCE = 1.3  # the target applies where the contiguous owner imbalance is at least this
TARGET_RATIO = 0.8  # kept / contiguous simulated time must be at most this there


def ib_hardware(name: str) -> SimHardware:
    """``name``'s model with one GPU per node: every inter rank on its own node, links InfiniBand."""
    return with_links(sim_hardware(name), gpus_per_node=1)


def plan_options(layout: str) -> dict[str, Any]:
    """``compile_plan`` options of one layout over InfiniBand (``run_method`` passes ``hardware``);
    the layout is always explicit, whatever ``compile_plan``'s default is."""
    base: dict[str, Any] = {"link": "ib", "gpus_per_node": 1}
    if layout == "default":  # what compile_plan ships: the balanced layout with its fallback
        return base
    base["layout"] = layout
    return {**base, "layout_fallback": False} if layout == "balanced" else base


@dataclass(frozen=True, slots=True)
class LayoutRun:
    """One layout's plan on one batch. Seconds are forward + backward; NaN where it failed."""

    layout: str
    seconds: float
    estimate_s: float
    owner_imbalance: float
    imbalance: float
    bytes_total: float
    terms: tuple[tuple[str, float], ...]  # breakdown.TERMS of the critical rank, fwd + bwd, seconds
    rows: tuple[Row, ...]
    error: str = ""


@dataclass(frozen=True, slots=True)
class LayoutPair:
    contiguous: LayoutRun
    balanced: LayoutRun
    shipped: str = ""  # the layout compile_plan's default (balanced with its fallback) keeps on this batch

    @property
    def kept(self) -> LayoutRun | None:
        """The plan ``layout="balanced"`` ships — the planner's own choice (``shipped``), not a
        second copy of its rule; None when either plan failed."""
        c, b = self.contiguous, self.balanced
        if c.error or b.error or not self.shipped:
            return None
        return b if self.shipped == "balanced" else c


def _run_layout(cu: np.ndarray, hw: SimHardware, inter: int, layout: str, pt: Point) -> LayoutRun:
    opts = plan_options(layout)
    run, err = attempt(run_method, "hsap", cu, hw=hw, intra=1, inter=inter, shape=SHAPE, plan_options=opts)
    method = f"hsap-{layout}"
    if run is None:
        nan = float("nan")
        return LayoutRun(layout, nan, nan, nan, nan, nan, (), (pt.row(method, "error", err, "text"),), err)
    stats = run.extra["plan"]
    terms = dict.fromkeys(TERMS, 0.0)
    for ph in Phase:
        for k, v in phase_breakdown(run, ph, ideal_seconds(cu, SHAPE, hw, inter, ph), hw.latency(LinkClass.INFINIBAND)).items():
            terms[k] += v
    rows = method_rows(pt, replace(run, method=method)) + [
        pt.row(method, "owner_imbalance", stats["owner_imbalance"], "ratio"),
        pt.row(method, "bytes_total", stats["bytes_total"], "bytes")]
    return LayoutRun(stats["layout"], run.seconds, stats["estimated_time_s"], stats["owner_imbalance"], stats["imbalance"],
                     float(stats["bytes_total"]), tuple(terms.items()), tuple(rows), "")


def compare_layouts(cu: np.ndarray, *, hw: SimHardware, inter: int, pt: Point | None = None) -> LayoutPair:
    """Simulate the contiguous and the forced balanced plan of ``cu_seqlens`` on ``1 × inter``
    ranks of ``hw`` (give it ``ib_hardware(...)`` for the issue's setting) with GQA 32/8, d 128."""
    cu = np.asarray(cu, dtype=np.int64)
    pt = pt or Point("custom", int(cu[-1]), 1, inter, f"ib-{hw.name}", "32/8", 0)
    c, b = _run_layout(cu, hw, inter, "contiguous", pt), _run_layout(cu, hw, inter, "balanced", pt)
    shipped = "" if c.error or b.error else hsap_plan(cu, hw=hw, intra=1, inter=inter, shape=SHAPE,
                                                      plan_options=plan_options("default")).stats().layout
    return LayoutPair(c, b, shipped)


def _pair_rows(pt: Point, pair: LayoutPair) -> list[Row]:
    c, b, kept = pair.contiguous, pair.balanced, pair.kept
    rows = list(c.rows + b.rows)
    if kept is not None:
        rows += [pt.row("hsap-balanced", "balanced_over_contiguous", b.seconds / c.seconds, "ratio"),
                 pt.row("hsap-balanced", "estimate_balanced_over_contiguous", b.estimate_s / c.estimate_s, "ratio"),
                 pt.row("hsap-kept", "kept_over_contiguous", kept.seconds / c.seconds, "ratio"),
                 pt.row("hsap-kept", "kept_layout", kept.layout, "layout")]
    return rows


def _point(task: tuple[SimHardware, str, int, int, int]) -> tuple[tuple[str, str, int, int], LayoutPair, list[Row]]:
    hw, wl, T, P, seed = task
    cu = pack_batches(wl, T, 1, seed)[0]
    pt = Point(wl, T, 1, P, f"ib-{hw.name}", "32/8", seed)
    pair = compare_layouts(cu, hw=hw, inter=P, pt=pt)
    return (hw.name, wl, T, P), pair, _pair_rows(pt, pair)


def _cell(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median (worst)`` with worst = the largest value (every column here is worse when higher)."""
    v = [x for x in values if x == x]
    if not v:
        return "failed"
    med, worst = fmt.format(float(np.median(v))), fmt.format(max(v))
    return med if len(v) == 1 or med == worst else f"{med} ({worst})"


def _ms(values: list[float]) -> str:
    v = [x * 1e3 for x in values]
    return _cell(v, "{:,.1f}" if min((x for x in v if x == x), default=0) >= 100 else "{:.2f}")


def _x(ratio: float) -> str:
    """A ratio as ``1.23×``; three decimals near 1, so a 0.3 % loss does not print as ``1.00×``."""
    return f"{ratio:.3f}×" if 0.995 < ratio < 1.005 else f"{ratio:.2f}×"


@dataclass(frozen=True, slots=True)
class _Summary:
    """One (hardware, workload, T, P) point over its seeds: a table row and the report's notes."""

    row: list[object]
    target: bool | None  # None: the target does not apply (contiguous owner imbalance < 1.3)
    plan_imbalanced: bool  # the contiguous *plan* is still ≥ 1.3 imbalanced
    loss: str | None
    wrong_pick: str | None
    errors: list[str]


def target_met(owner_imbalances: list[float], kept_ratios: list[float]) -> bool | None:
    """The layouts target at one point, over its seeds: None where it does not apply (median
    contiguous owner imbalance under ``TARGET_IMBALANCE``, or none measured), else whether the
    median kept / contiguous time is at most ``TARGET_RATIO`` (no kept plan: not met)."""
    if not owner_imbalances or float(np.median(owner_imbalances)) < TARGET_IMBALANCE:
        return None
    return bool(kept_ratios) and float(np.median(kept_ratios)) <= TARGET_RATIO


def _summarise(where: str, wl: str, T: int, P: int, ps: list[LayoutPair]) -> _Summary:
    c, b = [p.contiguous for p in ps], [p.balanced for p in ps]
    ok = [p for p in ps if p.kept is not None]
    sim = [p.balanced.seconds / p.contiguous.seconds for p in ok]
    est = [p.balanced.estimate_s / p.contiguous.estimate_s for p in ok]
    kept = [p.kept.seconds / p.contiguous.seconds for p in ok]  # type: ignore[union-attr]
    good_c = [r for r in c if not r.error]
    target = target_met([r.owner_imbalance for r in good_c], kept)
    plan_imbalanced = target is not None and float(np.median([r.imbalance for r in good_c])) >= TARGET_IMBALANCE
    loss = None
    if sim and max(sim) > 1:  # explain the worst seed: bytes, tokens per rank, the breakdown term that grew most
        i = int(np.argmax(sim))
        tc, tb = dict(ok[i].contiguous.terms), dict(ok[i].balanced.terms)
        term = max(TERMS, key=lambda k: tb[k] - tc[k])
        loss = (f"- {where}{'' if np.median(sim) > 1 else ' (worst seed only)'}: balanced {_x(max(sim))} contiguous "
                f"(estimate {_x(est[i])}); {T // P:,} tokens per rank; "
                f"{ok[i].balanced.bytes_total / max(ok[i].contiguous.bytes_total, 1):.1f}× the bytes; largest growth on the "
                f"critical rank: {term.replace('_', ' ')} +{1e3 * (tb[term] - tc[term]):,.1f} ms; kept: {ok[i].kept.layout}")  # type: ignore[union-attr]
    n_bal = sum(p.kept is p.balanced for p in ok)
    row = [wl, size_label(T), P, _cell([r.owner_imbalance for r in c]), _cell([r.imbalance for r in c]), _cell([r.imbalance for r in b]),
           _ms([r.seconds for r in c]), _ms([r.seconds for r in b]), _cell(sim), _cell(est), f"{n_bal}/{len(ok)} balanced",
           _cell(kept), "-" if target is None else ("met" if target else "MISSED")]
    return _Summary(row, target, plan_imbalanced, loss, f"{where} ({_x(max(kept))})" if kept and max(kept) > 1 else None,
                    [f"{where}: {r.layout}: {r.error}" for r in c + b if r.error])


def layouts(out_dir: str | Path, *, quick: bool = False, seeds: int | None = None, workload: str | None = None,
            jobs: int = 1) -> Report:
    """Contiguous vs balanced layout, simulated over InfiniBand (see the module docstring)."""
    hws = ("a100",) if quick else ("a100", "h100")
    wls = (workload,) if workload else (("fineweb", "full") if quick else WORKLOADS)
    tokens, inters = ((64 * K,), (8, 16)) if quick else (TOKENS, INTER)
    n_seeds = 1 if quick else (seeds or 2)  # 5 would take over an hour on one shared core (1M tokens, P_inter 64)
    grid = list(product(hws, wls, tokens, inters))
    tasks = [(ib_hardware(h), wl, T, P, s) for h, wl, T, P in grid for s in range(1 if wl == "full" else n_seeds)]
    tasks.sort(key=lambda t: -(t[2] * t[3] * (50 if t[1] == "full" else 1)))  # slowest first: workers stay busy
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            results = [f.result() for f in progress([ex.submit(_point, t) for t in tasks], "layouts")]
    else:
        results = [_point(t) for t in progress(tasks, "layouts")]
    rows: list[Row] = []
    pairs: dict[tuple[str, str, int, int], list[LayoutPair]] = {}
    for key, pair, prs in results:
        pairs.setdefault(key, []).append(pair)
        rows += prs
    summary = {k: _summarise(f"{k[0].upper()} {k[1]} {size_label(k[2])} P={k[3]}", k[1], k[2], k[3], pairs[k]) for k in grid}
    md: list[str] = []
    for h in hws:
        md += [f"### Layouts — contiguous vs balanced, simulated {h.upper()} over InfiniBand ({ib_hardware(h).ib_bw / 1e9:.0f} GB/s "
               f"per GPU), 1 × P_inter, GQA 32/8, d 128, bf16; fwd + bwd, median (worst) of {n_seeds} seed(s) (`full`: 1)", "",
               markdown_table(["workload", "T", "P_inter", "contig. owner imb.", "contig. plan imb.", "balanced plan imb.",
                               "contig. ms", "balanced ms", "balanced / contig.", "estimate B / C", "kept", "kept / contig.",
                               f"target ≤ {TARGET_RATIO}×"], [s.row for k, s in summary.items() if k[0] == h]), ""]
    applies = [(k, s) for k, s in summary.items() if s.target is not None]
    per_hw = ", ".join(f"{h.upper()} {sum(s.target for k, s in applies if k[0] == h)}/{sum(k[0] == h for k, _ in applies)}" for h in hws)
    still = [s for _, s in applies if s.plan_imbalanced]
    losses = [s.loss for s in summary.values() if s.loss]
    wrong = [s.wrong_pick for s in summary.values() if s.wrong_pick]
    md += [f"**Target** (kept / contiguous ≤ {TARGET_RATIO}× where the contiguous owner imbalance ≥ {TARGET_IMBALANCE}): "
           f"met at {sum(s.target for _, s in applies)}/{len(applies)} points ({per_hw}); at the {len(still)} of them where "
           f"the contiguous *plan* is still ≥ {TARGET_IMBALANCE} imbalanced (the planner could not balance it by moving "
           f"work): {sum(s.target for s in still)}/{len(still)}.", "",
           "Where the balanced layout loses (balanced / contiguous > 1, simulated):" if losses else
           "The balanced layout never loses to the contiguous one in simulation.", *losses]
    if wrong:
        md += ["", "Where the fallback keeps the plan the simulation finds slower (estimate and simulation disagree): "
               + "; ".join(wrong) + "."]
    md += [f"- error: {e}" for s in summary.values() for e in s.errors]
    return Report("layouts", rows, "\n".join(md), []).write(out_dir)


def kept_table(rows: list[dict[str, str]]) -> str:
    """The README's layouts region (``megatron-hsap report``) from the rows of ``results/layouts.csv``
    (strings, as read): kept / contiguous simulated time per model, workload and (T, P_inter),
    median over seeds, and the target ``TARGET_RATIO`` where the contiguous owner imbalance is at
    least ``TARGET_IMBALANCE`` (the same rule as ``layouts.md``), packed and one-document points apart."""
    acc: dict[tuple[str, str, int, int], dict[str, list[float]]] = {}
    for r in rows:
        if r["source"] != "sim" or r["metric"] not in ("kept_over_contiguous", "owner_imbalance"):
            continue
        if r["metric"] == "owner_imbalance" and r["method"] != "hsap-contiguous":
            continue
        key = (r["link"].removeprefix("ib-"), r["workload"], int(r["T"]), int(r["P_inter"]))
        acc.setdefault(key, {}).setdefault(r["metric"], []).append(float(r["value"]))
    models = sorted({k[0] for k in acc})
    wls = [w for w in WORKLOADS if any(k[1] == w for k in acc)]
    sizes = sorted({k[2] for k in acc})
    ps = sorted({k[3] for k in acc})
    tab = []
    met: dict[tuple[str, bool], list[bool]] = {}
    for h in models:
        for w in wls:
            cells = []
            for T in sizes:
                vals = []
                for P in ps:
                    d = acc.get((h, w, T, P), {})
                    kept = d.get("kept_over_contiguous", [])
                    if not kept:
                        vals.append("-")
                        continue
                    vals.append(f"{float(np.median(kept)):.2f}")
                    target = target_met(d.get("owner_imbalance", []), kept)
                    if target is not None:
                        met.setdefault((h, w == "full"), []).append(target)
                cells.append(" / ".join(vals))
            tab.append([h.upper(), w, *cells])
    head = ["model", "workload", *(f"{size_label(T)} P={' / '.join(map(str, ps))}" for T in sizes)]

    def count(one_doc: bool) -> str:
        by = {h: met.get((h, one_doc), []) for h in models}
        n, m = sum(map(sum, by.values())), sum(map(len, by.values()))
        return f"{n} of {m} ({', '.join(f'{h.upper()} {sum(v)}/{len(v)}' for h, v in by.items())})"

    return "\n".join([markdown_table(head, tab), "",
                      f"Target kept / contiguous ≤ {TARGET_RATIO}× where the contiguous owner imbalance is ≥ {TARGET_IMBALANCE} "
                      f"(median over seeds): met at {count(False)} packed points and {count(True)} one-document (`full`) points."])

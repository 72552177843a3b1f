"""Sliding-window plan quality (issue 15 item 6): ``python -m megatron_hsap.bench.window_quality``.

On the docs/design.md §4 measurement set (the four workloads of ``workloads.md`` plus ``full``, one
document filling the batch; bf16, d 128, MHA 32/32 and GQA 32/8, ``P_intra`` 1, seeded batches),
each batch is planned twice with the same options — full causal, and with a sliding window of
``--window`` keys (default 4096, ``window_size=(4096, 0)``) — and the two plans are compared:
bytes moved (forward + backward), estimated time (docs/design.md §4 model, A100 constants) and
total work. Both plans choose their own layout (``layout="balanced"`` with its fallback, the
default); ``--shared-layout`` compiles the windowed plan on the full plan's layout instead
(``shared_layout.compile_on_layout``, what a model mixing full and windowed layers runs).

Writes ``window_quality.csv`` (the docs/design.md §4 columns) and ``window_quality.md`` (median and
worst over the seeds of windowed / full ratios) under ``--out``.

``--peers`` prices the same batches for the peers that accept a window
(``megatron_hsap/baselines/windowed.py``: Transformer Engine's all-gather and a2a CP with SWA,
MagiAttention's sliding-window ``AttnSlice`` masks) beside HSAP's full-causal and windowed plans —
bytes and estimated time with the same constants and kernel model (docs/design.md §4), plus the simulator's
time for HSAP's two plans (``sim.methods.run_method``, A100) — and writes ``windows_peers.csv``;
:func:`peers_markdown` renders its README table (median over the seeds, ratios to HSAP's windowed
plan).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import numpy as np

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.shared_layout import compile_on_layout
from megatron_hsap.plan.hardware import HARDWARE, LinkClass, link_class_for
from megatron_hsap.plan.workloads import pack_batches

__all__ = ["measure", "measure_peers", "peers_markdown", "main", "PEER_METHODS"]

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
                    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=128, link=link, flatten="never")  # SAP's windowed plans
                    full = compile_plan(cu, P, **kw)
                    win = compile_on_layout(full, (window, 0)) if shared_layout else compile_plan(cu, P, window_size=(window, 0), **kw)
                    for method, plan in (("hsap-full", full), (f"hsap-window{window}", win)):
                        s = plan.stats()
                        base = ("window_quality", workload, T, 1, P, link, f"{hq}/{hkv}", seed, method)
                        rows += [base + ("bytes", float(s.bytes_total), "B"),
                                 base + ("estimated_time", float(s.estimated_time_s), "s"),
                                 base + ("total_work", float(s.total_work), "pairs"),
                                 base + ("imbalance", float(s.imbalance), "ratio")]
    return rows


def markdown(rows: list[tuple], window: int) -> str:
    """Median (worst) over the seeds of windowed / full, per workload, point and head shape."""
    table: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        key = (r[1], r[2], r[4], r[6])
        table.setdefault(key, {}).setdefault(f"{r[8]}:{r[9]}", {})[r[7]] = r[10]
    out = ["| workload | T | P_inter | heads | bytes window/full | est. time window/full | work window/full |",
           "|---|---|---|---|---|---|---|"]
    for (wl, T, P, heads), d in table.items():
        cells = []
        for metric in ("bytes", "estimated_time", "total_work"):
            full, win = d[f"hsap-full:{metric}"], d[f"hsap-window{window}:{metric}"]
            ratios = [win[s] / full[s] if full[s] else 1.0 for s in full]
            cells.append(f"{statistics.median(ratios):.3f} ({max(ratios):.3f})")
        out.append(f"| {wl} | {T // 1024}K | {P} | {heads} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# (CSV method name, price) of every figure in windows_peers.csv; "full" = the peer without a window
PEER_METHODS = ("hsap-full", "hsap-window", "te_allgather_swa", "te_a2a_swa", "magi_swa",
                "te_allgather_full", "te_a2a_full", "magi_full")


def _batches(workload: str, T: int, seeds: int) -> list[np.ndarray]:
    return pack_batches(workload, T, seeds, 0) if workload != "full" else [np.array([0, T])]


def measure_peers(window: int, seeds: int, points=POINTS, workloads=WORKLOADS, simulate: bool = True) -> list[tuple]:
    """CSV rows per batch: ``bytes_per_rank`` (forward + backward, the busiest rank's max of sent and
    received — what bounds its transfer time) and ``estimated_time`` of HSAP's full and windowed
    plans and of each peer with and without the window; ``simulated_time`` for HSAP's plans."""
    from megatron_hsap.baselines.windowed import price_windowed
    from megatron_hsap.plan.costs import HeadShape

    hw = HARDWARE["a100"]
    sim = None
    if simulate:
        from megatron_hsap.sim.config import sim_hardware
        from megatron_hsap.sim.methods import full_shape, run_method

        sim = (sim_hardware("a100"), full_shape, run_method)
    peers = {"te_allgather": "te_allgather_swa", "te_a2a": "te_a2a_swa", "magi": "magi_swa"}
    rows = []
    for workload in workloads:
        for T, P in points:
            link = link_class_for(P).value
            for name, (hq, hkv) in HEADS.items():
                shape = HeadShape(num_heads=hq, num_kv_heads=hkv, head_dim=128, head_dim_v=128, dtype_bytes=2)
                for seed, cu in enumerate(_batches(workload, T, seeds)):
                    base = ("windows_peers", workload, T, 1, P, link, f"{hq}/{hkv}", seed)

                    def emit(method: str, nbytes: float, seconds: float) -> None:
                        rows.extend([base + (method, "bytes_per_rank", float(nbytes), "B"),
                                     base + (method, "estimated_time", float(seconds), "s")])  # fmt: skip

                    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=128, link=link, flatten="never")
                    for method, opts in (("hsap-full", {}), ("hsap-window", {"window_size": (window, 0)})):
                        st = compile_plan(cu, P, **kw, **opts).stats()
                        sent, recv = np.asarray(st.bytes_sent_per_rank), np.asarray(st.bytes_recv_per_rank)
                        emit(method, float(np.max(np.maximum(sent, recv))), st.estimated_time_s)
                        if sim is not None:
                            shw, fshape, run_method = sim
                            r = run_method("hsap", cu, hw=shw, intra=1, inter=P, shape=fshape(hq, hkv),
                                           plan_options={"link": link, **opts})  # fmt: skip
                            rows.append(base + (method, "simulated_time", float(r.seconds), "s"))
                    for peer, method in peers.items():
                        for label, win in ((method, (window, 0)), (f"{peer}_full", None)):
                            cost = price_windowed(method, cu, world=P, window_size=win, shape=shape, hardware=hw,
                                                  link=LinkClass(link))  # fmt: skip
                            if cost is not None:  # te_a2a needs P <= heads
                                emit(label, float(np.max(np.maximum(cost.bytes_sent, cost.bytes_recv))), cost.time)
    return rows


def _median_by(rows: list[tuple], metric: str) -> dict[tuple, dict[str, float]]:
    """{(workload, T, P, heads): {method: median over seeds of ``metric``}}."""
    acc: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if r[9] == metric:
            acc.setdefault((r[1], int(r[2]), int(r[4]), r[6]), {}).setdefault(r[8], []).append(float(r[10]))
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in acc.items()}


def peers_markdown(rows: list[tuple] | str | Path) -> str:
    """The README table of ``windows_peers.csv`` (rows, or the CSV's path): per workload, point and
    head shape, HSAP's windowed plan (estimated and simulated ms, MB per rank) and every other
    method's estimated time and bytes as multiples of it (median over the seeds)."""
    if not isinstance(rows, list):
        with open(rows, newline="") as f:
            reader = csv.reader(f)
            next(reader)
            rows = [tuple(r) for r in reader]
    t, b, s = _median_by(rows, "estimated_time"), _median_by(rows, "bytes_per_rank"), _median_by(rows, "simulated_time")
    others = ("hsap-full", "te_allgather_swa", "te_a2a_swa", "magi_swa")
    head = ["workload", "T, P", "heads", "HSAP window: est. / sim. ms", "MB/rank"] + [f"{m} time, bytes ×" for m in others]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ratio(d: dict[str, float], m: str, ref: float) -> str:
        """``d[m]`` as a multiple of ``ref``; "—" when the method did not run (e.g. P > heads)."""
        if m not in d:
            return "—"
        if ref > 0:
            return f"{d[m] / ref:.2f}"
        return "0" if d[m] == 0 else "∞"  # HSAP moved nothing

    for key in t:
        wl, T, P, heads = key
        hw_t, hw_b = t[key]["hsap-window"], b[key]["hsap-window"]
        sim_ms = f"{s[key]['hsap-window'] * 1e3:.2f}" if key in s and "hsap-window" in s[key] else "—"
        cells = [wl, f"{T // 1024}K, {P}", heads, f"{hw_t * 1e3:.2f} / {sim_ms}", f"{hw_b / 1e6:.1f}"]
        cells += [f"{ratio(t[key], m, hw_t)}, {ratio(b[key], m, hw_b)}" for m in others]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=4096, help="keys each token attends back (window_size=(W, 0))")
    ap.add_argument("--seeds", type=int, default=5, help="seeded batches per point")
    ap.add_argument("--shared-layout", action="store_true", help="windowed plan on the full plan's layout")
    ap.add_argument("--peers", action="store_true",
                    help="also price TE's all-gather / a2a CP with SWA and MagiAttention's sliding-window masks "
                    "on the same batches, with HSAP's simulated time: writes windows_peers.csv")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false", help="with --peers: skip the simulator")
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    if args.peers:
        rows = measure_peers(args.window, args.seeds, simulate=args.simulate)
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "windows_peers.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            w.writerows(rows)
        print(peers_markdown(rows))
        return 0
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

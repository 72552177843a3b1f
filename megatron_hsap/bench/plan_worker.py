"""What a prefetched plan compile costs the training thread: on a thread vs in the plan worker process.

``python -m megatron_hsap.bench.plan_worker [--out results]`` writes ``plan_worker.csv`` / ``.md``
(the README's ``plan_worker`` region: ``megatron-hsap report``). For each point of the compile
budgets (fineweb 64K over P_inter 8, 1M over 64; GQA 32/8, d 128, the default balanced layout) it
compiles ``--batches`` fresh batches in the background, as the prefetcher does — on a thread
(``--no-hsap-plan-process``) or through ``PlanWorker`` (the default) — while the training thread
stands in as a loop of small torch ops (each releases the GIL in its dispatch and takes it back,
as every op of a training step does), and reports that loop's op rate while the compiles run,
against its rate alone. The time the training thread loses per compile is the compile window
times the rate lost. A wall-clock benchmark: run it on a quiet machine; tests assert counts, not
these times (``tests/megatron/test_plan_worker.py``).
"""

from __future__ import annotations

import argparse
import csv
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

from megatron_hsap.argtypes import HelpFormatter, output_dir, positive_int

__all__ = ["measure", "markdown", "main"]

POINTS = ((64 * 1024, 8), (1 << 20, 64))
COLUMNS = ("T", "P_inter", "mode", "metric", "value", "unit")
_KW = dict(intra_size=1, num_heads=32, num_kv_heads=8, head_dim=128, hardware="a100")
_ALONE_S = 0.3  # how long the op loop runs alone to measure its rate


def _op_loop(stop: threading.Event | None, seconds: float | None = None) -> tuple[int, float]:
    """Small torch ops on this thread until ``stop`` is set (or for ``seconds``): (ops, wall s)."""
    import torch

    x = torch.randn(32, 32)
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(20):
            x = torch.mm(x, x).clamp_(-1, 1)
        n += 20
        t = time.perf_counter() - t0
        if (stop is not None and stop.is_set()) or (seconds is not None and t >= seconds):
            return n, t


def _beside(compile_all) -> tuple[float, float, int]:
    """Run ``compile_all`` on a background thread while the op loop runs here: (the compiles' wall
    seconds, the loop's seconds, its ops)."""
    done = threading.Event()
    took: list[float] = []

    def background() -> None:
        t0 = time.perf_counter()
        try:
            compile_all()
        finally:
            took.append(time.perf_counter() - t0)
            done.set()

    th = threading.Thread(target=background)
    th.start()
    ops, loop_s = _op_loop(done)
    th.join()
    return took[0], loop_s, ops


def measure(batches: int = 4, seed: int = 2024, reps: int = 5) -> list[tuple]:
    """Rows ``(T, P_inter, mode, metric, value, unit)`` for ``mode`` in ``thread``, ``process``: the
    median of ``reps`` rounds, each mode's op rate judged against the loop's rate alone measured
    right before it (this VM's speed drifts between seconds)."""
    import torch

    from megatron_hsap.bench.plan_quality import pack_batches
    from megatron_hsap.megatron.plan_worker import PlanRequest, PlanWorker, _loads, compile_request
    from megatron_hsap.plan.cache import clear_plan_cache

    torch.set_num_threads(1)
    _op_loop(None, _ALONE_S)  # torch's first ops, outside the timing
    rows: list[tuple] = []
    for T, P in POINTS:
        cus = pack_batches("fineweb", T, batches * reps + 1, seed)
        reqs = [PlanRequest(cu, dict(_KW, inter_size=P)) for cu in cus]
        compile_request(reqs[-1])  # imports and first-compile costs, outside the timing
        got: dict[str, dict[str, list[float]]] = {"thread": {}, "process": {}}
        plans: list = []
        with PlanWorker() as process:
            process.compile(reqs[-1])  # the worker process starts and warms up
            for rep in range(reps):  # fresh batches each round (the worker's plan cache keeps what it compiled)
                fresh = reqs[rep * batches:(rep + 1) * batches]
                for mode, worker in (("thread", PlanWorker(enabled=False)), ("process", process)):
                    ops, s = _op_loop(None, _ALONE_S)
                    rate = ops / s
                    clear_plan_cache()
                    plans.clear()
                    window, loop_s, done_ops = _beside(lambda: plans.extend(worker.compile(r)[0] for r in fresh))
                    lost = max(0.0, loop_s - done_ops / rate)  # the loop's seconds not spent at its rate alone
                    for metric, value in (("compile_window_per_batch", window / batches),
                                          ("op_rate_share", done_ops / loop_s / rate),
                                          ("training_thread_lost_per_batch", lost / batches)):
                        got[mode].setdefault(metric, []).append(value)
        for mode, metrics in got.items():
            rows += [(T, P, mode, metric, statistics.median(v), "1" if metric == "op_rate_share" else "s")
                     for metric, v in metrics.items()]
        loads = []
        for p in plans:
            data = pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
            t0 = time.perf_counter()
            _loads(data)  # as PlanWorker unpickles a reply
            loads.append(time.perf_counter() - t0)
        rows.append((T, P, "process", "unpickle_median", statistics.median(loads), "s"))
    return rows


def markdown(rows: list[tuple]) -> str:
    """The table of ``measure``'s rows (read back from the CSV as strings too)."""
    from megatron_hsap.sim.results import size_label

    by: dict[tuple[int, int, str], dict[str, float]] = {}
    for T, P, mode, metric, value, _ in rows:
        by.setdefault((int(T), int(P), mode), {})[metric] = float(value)
    lines = ["| point (fineweb, GQA 32/8, d 128, balanced) | compiled on | compile wall time per batch (ms) | "
             "training thread's op rate meanwhile (share of alone) | training thread's time lost per batch (ms) | "
             "plan unpickled by the training process (ms) |", "|---|---|---|---|---|---|"]
    for (T, P, mode), m in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2] != "thread")):
        label = f"{size_label(T)} / P {P}"
        where = "the prefetch thread (--no-hsap-plan-process)" if mode == "thread" else "the plan worker process (default)"
        unpickle = f"{m['unpickle_median'] * 1e3:.1f}" if "unpickle_median" in m else "—"
        lines.append(f"| {label} | {where} | {m['compile_window_per_batch'] * 1e3:.1f} | {m['op_rate_share']:.0%} | "
                     f"{m['training_thread_lost_per_batch'] * 1e3:.1f} | {unpickle} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_hsap.bench.plan_worker", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--batches", type=positive_int, default=4, help="fresh batches compiled per point and mode")
    ap.add_argument("--out", type=output_dir, default=Path("results"), metavar="DIR",
                    help="output folder (plan_worker.csv, plan_worker.md)")
    args = ap.parse_args(argv)
    rows = measure(args.batches)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "plan_worker.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    table = markdown(rows)
    (args.out / "plan_worker.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

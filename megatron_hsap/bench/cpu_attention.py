"""CPU attention benchmark: ``megatron-hsap bench [--quick] [--out DIR]``.

One process tree per world size (4 and 8 gloo ranks on 127.0.0.1, one thread each) runs forward +
backward attention of packed fineweb and sharegpt batches (``pack_batches``; H 8, d 64, fp32) with

* ``sap`` (HSAP 1×P), ``te_thd_ring`` (TE-style THD ring: documents padded to 2·P, zigzag, P−1
  full-KV steps), ``allgather_kv`` (Llama-3 style), ``ulysses`` (HSAP P×1, all-to-all only);
* on 8 ranks the paper's Table-4 sweep — 1×8 (= sap), 2×4, 4×2 (``hsap``), 8×1 (= ulysses) — next
  to TE-style ``te_a2a_p2p`` (Ulysses inside the group + document-blind ring across groups).

All methods use the same kernels (the ``cpu`` backend) and the same LSE merge. Per method and
batch: wall time (median over ``--repeats`` timed steps after ``--warmup``; a step's wall time is
the slowest rank's, ranks start together after a barrier), bytes sent per rank and link class
(``inter``: P2P/ring group, ``intra``: all-to-all group) counted where the tensors are handed to
torch.distributed — and asserted equal to the independent prediction (the plan, ``ulysses_bytes``,
the planner's baseline pricing) —, peak memory per rank, and the compute / communication split
(host seconds in kernels+merges vs posting+blocked waiting, measured by the executors).

Peak memory = the highest running total of torch CPU allocations during one extra step, from the
profiler's allocator events (``profile_memory=True``: inputs allocated before the step are not
counted, everything the method allocates is), plus buffers the method keeps between steps (HSAP's
receive pool, at its full capacity). Results: a markdown table on stdout and CSV rows
(``<--out>/cpu_attention.csv``, default ``results/cpu_attention.csv``, or ``--csv FILE``;
docs/design.md §4 columns, one row per metric). On 2 shared cores compute
dominates wall time; bytes and memory are the meaningful comparisons, and the ratios are printed.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_hsap.argtypes import (HelpFormatter, given_options, link_line, nonnegative_int, output_dir, positive_float,
                                   positive_int, writable_file)
from megatron_hsap.plan.workloads import WORKLOADS
from megatron_hsap.runtime.rendezvous import init_local_process_group, new_local_store

CSV_COLUMNS = ("source", "workload", "T", "P_intra", "P_inter", "link", "heads", "seed", "method", "metric", "value", "unit")


CSV_NAME = "cpu_attention.csv"  # the file written inside --out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-hsap bench", formatter_class=HelpFormatter,
        description=__doc__.split("\n\n")[0] + " Duration on 2 shared cores: --quick about a minute; the default "
        "grid tens of minutes. Every rank is one gloo process on 127.0.0.1; the planner prices plans with "
        "docs/design.md §4's link rule (printed), the wire is gloo over loopback.")
    ap.add_argument("--worlds", type=positive_int, nargs="+", default=[4, 8],
                    help="gloo world sizes = CP sizes P_intra × P_inter (each runs 1×P, P×1 and, in --sweep-worlds, "
                    "every P_intra × P_inter in between)")
    ap.add_argument("--workloads", nargs="+", default=["fineweb", "sharegpt"], choices=WORKLOADS, help="length distributions")
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[16384, 65536], help="tokens per packed batch T")
    ap.add_argument("--heads", type=positive_int, default=8, help="q heads")
    ap.add_argument("--kv-heads", type=positive_int, default=None, help="kv heads (default: --heads, MHA)")
    ap.add_argument("--head-dim", type=positive_int, default=64, help="head dimension")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed steps per method (median reported)")
    ap.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed steps before them")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="batch seed of pack_batches")
    ap.add_argument("--sweep-worlds", type=positive_int, nargs="*", default=[8], help="worlds that run the Table-4 sweep")
    ap.add_argument("--no-memory", action="store_true", help="skip the profiled step (peak memory)")
    ap.add_argument("--pool-chunks", type=positive_float, default=None,
                    help="HSAP receive pool in inter chunks × heads × (d + dv) × bytes (default: the planner's, 4)")
    ap.add_argument("--out", type=output_dir, default=Path("results"), metavar="DIR",
                    help=f"output folder; the CSV is written inside it as {CSV_NAME}")
    ap.add_argument("--csv", type=writable_file, default=None, metavar="FILE",
                    help="write the CSV to this file instead (default: DIR/" + CSV_NAME + ")")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: world 4, fineweb 2K, 1 repeat, no warm-up (an option given keeps its value)")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.out.suffix == ".csv" and not args.out.is_dir() and args.csv is None:
        ap.error(f"--out {args.out} looks like a CSV file: --out takes a folder (the CSV is written inside as "
                 f"{CSV_NAME}); use --csv FILE for a single file")
    given = given_options(_parser(), argv)
    if args.csv is not None and "out" in given:
        ap.error("--out DIR and --csv FILE both say where the CSV goes: give one")
    if args.quick:  # the smoke grid, where the command line says nothing else
        quick = {"worlds": [4], "workloads": ["fineweb"], "tokens": [2048], "repeats": 1, "warmup": 0, "sweep_worlds": [4]}
        for dest, value in quick.items():
            if dest not in given:
                setattr(args, dest, value)
    args.kv_heads = args.kv_heads or args.heads
    return args


def csv_path(args: argparse.Namespace) -> Path:
    """Where the CSV goes: ``--csv FILE``, else ``--out DIR`` / cpu_attention.csv."""
    return Path(args.csv) if args.csv is not None else Path(args.out) / CSV_NAME


# --------------------------------------------------------------------------- rank side


def _topologies(world: int, sweep: bool, heads: int) -> list[tuple[int, int]]:
    """(intra, inter) for HSAP: 1×P always, P×1 when the heads allow, the middle ones in a sweep."""
    topo = [(1, world)]
    if sweep:
        topo += [(p, world // p) for p in range(2, world) if world % p == 0 and heads % p == 0]
    if heads % world == 0:
        topo.append((world, 1))
    return topo


def _make_groups(world: int, topologies: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[Any, Any]]:
    """Every rank creates every group, in the same order (new_group is collective)."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    for intra, inter in topologies:
        mine_intra = mine_inter = None
        if intra > 1:
            for i in range(inter):
                g = dist.new_group(list(range(i * intra, (i + 1) * intra)), backend="gloo")
                mine_intra = g if rank // intra == i else mine_intra
        if inter > 1:
            for j in range(intra):
                g = dist.new_group(list(range(j, world, intra)), backend="gloo")
                mine_inter = g if rank % intra == j else mine_inter
        out[(intra, inter)] = (mine_intra, mine_inter)
    return out


def _methods(cu: Any, world: int, args: argparse.Namespace, groups: dict, sweep: bool) -> list[Any]:
    import torch.distributed as dist

    from megatron_hsap.bench.attention_methods import A2AP2PMethod, AllGatherMethod, HSAPMethod, RingMethod
    from megatron_hsap.plan import compile_plan

    rank = dist.get_rank()
    heads = (args.heads, args.kv_heads, args.head_dim, 4)
    out = []
    for intra, inter in _topologies(world, sweep, args.heads):
        # each row measures its topology (plan/flatten.py would run a batch as 1 x P: the "sap" row)
        kw = dict(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=4, flatten="never")
        plan = compile_plan(cu, inter, intra, **kw)
        if args.pool_chunks is not None:  # the default pool is 4 inter chunks × heads × (d + dv) × bytes
            plan = compile_plan(cu, inter, intra, pool_bytes=int(plan.pool_capacity * args.pool_chunks / 4), **kw)
        out.append(HSAPMethod(plan, *groups[(intra, inter)], rank))
    out.append(RingMethod(cu, None, world, rank, heads))
    out.append(AllGatherMethod(cu, None, world, rank, heads))
    if sweep:
        for intra, inter in _topologies(world, True, args.heads):
            if 1 < intra < world:
                out.append(A2AP2PMethod(cu, *groups[(intra, inter)], (intra, inter), rank, heads))
    return out


def _peak_alloc(fn: Any) -> int | None:
    """Highest running total of torch CPU allocations while ``fn`` runs (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's CUDA probe: "gpuGetDeviceCount failed" per rank on CPU
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception:  # noqa: BLE001 - a profiler problem must not lose the timings
        return None
    total = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        total += e.nbytes()
        peak = max(peak, total)
    return peak


def _measure(method: Any, args: argparse.Namespace, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(seed)
    t, h, hkv, d = method.local_tokens, args.heads, args.kv_heads, args.head_dim
    q, do = torch.randn(t, h, d, generator=gen), torch.randn(t, h, d, generator=gen)
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    scale = d**-0.5
    for _ in range(args.warmup):
        method.step(q, k, v, do, scale)
    times, counters = [], []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        method.step(q, k, v, do, scale)
        times.append(time.perf_counter() - t0)
        counters.append(method.counters())
    peak = None
    if not args.no_memory:
        dist.barrier()
        peak = _peak_alloc(lambda: method.step(q, k, v, do, scale))
        peak = None if peak is None else peak + method.persistent_bytes
    return {"times": times, "counters": counters, "predicted": method.predicted(), "peak": peak,
            "predicted_peak": method.predicted_peak()}  # fmt: skip


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from megatron_hsap.plan.workloads import pack_batches

    torch.set_num_threads(1)
    init_local_process_group(rank, world, store)  # file store + loopback gloo: nothing listens outside
    sweep = world in args.sweep_worlds
    groups = _make_groups(world, _topologies(world, sweep, args.heads))
    rows: list[dict] = []
    for workload in args.workloads:
        for T in args.tokens:
            cu = pack_batches(workload, T, 1, args.seed)[0]
            for m in _methods(cu, world, args, groups, sweep):
                mine = _measure(m, args, seed=1000 * rank + T)
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, mine)
                _check_bytes(m.name, m.topology, everyone)  # same verdict on every rank
                if rank == 0:
                    rows.append(dict(workload=workload, T=T, method=m.name, topology=m.topology, ranks=everyone))
                    with open(out_path, "wb") as f:  # after every method: a crash keeps what was measured
                        pickle.dump(rows, f)
                del m
                gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _check_bytes(name: str, topology: tuple[int, int], everyone: list[dict]) -> None:
    for r, m in enumerate(everyone):
        inter, intra = m["predicted"]
        for c in m["counters"]:
            got = (c.inter_bytes, c.intra_bytes)
            if (inter is not None and got[0] != inter) or (intra is not None and got[1] != intra):
                raise AssertionError(
                    f"{name} {topology[0]}x{topology[1]} rank {r}: sent (inter, intra) = {got} bytes, "
                    f"predicted {(inter, intra)}"
                )


# --------------------------------------------------------------------------- parent side


def _run_world(world: int, args: argparse.Namespace) -> tuple[list[dict], Exception | None]:
    import torch.multiprocessing as mp

    store = new_local_store(prefix=f"hsap-bench-w{world}-")
    fd, path = tempfile.mkstemp(prefix=f"hsap-bench-w{world}-", suffix=".pkl")
    os.close(fd)
    # Large tensors come and go every step: a fixed mmap threshold hands them back to the OS at
    # once (glibc's adaptive threshold would keep them in the heap; 8 ranks then exhaust the RAM).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    error = None
    try:
        mp.start_processes(_rank_main, args=(world, store, args, path), nprocs=world, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - keep what the ranks measured before the failure
        error = exc
    try:
        with open(path, "rb") as f:
            rows = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        rows = []
    finally:
        os.remove(path)
    if error is not None:
        print(f"world {world} failed after {len(rows)} measurements: {error!r}", file=sys.stderr)
        if not rows:
            raise error
    for row in rows:
        row["world"] = world
    return rows, error


def _summarise(row: dict) -> dict[str, float | None]:
    ranks = row["ranks"]
    reps = len(ranks[0]["times"])
    wall = [max(r["times"][i] for r in ranks) for i in range(reps)]
    comp = [max(r["counters"][i].compute_s for r in ranks) for i in range(reps)]
    comm = [max(r["counters"][i].comm_s for r in ranks) for i in range(reps)]
    last = [r["counters"][-1] for r in ranks]
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    return {
        "wall_s": statistics.median(wall),
        "wall_s_min": min(wall),
        "compute_s": statistics.median(comp),
        "comm_s": statistics.median(comm),
        "bytes_inter_per_rank_max": max(c.inter_bytes for c in last),
        "bytes_intra_per_rank_max": max(c.intra_bytes for c in last),
        "bytes_inter_total": sum(c.inter_bytes for c in last),
        "bytes_intra_total": sum(c.intra_bytes for c in last),
        "peak_mem_bytes_max": max(peaks) if peaks else None,
        "plan_peak_bytes": ranks[0]["predicted_peak"],  # HSAP: plan.peak_bytes()["total"]
    }


_UNITS = {"wall_s": "s", "wall_s_min": "s", "compute_s": "s", "comm_s": "s", "peak_mem_bytes_max": "bytes"}


def _csv_rows(rows: list[dict], args: argparse.Namespace) -> list[list[Any]]:
    out = []
    for row in rows:
        intra, inter = row["topology"]
        for metric, value in row["summary"].items():
            if value is None:
                continue
            out.append(["cpu_attention", row["workload"], row["T"], intra, inter, "gloo-cpu",
                        f"{args.heads}/{args.kv_heads}", args.seed, row["method"], metric, value,
                        _UNITS.get(metric, "bytes")])  # fmt: skip
    return out


def _mb(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**20:,.1f}"


def _table(rows: list[dict]) -> str:
    lines = []
    keys = sorted({(r["world"], r["workload"], r["T"]) for r in rows})
    for world, workload, T in keys:
        sel = [r for r in rows if (r["world"], r["workload"], r["T"]) == (world, workload, T)]
        ring = next((r["summary"] for r in sel if r["method"] == "te_thd_ring"), None)
        lines += [f"\n### {workload} T={T}, {world} ranks (gloo, 1 thread each)\n",
                  "| method | intra×inter | wall s (median) | vs ring | compute s | comm s | inter MiB/rank | "
                  "intra MiB/rank | bytes vs ring | peak MiB/rank (plan) | peak vs ring |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sel:
            s = r["summary"]
            sent = s["bytes_inter_total"] + s["bytes_intra_total"]
            ring_sent = ring and ring["bytes_inter_total"]
            lines.append(
                f"| {r['method']} | {r['topology'][0]}x{r['topology'][1]} | {s['wall_s']:.2f} | "
                f"{s['wall_s'] / ring['wall_s']:.2f} | {s['compute_s']:.2f} | {s['comm_s']:.2f} | "
                f"{_mb(s['bytes_inter_per_rank_max'])} | {_mb(s['bytes_intra_per_rank_max'])} | "
                f"{sent / ring_sent:.4f} | {_mb(s['peak_mem_bytes_max'])}"
                + (f" ({_mb(s['plan_peak_bytes'])})" if s["plan_peak_bytes"] else "") + " | "
                + (f"{s['peak_mem_bytes_max'] / ring['peak_mem_bytes_max']:.2f} |" if s["peak_mem_bytes_max"] and ring["peak_mem_bytes_max"] else "– |")
            )  # fmt: skip
    return "\n".join(lines)


def _targets(rows: list[dict]) -> str:
    """The issue's targets on the largest fineweb batch at 8 ranks (or what was run)."""
    fine = [r for r in rows if r["workload"] == "fineweb"]
    if not fine:
        return ""
    world = max(r["world"] for r in fine)
    T = max(r["T"] for r in fine if r["world"] == world)
    sel = {(r["method"], r["topology"]): r["summary"] for r in fine if (r["world"], r["T"]) == (world, T)}
    sap, ring = sel.get(("sap", (1, world))), sel.get(("te_thd_ring", (1, world)))
    out = [f"\nTargets (fineweb T={T}, {world} ranks):"]
    if sap and ring:
        b = sap["bytes_inter_total"] / ring["bytes_inter_total"]
        w = sap["wall_s"] / ring["wall_s"]
        out.append(f"- SAP bytes / ring bytes = {b:.4f} (target <= 0.15: {'met' if b <= 0.15 else 'MISSED'})")
        out.append(f"- SAP wall / ring wall = {w:.2f} (target <= 1: {'met' if w <= 1 else 'MISSED'})")
        if sap["peak_mem_bytes_max"] and ring["peak_mem_bytes_max"]:
            p = sap["peak_mem_bytes_max"] / ring["peak_mem_bytes_max"]
            out.append(f"- SAP peak / ring peak = {p:.2f} per rank (target <= 1: {'met' if p <= 1 else 'MISSED'})")
    for topo in sorted(t for (m, t) in sel if m == "hsap"):
        hs, a2 = sel[("hsap", topo)], sel.get(("te_a2a_p2p", topo))
        if a2:
            f = a2["bytes_inter_total"] / max(hs["bytes_inter_total"], 1)
            out.append(f"- HSAP {topo[0]}x{topo[1]}: a2a+p2p inter bytes / HSAP inter bytes = {f:.1f}x "
                       f"(target >= 5: {'met' if f >= 5 else 'MISSED'}); intra bytes = Ulysses all-to-all "
                       "volume over the same group (asserted per rank)")  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows, failed = [], []
    for world in args.worlds:
        # every topology of one world has the same CP group size, hence the same priced link
        print(f"[bench] {world} ranks: plans priced with {link_line(intra=1, inter=world)}; "
              "the measured wire is gloo on 127.0.0.1", flush=True)
        got, error = _run_world(world, args)
        rows += got
        if error is not None:
            failed.append(world)
    for row in rows:
        row["summary"] = _summarise(row)
    print(_table(rows))
    print(_targets(rows))
    out = csv_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(_csv_rows(rows, args))
    if not rows:
        print(f"\nno measurement completed (worlds {args.worlds}); nothing was asserted", file=sys.stderr)
        return 1
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s; bytes asserted equal to the predictions)")
    if failed:
        print(f"INCOMPLETE: worlds {failed} stopped early (see stderr)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

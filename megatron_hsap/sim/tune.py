"""One topology per run: choose ``P_intra × P_inter`` once, from a sample of the workload's batches.

A Megatron job fixes ``--hierarchical-context-parallel-sizes`` for the whole run, so every
hierarchical method (HSAP, TE a2a+p2p, USP, the document-blind packing ring) gets the topology
with the lowest *mean* simulated forward + backward time over ``samples`` batches drawn from the
workload — never a per-batch oracle. ``megatron-hsap tune`` prints the recommended flag.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_hsap.argtypes import HelpFormatter, link_line, positive_int
from megatron_hsap.errors import HSAPError, PoolSizeError
from megatron_hsap.baselines.registry import REGISTRY
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.options import LAYOUTS
from megatron_hsap.plan.workloads import WORKLOADS
from megatron_hsap.sim.config import HARDWARE_NAMES

__all__ = ["Tuned", "tune_topology", "sample_batches", "main"]


@dataclass(frozen=True, slots=True)
class Tuned:
    """The chosen topology and the mean seconds of every topology tried (NaN: failed)."""

    method: str
    intra: int
    inter: int
    mean_s: dict[str, float]

    @property
    def topology(self) -> str:
        return f"{self.intra}x{self.inter}"

    @property
    def flag(self) -> str:
        return f"--hierarchical-context-parallel-sizes {self.intra} {self.inter}"


def sample_batches(workload: str, T: int, n: int, seed: int = 1000) -> list[np.ndarray]:
    """``n`` batches for tuning, seeded apart from the evaluation seeds (0, 1, ...)."""
    if workload == "magiattention":
        from megatron_hsap.sim.protocols import magi_batches

        return magi_batches(T, n, seed)
    from megatron_hsap.plan.workloads import pack_batches

    return pack_batches(workload, T, n, seed)


def tune_topology(method: str, batches: list[np.ndarray], *, hw: Any, P: int, shape: HeadShape,
                  plan_options: dict[str, Any] | None = None, intras: tuple[int, ...] = (1, 2, 4, 8)) -> Tuned:
    """The fastest valid topology of ``method`` on average over ``batches``. Ties (HSAP plans every
    batch inside one node on the fastest of its topology, ``1 × P`` and ``P × 1``: plan/flatten.py,
    so several topologies can run the very same plans) go to the topology the batches ran on."""
    from megatron_hsap.sim.methods import run_method, unavailable

    means: dict[str, float] = {}
    native: dict[str, int] = {}  # batches whose plan ran on the topology it was configured with
    why: list[str] = []  # topologies left out, and why
    for intra in intras:
        topo = f"{intra}x{P // intra}"
        if P % intra or intra > hw.gpus_per_node:
            continue
        rule = unavailable(method, intra=intra, inter=P // intra, shape=shape)
        if rule:
            why.append(f"{topo}: {rule}")
            continue
        secs = []
        native[topo] = 0
        for b, cu in enumerate(batches):
            try:
                run = run_method(method, cu, hw=hw, intra=intra, inter=P // intra, shape=shape,
                                 **({"plan_options": plan_options} if method == "hsap" else {}))
            except PoolSizeError as exc:
                # the one failure that belongs to a topology: its plan of this batch does not fit the
                # pool. Anything else (bad options, a planner defect) is the same at every topology:
                # it propagates instead of quietly striking topologies off
                why.append(f"{topo}: batch {b}: {exc}")
                run = None
            secs.append(run.seconds if run is not None else float("nan"))
            native[topo] += int(run is not None and getattr(run, "extra", {}).get("ran_as", topo) == topo)
        means[topo] = float(np.mean(secs))
    ok = {k: v for k, v in means.items() if v == v}
    if not ok:
        raise HSAPError(f"{method}: no valid topology for P={P} with {shape.num_heads}/{shape.num_kv_heads} heads"
                        + (f" ({'; '.join(why)})" if why else ""))
    best = min(ok, key=lambda k: (ok[k], -native[k]))
    intra, inter = (int(x) for x in best.split("x"))
    return Tuned(method, intra, inter, means)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megatron-hsap tune", formatter_class=HelpFormatter,
        description="Choose one intra×inter topology for a whole run from a sample of the workload's batches "
        "(simulated; seconds at 8 GPUs, about a minute at 64) and print the Megatron flag and the link the "
        "planner prices it with.")
    p.add_argument("--workload", default="magiattention", choices=("magiattention", *WORKLOADS),
                   help="length distribution (magiattention: MagiAttention's histogram and chunking)")
    p.add_argument("--gpus", type=positive_int, default=64, help="CP size P = P_intra × P_inter to split")
    p.add_argument("--tokens-per-gpu", type=positive_int, default=8192, help="T / P")
    p.add_argument("--heads", default="64/8", help="q/kv heads per TP rank")
    p.add_argument("--hardware", default="h100-fa3", choices=HARDWARE_NAMES, help="simulator hardware")
    p.add_argument("--method", default="hsap", choices=("hsap", *REGISTRY),
                   help="hsap or a baseline (the hierarchical ones: te_a2a_p2p, usp, loongtrain, blind_ring)")
    p.add_argument("--layout", default=None, choices=LAYOUTS, help="HSAP layout (default: the shipped balanced one)")
    p.add_argument("--samples", type=positive_int, default=4, help="batches sampled")
    args = p.parse_args(argv)
    try:
        from megatron_hsap.sim.config import sim_hardware
        from megatron_hsap.sim.methods import full_shape

        try:
            h, hkv = (int(x) for x in args.heads.split("/"))
        except ValueError:
            raise HSAPError(f"--heads must look like 64/8, got {args.heads!r}") from None
        hw = sim_hardware(args.hardware)
        batches = sample_batches(args.workload, args.tokens_per_gpu * args.gpus, args.samples)
        opts = {"layout": args.layout} if args.layout else None
        t = tune_topology(args.method, batches, hw=hw, P=args.gpus, shape=full_shape(h, hkv), plan_options=opts)
    except HSAPError as exc:
        print(f"megatron-hsap tune: {exc}", file=sys.stderr)
        return 2
    for topo, s in t.mean_s.items():
        print(f"{topo:>6}: {s * 1e3:9.3f} ms fwd+bwd (mean of {args.samples})" + ("  <- chosen" if topo == t.topology else ""))
    print(link_line(intra=t.intra, inter=t.inter, gpus_per_node=hw.gpus_per_node))
    print(t.flag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner's estimate against the simulator, and the chosen plan against owner-computes.

Issue 14 items 2–3: on every benchmark batch (HSAP paper Table 2 and Table 4, MagiAttention's
protocol) print the planner's closed-form estimate of the HSAP layer (``plan/chunks.py``
``head_chunk_estimates`` at the plan's head-chunk count: SAP plus the intra all-to-all), the
simulated time of the same plan (``sim/methods.run_method("hsap", ...)``, event by event) and
the simulated time of owner-computes on the same batch (``plan_options={"placement":
"owner-computes"}``). Two independent computations: ``ratio = estimate / simulated`` should be
≈ 1, and ``vs_owner = simulated / owner-computes simulated`` ≤ 1 (never slower than leaving the
work home).

Batches mimic the reproductions exactly: Table 2 (``sim/reproduce.table2``: A100, 16/16 heads,
P_intra 1, SP 2–16, ``slimpajama`` seeds and one ``full`` document), Table 4
(``sim/table4.table4``: A100, Llama-2 7B heads, 8 GPUs at the four topologies) and MagiAttention
(``sim/magi.magi``: H100 FA3, 64/8 heads, 8K tokens per GPU; at fixed topologies here instead of
the tuned one, so every topology the tuner may pick is covered).

``python -m megatron_hsap.sim.estimate_accuracy [--set table2|table4|magi|all] [--seeds N] [--gpus 8]
[--grad-wire-dtype fp32]`` (the last: every plan with its gradients on the wire in fp32 instead of
the activation dtype; compare with a default run batch by batch).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megatron_hsap.plan.costs import DEFAULT_GRAD_WIRE_DTYPE, GRAD_WIRE_DTYPES

__all__ = ["Case", "cases", "measure", "Measured", "layouts", "main"]


@dataclass(frozen=True, slots=True)
class Case:
    """One benchmark batch: which table, its label, the hardware model, heads and topology."""

    table: str
    label: str
    hardware: str
    heads: tuple[int, int]
    intra: int
    inter: int
    cu: tuple[int, ...]
    options: tuple[tuple[str, object], ...] = ()  # the reproduction's own compile_plan options


def _table2(seeds: int, max_gpus: int) -> Iterator[Case]:
    from megatron_hsap.plan.workloads import pack_batches
    from megatron_hsap.sim import paper

    for wl in ("slimpajama", "full"):
        for sp, T in paper.TABLE2:
            if sp > max_gpus:
                continue
            for seed in range(1 if wl == "full" else seeds):
                cu = pack_batches(wl, T, 1, seed)[0]
                yield Case("table2", f"{wl} SP{sp} {T // 1024}K s{seed}", "a100", (16, 16), 1, sp, tuple(int(x) for x in cu),
                           (("flatten", "never"),))  # SAP alone, as sim/reproduce.table2


def _table4(seeds: int, max_gpus: int) -> Iterator[Case]:
    from megatron_hsap.plan.workloads import pack_batches
    from megatron_hsap.sim import constants, paper

    cfg = constants.LLAMA2_7B
    for ds in (*paper.TABLE4, "full"):
        for T in paper.TABLE4_LENGTHS:
            for topo in paper.TABLE4_TOPOLOGIES:
                intra, inter = (int(x) for x in topo.split("x"))
                for seed in range(1 if ds == "full" else seeds):
                    cu = pack_batches(ds, T, 1, seed)[0]
                    yield Case("table4", f"{ds} {T // 1024}K {topo} s{seed}", "a100", (cfg["heads"], cfg["kv_heads"]), intra, inter,
                               tuple(int(x) for x in cu))


def _magi(seeds: int, max_gpus: int) -> Iterator[Case]:
    from megatron_hsap.sim.magi import paper_sizes
    from megatron_hsap.sim.protocols import MAGI_TOKENS_PER_GPU, magi_batches

    for P in paper_sizes():
        if P > max_gpus:
            continue
        topos = ((1, 8), (2, 4), (4, 2), (8, 1)) if P == 8 else ((8, P // 8),)
        for seed, cu in enumerate(magi_batches(MAGI_TOKENS_PER_GPU * P, seeds, 0)):
            for intra, inter in topos:
                yield Case("magi", f"magi {P} {intra}x{inter} s{seed}", "h100-fa3", (64, 8), intra, inter, tuple(int(x) for x in cu))


SETS = {"table2": _table2, "table4": _table4, "magi": _magi}


def cases(which: str = "all", seeds: int = 3, max_gpus: int = 64) -> list[Case]:
    """The benchmark batches of ``which`` (``table2``, ``table4``, ``magi`` or ``all``)."""
    names = list(SETS) if which == "all" else [which]
    return [c for n in names for c in SETS[n](seeds, max_gpus)]


@dataclass(frozen=True, slots=True)
class Measured:
    case: Case
    estimate_s: float  # the planner's closed-form estimate of the chosen plan (SAP + intra all-to-all)
    simulated_s: float  # the chosen plan, simulated
    owner_s: float  # owner-computes on the same batch, simulated
    placement: str
    layout: str

    @property
    def ratio(self) -> float:
        return self.estimate_s / self.simulated_s

    @property
    def vs_owner(self) -> float:
        return self.simulated_s / self.owner_s


def measure(case: Case, plan_options: dict | None = None) -> Measured:
    """Estimate, simulate and compare one batch (see the module docstring); ``plan_options``: extra
    ``compile_plan`` options for all three (e.g. ``{"grad_wire_dtype": "activation"}``)."""
    from megatron_hsap.plan.chunks import head_chunk_estimates
    from megatron_hsap.plan.plan import compile_plan
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    hw = sim_hardware(case.hardware)
    shape = full_shape(*case.heads)
    cu = np.asarray(case.cu, dtype=np.int64)
    extra = {**dict(case.options), **(plan_options or {})}
    run = run_method("hsap", cu, hw=hw, intra=case.intra, inter=case.inter, shape=shape, plan_options=extra or None)
    own = run_method("hsap", cu, hw=hw, intra=case.intra, inter=case.inter, shape=shape,
                     plan_options={**extra, "placement": "owner-computes"})
    assert run is not None and own is not None
    plan = compile_plan(cu, case.inter, case.intra, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                        head_dim=shape.head_dim, dtype_bytes=shape.dtype_bytes, hardware=case.hardware, **extra)
    est = head_chunk_estimates(plan)[plan.head_chunks]
    return Measured(case, est, run.seconds, own.seconds, plan.chosen.name, plan.layout.name)


def layouts(case: Case) -> tuple[str, float, float]:
    """(layout the default plan keeps, simulated seconds of the contiguous plan, of the balanced
    plan without the fallback): the kept layout should be the faster one in simulation too."""
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    hw = sim_hardware(case.hardware)
    shape = full_shape(*case.heads)
    cu = np.asarray(case.cu, dtype=np.int64)
    kw = dict(hw=hw, intra=case.intra, inter=case.inter, shape=shape)
    own = dict(case.options)
    kept = run_method("hsap", cu, plan_options=own or None, **kw)
    con = run_method("hsap", cu, plan_options={**own, "layout": "contiguous"}, **kw)
    bal = run_method("hsap", cu, plan_options={**own, "layout": "balanced", "layout_fallback": False}, **kw)
    assert kept is not None and con is not None and bal is not None
    return str(kept.extra["plan"]["layout"]), con.seconds, bal.seconds


def _quantiles(x: list[float]) -> str:
    a = np.asarray(x)
    return f"min {a.min():.3f} p10 {np.quantile(a, 0.1):.3f} median {np.median(a):.3f} p90 {np.quantile(a, 0.9):.3f} max {a.max():.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_hsap.sim.estimate_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="all", choices=["all", *SETS], help="which benchmark batches")
    p.add_argument("--seeds", type=int, default=3, help="seeded batches per packed point (one for 'full')")
    p.add_argument("--gpus", type=int, default=64, help="skip points with more GPUs than this")
    p.add_argument("--layouts", action="store_true", help="also simulate both layouts: is the kept one the faster?")
    p.add_argument("--grad-wire-dtype", choices=GRAD_WIRE_DTYPES, default=DEFAULT_GRAD_WIRE_DTYPE,
                   help="the plans' gradient wire dtype (compile_plan's grad_wire_dtype)")
    args = p.parse_args(argv)
    opts = {} if args.grad_wire_dtype == DEFAULT_GRAD_WIRE_DTYPE else {"grad_wire_dtype": args.grad_wire_dtype}
    if args.layouts:
        wrong = 0
        for c in cases(args.set, args.seeds, args.gpus):
            kept, con, bal = layouts(c)
            other = bal if kept == "contiguous" else con
            mine = con if kept == "contiguous" else bal
            wrong += mine > other * (1 + 1e-9)
            print(f"{c.label:34} kept {kept:10} contiguous {con * 1e3:9.3f} ms balanced {bal * 1e3:9.3f} ms"
                  f"{'  KEPT THE SLOWER' if mine > other * (1 + 1e-9) else ''}", flush=True)
        print(f"kept the slower layout on {wrong}")
        return 0
    rows = []
    print(f"{'batch':34} {'placement':28} {'layout':10} {'est ms':>9} {'sim ms':>9} {'owner ms':>9} {'est/sim':>7} {'sim/own':>7}")
    for c in cases(args.set, args.seeds, args.gpus):
        m = measure(c, opts)
        rows.append(m)
        flag = "  SLOWER" if m.vs_owner > 1 + 1e-9 else ""
        print(f"{c.label:34} {m.placement[:28]:28} {m.layout:10} {m.estimate_s * 1e3:9.3f} {m.simulated_s * 1e3:9.3f} "
              f"{m.owner_s * 1e3:9.3f} {m.ratio:7.3f} {m.vs_owner:7.3f}{flag}", flush=True)
    for table in dict.fromkeys(m.case.table for m in rows):
        sel = [m for m in rows if m.case.table == table]
        print(f"{table}: {len(sel)} batches; est/sim {_quantiles([m.ratio for m in sel])}")
        print(f"{table}: sim/owner {_quantiles([m.vs_owner for m in sel])}; slower than owner-computes on "
              f"{sum(m.vs_owner > 1 + 1e-9 for m in sel)}")
    print(f"all: est/sim {_quantiles([m.ratio for m in rows])}; within 10%: {sum(abs(m.ratio - 1) <= 0.1 for m in rows)}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

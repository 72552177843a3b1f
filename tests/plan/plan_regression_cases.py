"""Fixed batches and an IR hash for the plan-regression test (issue 17 item 6, issue 14 item 5).

The hash covers what a plan *does*, never how it was asked for or how long it took: the layout
(name, chunk, every segment), the pool capacity, the chosen placement's name, every placed and
staged unit, and every instruction of both phases of every inter rank (rounds with their ordered
sends/receives, compute items with their slots, merges, accumulations) — integers and strings
only, in program order. ``PlanOptions`` / ``Plan`` fields (e.g. a new option) do not enter it,
so the regression is about plans, not options; ``Plan.hash`` (``plan/fingerprint.py``) is the
wire identity and is deliberately not used here.

Each case also records a digest of its ``cu_seqlens``, so a failure says whether the *batch*
changed (``plan/workloads.py``'s sampling) or the *plan* did.

Regenerate the fixture ONLY when a change of plans is intended (say so in the commit)::

    .venv/bin/python -m tests.plan.plan_regression_cases --write

(``--check`` compares without writing; both print one line per case).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Post, Recv, Send, Slot, Wait
from megatron_hsap.plan.workloads import pack_batches

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "plan_hashes.json"
K = 1024
M = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Case:
    """One fixed batch (``pack_batches(workload, T, seed + 1, 0)[seed]``, or ``[0, T]`` for
    ``full``) compiled with ``compile_plan(cu, inter, intra, **compile_options)``."""

    name: str
    workload: str
    T: int
    seed: int
    inter: int
    intra: int = 1
    options: dict = field(default_factory=dict)
    slow: bool = False

    @property
    def compile_options(self) -> dict:
        """``options`` on the configured topology (``flatten="never"``): the fixtures pin the
        planner's plans for the topology they name; flattening's choice among topologies
        (``plan/flatten.py``) has its own tests (tests/plan/test_flatten.py)."""
        return {"flatten": "never", **self.options}

    def cu_seqlens(self) -> np.ndarray:
        if self.workload == "full":
            return np.array([0, self.T], dtype=np.int64)
        return pack_batches(self.workload, self.T, self.seed + 1, 0)[self.seed]


GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128)
MHA = dict(num_heads=32, num_kv_heads=32, head_dim=128)
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16)

CASES: tuple[Case, ...] = (
    # default layout (balanced with the contiguous fallback), GQA 32/8, NVLink sizes
    Case("fineweb-16K-P2-gqa", "fineweb", 16 * K, 0, 2, options=GQA),
    Case("fineweb-64K-P4-gqa", "fineweb", 64 * K, 1, 4, options=GQA),
    Case("fineweb-64K-P8-gqa", "fineweb", 64 * K, 0, 8, options=GQA),
    Case("fineweb-64K-P8-gqa-s3", "fineweb", 64 * K, 3, 8, options=GQA),
    Case("fineweb-64K-P8-mha", "fineweb", 64 * K, 2, 8, options=MHA),
    Case("slimpajama-64K-P8-gqa", "slimpajama", 64 * K, 0, 8, options=GQA),
    Case("ultrachat-64K-P8-gqa", "ultrachat", 64 * K, 0, 8, options=GQA),
    Case("sharegpt-64K-P4-mha", "sharegpt", 64 * K, 1, 4, options=MHA),
    Case("fineweb-edu-32K-P4-gqa", "fineweb-edu", 32 * K, 0, 4, options=GQA),
    Case("full-64K-P8-gqa", "full", 64 * K, 0, 8, options=GQA),
    Case("full-16K-P2-mha", "full", 16 * K, 0, 2, options=MHA),
    # InfiniBand sizes (P_inter > 8) and forced links / other hardware
    Case("fineweb-64K-P16-gqa", "fineweb", 64 * K, 0, 16, options=GQA),
    Case("slimpajama-64K-P16-mha", "slimpajama", 64 * K, 1, 16, options=MHA),
    Case("fineweb-128K-P32-gqa", "fineweb", 128 * K, 0, 32, options=GQA),
    Case("fineweb-64K-P8-ib", "fineweb", 64 * K, 0, 8, options={**GQA, "link": "ib"}),
    Case("sharegpt-64K-P8-h100", "sharegpt", 64 * K, 2, 8, options={**GQA, "hardware": "h100"}),
    # the paper's contiguous layout, and the balanced layout without the fallback
    Case("fineweb-64K-P8-contig", "fineweb", 64 * K, 0, 8, options={**GQA, "layout": "contiguous"}),
    Case("slimpajama-64K-P16-contig", "slimpajama", 64 * K, 0, 16, options={**MHA, "layout": "contiguous"}),
    Case("full-32K-P4-contig", "full", 32 * K, 0, 4, options={**GQA, "layout": "contiguous"}),
    Case("fineweb-64K-P8-bal-only", "fineweb", 64 * K, 0, 8, options={**GQA, "layout_fallback": False}),
    Case("sharegpt-64K-P16-bal-only", "sharegpt", 64 * K, 0, 16, options={**GQA, "layout_fallback": False}),
    # sliding windows
    Case("fineweb-64K-P8-win4K", "fineweb", 64 * K, 0, 8, options={**GQA, "window_size": (4096, 0)}),
    Case("full-32K-P4-win1K", "full", 32 * K, 0, 4, options={**GQA, "window_size": (1024, 0)}),
    Case("slimpajama-64K-P8-win4K-contig", "slimpajama", 64 * K, 1, 8,
         options={**GQA, "window_size": (4096, 0), "layout": "contiguous"}),
    # intra groups: GQA 32/8 over P_intra 2 (4 kv heads per rank); 32/2 over P_intra 4 (kv replicated)
    # the configured topologies with their all-to-all (plan/flatten.py would run these as 1 x 8)
    Case("fineweb-64K-2x4-gqa", "fineweb", 64 * K, 0, 4, intra=2, options=GQA),
    Case("fineweb-64K-4x2-kvrep", "fineweb", 64 * K, 0, 2, intra=4, options={**GQA, "num_kv_heads": 2}),
    # fixed placements, small heads, a small pool (pool-overflow re-staging), padding
    Case("fineweb-64K-P8-owner", "fineweb", 64 * K, 0, 8, options={**GQA, "placement": "owner-computes"}),
    Case("fineweb-64K-P8-mintraffic", "fineweb", 64 * K, 0, 8, options={**GQA, "placement": "min-traffic"}),
    Case("sharegpt-16K-P4-small", "sharegpt", 16 * K, 0, 4, options=SMALL),
    Case("fineweb-64K-P8-smallpool", "fineweb", 64 * K, 0, 8,
         options={**SMALL, "pool_bytes": 64 * K, "layout": "contiguous"}),
    Case("fineweb-odd-P8-pad", "fineweb", 64 * K - 5, 0, 8, options={**GQA, "pad_multiple": 2}),
    Case("full-64K-P16-gqa", "full", 64 * K, 0, 16, options=GQA),
    # large points: the compile-time budgets' sizes (slow-marked)
    Case("fineweb-1M-P64-gqa", "fineweb", M, 0, 64, options=GQA, slow=True),
    Case("fineweb-1M-P64-gqa-s1", "fineweb", M, 1, 64, options=GQA, slow=True),
    Case("slimpajama-256K-P64-mha", "slimpajama", 256 * K, 0, 64, options=MHA, slow=True),
    Case("fineweb-1M-P8-gqa", "fineweb", M, 0, 8, options=GQA, slow=True),
    Case("sharegpt-1M-P16-contig", "sharegpt", M, 0, 16, options={**GQA, "layout": "contiguous"}, slow=True),
    Case("full-8K-P64-contig", "full", 8 * K, 0, 64, options={**GQA, "layout": "contiguous"}, slow=True),
    Case("fineweb-1M-P64-win4K", "fineweb", M, 2, 64, options={**GQA, "window_size": (4096, 0)}, slow=True),
)


def _slot(s: Slot | None) -> str:
    return "-" if s is None else f"{s.offset}+{s.nbytes}"


def _wires(pairs) -> str:  # noqa: ANN001 - ((Wire, Slot | None), ...)
    return ",".join(f"{w.value}={_slot(s)}" for w, s in pairs)


def _instr(ins) -> str:  # noqa: ANN001 - one IR instruction
    if isinstance(ins, Post):
        ops = []
        for op in ins.round.ops:
            if isinstance(op, Send):
                ops.append(f"S{op.wire.value}{op.tokens.start}:{op.tokens.stop}>{op.peer}#{op.nbytes}<{_slot(op.src)}")
            elif isinstance(op, Recv):
                ops.append(f"R{op.wire.value}{op.tokens.start}:{op.tokens.stop}<{op.peer}#{op.nbytes}>{_slot(op.dst)}")
            else:  # pragma: no cover - a new op kind must be added here
                raise TypeError(f"unknown round op {op!r}")
        return f"P{ins.round.index}[" + ";".join(ops) + "]"
    if isinstance(ins, Wait):
        return f"W{ins.index}"
    if isinstance(ins, Compute):
        items = ";".join(
            f"{it.q.start}:{it.q.stop}x{it.kv.start}:{it.kv.stop}{'c' if it.causal else 'f'}w{it.window}"
            f"({_wires(it.srcs)})({_wires(it.dsts)})"
            for it in ins.items
        )
        return f"C{ins.stage}[{items}]"
    if isinstance(ins, Merge):
        return f"M{ins.tokens.start}:{ins.tokens.stop}o{_slot(ins.o)}l{_slot(ins.lse)}"
    if isinstance(ins, Accumulate):
        return f"A{ins.wire.value}{ins.tokens.start}:{ins.tokens.stop}<{_slot(ins.src)}"
    raise TypeError(f"unknown instruction {ins!r}")  # pragma: no cover - a new kind must be added here


def ir_hash(plan) -> str:  # noqa: ANN001 - a compiled Plan
    """Hex blake2b digest of the plan's IR (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    lay = plan.layout
    h.update(f"layout={lay.name}:{lay.chunk_tokens};pool={plan.pool_capacity};chosen={plan.chosen.name}\n".encode())
    for rank, segs in enumerate(lay.segments):
        h.update(f"{rank}:".encode() + ",".join(f"{s.tokens.start}-{s.tokens.stop}@{s.local_start}" for s in segs).encode())
    h.update(b"\nunits\n")
    h.update(";".join(
        f"{u.doc},{u.q.start}:{u.q.stop},{u.kv.start}:{u.kv.stop},{int(u.causal)},{u.q_owner},{u.kv_owner},{u.rank},{u.stage},{u.window}"
        for u in plan.units()
    ).encode())
    for progs in (plan.fwd_programs, plan.bwd_programs):
        for prog in progs:
            h.update(f"\n{prog.rank}/{prog.phase.value}\n".encode())
            h.update("\n".join(map(_instr, prog.instrs)).encode())
    return h.hexdigest()


def cu_digest(cu: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(cu, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def compute(case: Case) -> dict[str, str]:
    cu = case.cu_seqlens()
    clear_plan_cache()
    plan = compile_plan(cu, case.inter, case.intra, **case.compile_options)
    return {"cu_seqlens": cu_digest(cu), "ir": ir_hash(plan)}


def load_fixture() -> dict[str, dict[str, str]]:
    return json.loads(FIXTURE.read_text())["cases"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate or check tests/fixtures/plan_hashes.json")
    ap.add_argument("--write", action="store_true", help="write the fixture (only when a change of plans is intended)")
    ap.add_argument("--check", action="store_true", help="compare with the fixture")
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    args = ap.parse_args(argv)
    old = load_fixture() if FIXTURE.exists() else {}
    got: dict[str, dict[str, str]] = {}
    bad = 0
    for case in CASES:
        if args.k not in case.name:
            continue
        got[case.name] = compute(case)
        status = "" if not old else ("ok" if old.get(case.name) == got[case.name] else "DIFFERS")
        bad += status == "DIFFERS"
        print(f"{case.name:36s} {got[case.name]['cu_seqlens']} {got[case.name]['ir']} {status}", flush=True)
    if args.write:
        merged = {**old, **got} if args.k else got
        FIXTURE.write_text(json.dumps({
            "about": "IR hashes of tests/plan/plan_regression_cases.py CASES; regenerate with "
                     "`.venv/bin/python -m tests.plan.plan_regression_cases --write` only when plans change on purpose",
            "cases": {c.name: merged[c.name] for c in CASES if c.name in merged},
        }, indent=1) + "\n")
        print(f"wrote {FIXTURE}")
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())

"""HSAP as the simulator runs it: the compiled plan's own programs, plus the intra all-to-all.

One inter group is simulated (inter rank ``i`` = CP rank ``i·P_intra``): the ``P_intra`` inter
groups run the same plan on different heads over disjoint GPUs and ports, so they finish
together, and every member of an intra group (same ``i``) therefore enters each all-to-all at
the same moment — the all-to-all is priced in closed form (``Cluster.all_to_all_time``).

Translation of one rank's plan program (``megatron_hsap.plan.ir``):

* ``Post(round)`` → engine ``Post``; the round's ``Send``s become transfers (bytes summed per
  peer); ``Wait`` → ``Wait``.
* ``Compute``: its items grouped by input buffers and causality, one varlen call per group
  (items reading the same slots or the local tensors can share one ``cu_seqlens`` call); each
  item's rows are merged into the local fp32 accumulators (forward: o/lse; backward: dq and
  dk/dv) unless the item writes a result slot for another rank.
* ``Merge`` / ``Accumulate``: memory-bound kernels over the received rows.
* Forward: all-to-all of q, k, v before (three calls), of o after; backward: of dO before, of
  dq, dk, dv after (``runtime/ulysses.py``); none is overlapped with compute (ours does not).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Post as PlanPost, Send, Wait as PlanWait, Wire
from megatron_hsap.sim.builder import Builder
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import merge_bytes
from megatron_hsap.sim.engine import Workload

__all__ = ["hsap_workload", "a2a_calls"]


def _kv_heads_exchanged(num_kv_heads: int, intra: int) -> int:
    """kv heads the all-to-all moves: Hkv when P_intra | Hkv, else P_intra replicated copies."""
    return num_kv_heads if num_kv_heads % intra == 0 else intra


def a2a_calls(plan: object, cluster: Cluster, phase: str) -> tuple[list[float], list[float]]:
    """Seconds of each all-to-all before and after SAP in ``phase`` (empty lists at P_intra 1)."""
    o = plan.options  # type: ignore[attr-defined]
    p = cluster.intra_size
    if p == 1:
        return [], []
    h = o.num_heads
    hkv = _kv_heads_exchanged(o.num_kv_heads or o.num_heads, p)
    d, dv, b = o.head_dim, o.head_dim_v or o.head_dim, o.dtype_bytes
    tokens = plan.local_tokens  # type: ignore[attr-defined]
    members = cluster.intra_group(0)

    def call(heads: int, dim: int) -> float:
        return cluster.all_to_all_time(members, tokens * (heads // p) * dim * b)

    q, k, v, out = call(h, d), call(hkv, d), call(hkv, dv), call(h, dv)
    if phase == "fwd":
        return [q, k, v], [out]
    return [out], [q, k, v]  # dO before; dq, dk, dv after (same shapes as q, k, v)


class _Coverage:
    """Disjoint row intervals already written on one rank: the first contribution to a row is
    the kernel's own output (no merge); later ones are merged into the fp32 accumulator."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []

    def add(self, a: int, b: int) -> int:
        """Mark ``[a, b)`` written; return how many of its rows were written before."""
        i = bisect.bisect_left(self.stops, a)  # first interval that may touch [a, b)
        j = i
        overlap = 0
        lo, hi = a, b
        while j < len(self.starts) and self.starts[j] <= b:
            overlap += max(0, min(self.stops[j], b) - max(self.starts[j], a))
            lo, hi = min(lo, self.starts[j]), max(hi, self.stops[j])
            j += 1
        self.starts[i:j] = [lo]
        self.stops[i:j] = [hi]
        return overlap


def _item_merge_bytes(item: object, widths: dict[Wire, float], cov: dict[str, _Coverage]) -> float:
    """HBM bytes to fold one item's output into the local accumulators (0 if sent away or if
    it is the first contribution to its rows). ``widths``: bytes per row per output wire."""
    total = 0.0
    for wire, slot in item.dsts:  # type: ignore[attr-defined]
        if slot is not None or wire not in widths:
            continue
        rows = item.kv if wire is Wire.DKV else item.q  # type: ignore[attr-defined]
        total += cov["kv" if wire is Wire.DKV else "q"].add(rows.start, rows.stop) * widths[wire]
    return total


def hsap_workload(plan: object, cluster: Cluster, phase: str) -> tuple[Workload, list[int]]:
    """Engine workload of one inter group for ``phase`` (``fwd``/``bwd``) and its CP ranks."""
    hw = cluster.hw
    shape = plan.shape  # type: ignore[attr-defined]
    progs = plan.fwd_programs if phase == "fwd" else plan.bwd_programs  # type: ignore[attr-defined]
    size = len(progs)
    b = Builder(size)
    before, after = a2a_calls(plan, cluster, phase)
    fpp = shape.fwd_flops_per_pair if phase == "fwd" else shape.bwd_flops_per_pair
    h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
    per = merge_bytes("hsap", phase)
    widths = {Wire.O: h * dv * per} if phase == "fwd" else {Wire.DQ: h * d * per, Wire.DKV: hkv * (d + dv) * per}
    for r, prog in enumerate(progs):
        cov = {"q": _Coverage(), "kv": _Coverage()}
        for t in before:
            b.busy(r, t, "a2a", "all-to-all in")
        for ins in prog.instrs:
            if isinstance(ins, PlanPost):
                for op in ins.round.ops:
                    if isinstance(op, Send):
                        b.send(ins.round.index, r, op.peer, op.nbytes, f"{op.wire.value}")
                b.post(r, ins.round.index)
            elif isinstance(ins, PlanWait):
                b.wait(r, ins.index)
            elif isinstance(ins, Compute):
                groups: dict[tuple, list] = defaultdict(list)
                for it in ins.items:
                    groups[(it.srcs, it.causal)].append(it)
                for items in groups.values():  # one varlen call per group of shared input buffers
                    blocks = [(len(it.q), len(it.kv), it.work * fpp, it.work) for it in items]
                    secs = hw.kernel.curve.launch_s + hw.kernel.blocks_time_py(blocks, phase, h // max(1, hkv)) + hw.kernel.grid_time(
                        max(x[0] for x in blocks), max(x[1] for x in blocks), len(blocks), h, phase) + hw.kernel.gqa_accum_time(
                        [x[1] for x in blocks], shape, phase, hw.hbm_bw)
                    if b.overlapped(r):  # NCCL transfers in flight share the SMs (as Builder.kernel)
                        secs *= 1.0 + hw.overlap_slowdown
                    b.busy(r, secs, "compute", f"stage {ins.stage}", sum(x[2] for x in blocks))
                    b.elementwise(r, sum(_item_merge_bytes(it, widths, cov) for it in items), hw, "merge local")
            elif isinstance(ins, Merge):
                n = len(ins.tokens)
                b.elementwise(r, n * shape.num_heads * shape.head_dim_v * merge_bytes("hsap", "fwd"), hw, "merge o")
            elif isinstance(ins, Accumulate):
                n = len(ins.tokens)
                per = merge_bytes("hsap", "bwd")
                width = shape.num_heads * shape.head_dim if ins.wire is Wire.DQ else shape.num_kv_heads * (shape.head_dim + shape.head_dim_v)
                b.elementwise(r, n * width * per, hw, f"accumulate {ins.wire.value}")
        for t in after:
            b.busy(r, t, "a2a", "all-to-all out")
    return b.build(), cluster.inter_group(0)

"""HSAP as the simulator runs it: the compiled plan's own programs, plus the intra all-to-all.

One inter group is simulated (inter rank ``i`` = CP rank ``i·P_intra``): the ``P_intra`` inter
groups run the same plan on different heads over disjoint GPUs and ports, so they finish
together, and every member of an intra group (same ``i``) therefore enters each all-to-all at
the same moment — the all-to-all is priced in closed form (``Cluster.all_to_all_time``).

Translation of one rank's plan program (``megatron_hsap.plan.ir``):

* ``Post(round)`` → engine ``PostTag``; the round's ``Send``s become transfers (bytes summed per
  peer); ``Wait`` → ``WaitTag``.
* ``Compute``: exactly the runtime's kernel calls (``plan/calls.py``, the one definition of which
  items share one varlen call), each priced with its launch; each item's rows are merged into the
  local fp32 accumulators (forward: o/lse; backward: dq and dk/dv) unless the item writes a result
  slot for another rank. A gathered call first copies its parts' kv (an elementwise kernel of
  ``2·Σnk`` kv rows, read and written), runs as one block ``(nq, Σnk)`` and merges its q rows once.
* ``Merge`` / ``Accumulate``: memory-bound kernels over the received rows.
* Forward: all-to-all of q, k, v before (three calls), of o after; backward: of dO before, of
  dq, dk, dv after (``runtime/ulysses.py``). With one head chunk they are not overlapped; with
  ``plan.head_chunks`` > 1 they are pipelined with SAP on the rank's side stream, sharing the GPU
  (``hsap_workload``).
"""

from __future__ import annotations

import bisect

from megatron_hsap.plan.calls import LocalRows, stage_calls
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.chunks import chunk_shape
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.options import kv_head_chunks, kv_heads_per_rank
from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Phase, Post as PlanPost, Send, Wait as PlanWait, Wire
from megatron_hsap.sim.builder import Builder
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import merge_bytes
from megatron_hsap.sim.engine import Workload

__all__ = ["hsap_workload", "a2a_calls"]


def a2a_calls(plan: object, cluster: Cluster, phase: Phase | str, chunks: int = 1) -> tuple[list[float], list[float]]:
    """Seconds of each all-to-all before and after SAP in ``phase`` (empty lists at P_intra 1),
    each for one of ``chunks`` head chunks (a whole latency each): q, o (and dO, dq) at 1/``C`` of
    their bytes, k, v (dk, dv) at 1/``Ckv`` (``plan/chunks.kv_head_chunks``; one kv chunk serves
    ``C/Ckv`` q chunks). Order: ``[q, k, v], [o]`` forward, ``[dO], [dq, dk, dv]`` backward."""
    o = plan.options  # type: ignore[attr-defined]
    p = cluster.intra_size
    if p == 1:
        return [], []
    h = o.num_heads // p  # q and kv heads per intra rank after the all-to-all (kv replicated when P > Hkv)
    hkv = kv_heads_per_rank(o.num_heads, o.num_kv_heads or o.num_heads, p)
    d, dv, b = o.head_dim, o.head_dim_v or o.head_dim, o.dtype_bytes
    tokens = plan.local_tokens  # type: ignore[attr-defined]
    members = cluster.intra_group(0)

    kv_chunks = kv_head_chunks(chunks, hkv)

    def call(heads: int, dim: int, parts: int) -> float:
        return cluster.all_to_all_time(members, tokens * heads * dim * b / parts)

    q, k, v, out = call(h, d, chunks), call(hkv, d, kv_chunks), call(hkv, dv, kv_chunks), call(h, dv, chunks)
    if Phase(phase) is Phase.FWD:
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


def hsap_workload(plan: object, cluster: Cluster, phase: Phase | str) -> tuple[Workload, list[int]]:
    """Engine workload of one inter group for ``phase`` (``fwd``/``bwd``) and its CP ranks.

    ``plan.head_chunks`` = C > 1 (``plan/chunks.py``; ``runtime/hsap.py`` ``_pipeline``): the
    rank runs the SAP program C times at ``chunk_shape`` (q-side messages and blocks 1/C of the
    heads, kv-side messages 1/Ckv: a kv chunk's rows re-sent by each of its C/Ckv q chunks) and
    the intra all-to-alls go on its side stream in the runtime's issue order — chunk 0's before
    anything, then at the start of chunk c's SAP the all-to-all of chunk c+1 (k, v only when
    c+1 starts a kv chunk) and the return of chunk c−1 (dk, dv only when c−1 ends one), the
    return of chunk C−1 at the end; chunk c's SAP waits for its own all-to-all. NCCL runs the
    intra group's calls one after another (one communicator), and the SAP kernels that overlap
    them run ``1 + overlap_slowdown`` times slower (docs/design.md §2.4)."""
    hw = cluster.hw
    shape = plan.shape  # type: ignore[attr-defined]
    if plan.options.flattened_from is not None and (cluster.intra_size, cluster.inter_size) != (plan.intra_size, plan.inter_size):  # type: ignore[attr-defined]
        raise ConfigError(f"a flattened plan (plan/flatten.py) runs as {plan.intra_size} x {plan.inter_size}: simulate it on "  # type: ignore[attr-defined]
                          f"Cluster(intra_size={plan.intra_size}, inter_size={plan.inter_size}), not {cluster.topology}")  # type: ignore[attr-defined]
    phase = Phase(phase)
    progs = plan.fwd_programs if phase == Phase.FWD else plan.bwd_programs  # type: ignore[attr-defined]
    chunks = int(getattr(plan, "head_chunks", 1) or 1) if cluster.intra_size > 1 else 1
    b = Builder(len(progs))
    before, after = a2a_calls(plan, cluster, phase, chunks)
    per = chunks // kv_head_chunks(chunks, shape.num_kv_heads)  # q chunks per kv chunk
    part = chunk_shape(shape, chunks)
    scale = {w: part.token_bytes(w) / shape.token_bytes(w) for w in Wire}  # one chunk's share of a message
    stride = 1 + max((ins.round.index for prog in progs for ins in prog.instrs if isinstance(ins, PlanPost)), default=0)
    side = iter(range(10**9))  # side-stream tags
    rows = [LocalRows(plan.layout.segments[r]) for r in range(len(progs))]  # type: ignore[attr-defined]
    kv_in, kv_out = (before[1:], after[:0]) if phase == Phase.FWD else (before[:0], after[1:])  # k, v / dk, dv

    def into(c: int) -> float:  # chunk c's all-to-all in: k, v only with a kv chunk's first q chunk
        return sum(before) - (0.0 if c % per == 0 else sum(kv_in))

    def back(c: int) -> float:  # chunk c's return: dk, dv only after a kv chunk's last q chunk
        return sum(after) - (0.0 if (c + 1) % per == 0 else sum(kv_out))

    for r, prog in enumerate(progs):
        if chunks == 1:
            for t in before:
                b.busy(r, t, "a2a", "all-to-all in")
            _sap(b, r, prog, rows[r], part, scale, 0, phase, hw)
            for t in after:
                b.busy(r, t, "a2a", "all-to-all out")
            continue
        arriving = next(side)
        b.launch(r, arriving, into(0), "all-to-all in, chunk 1")
        for c in range(chunks):
            b.join(r, arriving)
            if c + 1 < chunks:
                arriving = next(side)
                b.launch(r, arriving, into(c + 1), f"all-to-all in, chunk {c + 2}")
            if c:
                b.launch(r, next(side), back(c - 1), f"all-to-all back, chunk {c}")
            _sap(b, r, prog, rows[r], part, scale, c * stride, phase, hw)
        last = next(side)
        b.launch(r, last, back(chunks - 1), f"all-to-all back, chunk {chunks}")
        b.join(r, last)
    return b.build(), cluster.inter_group(0)


def _sap(b: Builder, r: int, prog: object, rows: LocalRows, shape: HeadShape, scale: dict[Wire, float], offset: int,
         phase: Phase, hw: object) -> None:  # fmt: skip
    """Rank ``r``'s SAP program on ``shape``'s heads: sends scaled by ``scale[wire]`` (a head
    chunk's share of the message), round tags shifted by ``offset`` (one set per chunk); ``rows``:
    the rank's local rows."""
    fpp = shape.fwd_flops_per_pair if phase == Phase.FWD else shape.bwd_flops_per_pair
    h, hkv = shape.num_heads, shape.num_kv_heads
    per = merge_bytes("hsap", phase)
    outputs = (Wire.O,) if phase == Phase.FWD else (Wire.DQ, Wire.DKV)
    widths = {w: shape.token_elements(w) * per for w in outputs}  # HBM bytes per row merged (plan/costs.py)
    cov = {"q": _Coverage(), "kv": _Coverage()}
    for ins in prog.instrs:  # type: ignore[attr-defined]
        if isinstance(ins, PlanPost):
            for op in ins.round.ops:
                if isinstance(op, Send):
                    b.send(offset + ins.round.index, r, op.peer, op.nbytes * scale[op.wire], f"{op.wire.value}")
            b.post(r, offset + ins.round.index)
        elif isinstance(ins, PlanWait):
            b.wait(r, offset + ins.index)
        elif isinstance(ins, Compute):
            for call in stage_calls(ins, rows):  # the runtime's kernel calls, one launch each
                items = call.items
                if call.gathered:  # the parts' kv concatenated (a memory-bound copy), one sequence
                    (nk,), work = call.kv_lengths, call.work
                    b.elementwise(r, 2 * nk * shape.token_bytes(Wire.KV), hw, "gather kv")  # type: ignore[arg-type]
                    blocks = [(len(items[0].q), nk, work * fpp, work)]
                    items = items[:1]  # their q rows, merged once
                else:
                    blocks = [(len(it.q), len(it.kv), it.work * fpp, it.work) for it in items]
                secs = hw.kernel.curve.launch_s + hw.kernel.blocks_time_py(blocks, phase, h // max(1, hkv)) + hw.kernel.grid_time(  # type: ignore[attr-defined]
                    max(x[0] for x in blocks), max(x[1] for x in blocks), len(blocks), h, phase) + hw.kernel.gqa_accum_time(  # type: ignore[attr-defined]
                    [x[1] for x in blocks], shape, phase, hw.hbm_bw)  # type: ignore[attr-defined]
                b.compute(r, secs, hw, f"stage {ins.stage}", sum(x[2] for x in blocks))  # type: ignore[arg-type]
                b.elementwise(r, sum(_item_merge_bytes(it, widths, cov) for it in items), hw, "merge local")  # type: ignore[arg-type]
        elif isinstance(ins, Merge):
            b.elementwise(r, len(ins.tokens) * shape.token_elements(Wire.O) * merge_bytes("hsap", Phase.FWD), hw, "merge o")  # type: ignore[arg-type]
        elif isinstance(ins, Accumulate):
            width = shape.token_elements(ins.wire)
            b.elementwise(r, len(ins.tokens) * width * merge_bytes("hsap", Phase.BWD), hw, f"accumulate {ins.wire.value}")  # type: ignore[arg-type]

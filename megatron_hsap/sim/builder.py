"""Helpers to write schedules as engine programs: a ``Builder`` and kernel-call pricing.

A schedule is written rank by rank in program order (``post``, ``kernel``, ``wait`` ...);
``send(tag, src, dst, nbytes)`` registers the bytes of one round between two ranks (several
sends of one round between the same pair are one transfer: they share the pair's ports and the
round completes only when all are done). Whether a kernel runs beside a transfer of its rank
(and pays ``overlap_slowdown``) is settled in ``build``, once every rank's sends are known: a
rank that only receives a round from a rank written after it is slowed too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Sequence
import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.window import staircase_pairs
from megatron_hsap.sim.config import SimHardware
from megatron_hsap.sim.engine import Busy, Collective, Instr, Join, Launch, PostTag, TaggedTransfer, WaitTag, Workload

__all__ = ["Builder", "Blocks", "causal_pairs"]


def causal_pairs(n: np.ndarray | int, first: np.ndarray | int = 1) -> np.ndarray:
    """Pairs of a bottom-right causal block of ``n`` q rows whose first row sees ``first`` keys
    (``plan/window.py``'s ``staircase_pairs`` in float64, broadcast)."""
    return staircase_pairs(np.asarray(n, dtype=np.float64), np.asarray(first, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class Blocks:
    """Document blocks of one kernel call: ``nq``, ``nk`` rows and ``pairs`` (float64 ``[n]``)."""

    nq: np.ndarray
    nk: np.ndarray
    pairs: np.ndarray

    @staticmethod
    def of(nq: Sequence[float] | np.ndarray, nk: Sequence[float] | np.ndarray, pairs: Sequence[float] | np.ndarray) -> "Blocks":
        nq_a = np.atleast_1d(np.asarray(nq, dtype=np.float64))
        nk_a = np.atleast_1d(np.asarray(nk, dtype=np.float64))
        pr = np.atleast_1d(np.asarray(pairs, dtype=np.float64))
        keep = (nq_a > 0) & (nk_a > 0) & (pr > 0)
        return Blocks(nq_a[keep], nk_a[keep], pr[keep])

    @property
    def empty(self) -> bool:
        return len(self.pairs) == 0

    @property
    def work(self) -> float:
        return float(self.pairs.sum())

    def seconds(self, hw: SimHardware, shape: HeadShape, phase: Phase | str, launch: bool = True) -> tuple[float, float]:
        """(seconds, FLOPs) of one varlen call over these blocks on ``shape``'s heads."""
        if self.empty:
            return 0.0, 0.0
        fpp = shape.fwd_flops_per_pair if phase == Phase.FWD else shape.bwd_flops_per_pair
        flops = self.pairs * fpp
        t = hw.kernel.blocks_time(self.nq, self.nk, flops, phase, shape.num_heads // max(1, shape.num_kv_heads), self.pairs)
        t += hw.kernel.grid_time(float(self.nq.max()), float(self.nk.max()), len(self.pairs), shape.num_heads, phase)
        t += hw.kernel.gqa_accum_time(self.nk, shape, phase, hw.hbm_bw)
        if launch:
            t += hw.kernel.curve.launch_s
        return t, float(flops.sum())


class Builder:
    """Accumulates per-rank programs and the transfers of each round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.progs: list[list[Instr]] = [[] for _ in range(n)]
        self._bytes: dict[tuple[int, int, int], float] = defaultdict(float)
        self._labels: dict[tuple[int, int, int], str] = {}
        self._next_tag = 0
        self._moves: set[tuple[int, int]] = set()  # (tag, rank) pairs with bytes to move
        self._open: list[set[int]] = [set() for _ in range(n)]  # tags posted, not yet waited, per rank
        # kernels appended while tags were open: (rank, index in its program, open tags, slowdown)
        self._beside: list[tuple[int, int, frozenset[int], float]] = []

    def new_tag(self) -> int:
        self._next_tag += 1
        return self._next_tag - 1

    def send(self, tag: int, src: int, dst: int, nbytes: float, label: str = "") -> None:
        if src == dst or nbytes <= 0:
            return
        self._bytes[(tag, src, dst)] += float(nbytes)
        self._moves.update(((tag, src), (tag, dst)))
        self._labels.setdefault((tag, src, dst), label)

    def post(self, rank: int, tag: int) -> None:
        self.progs[rank].append(PostTag(tag))
        self._open[rank].add(tag)

    def wait(self, rank: int, tag: int) -> None:
        self.progs[rank].append(WaitTag(tag))
        self._open[rank].discard(tag)

    def busy(self, rank: int, seconds: float, kind: str = "compute", label: str = "", flops: float = 0.0,
             overlap_slowdown: float = 0.0) -> None:
        if seconds > 0:
            self.progs[rank].append(Busy(seconds, kind, label, flops, overlap_slowdown))

    def launch(self, rank: int, tag: int, seconds: float, label: str = "") -> None:
        """Enqueue ``seconds`` on ``rank``'s side stream (an asynchronous all-to-all, engine ``Launch``)."""
        self.progs[rank].append(Launch(tag, seconds, label))

    def join(self, rank: int, tag: int) -> None:
        """Block ``rank`` until side-stream item ``tag`` is done (engine ``Join``)."""
        self.progs[rank].append(Join(tag))

    def compute(self, rank: int, seconds: float, hw: SimHardware, label: str = "", flops: float = 0.0) -> None:
        """Append ``seconds`` of attention kernel on ``rank``. While a posted transfer that moves
        bytes to or from this rank is in flight (posted, not yet waited, in program order), the
        kernel shares SMs and HBM with NCCL and takes ``1 + hw.overlap_slowdown`` times as long —
        decided in ``build``, when every rank's sends are registered. The engine applies the same
        factor to the part that overlaps a side-stream all-to-all."""
        if seconds <= 0:
            return
        if self._open[rank]:
            self._beside.append((rank, len(self.progs[rank]), frozenset(self._open[rank]), hw.overlap_slowdown))
        self.busy(rank, seconds, "compute", label, flops, hw.overlap_slowdown)

    def kernel(self, rank: int, blocks: Blocks, hw: SimHardware, shape: HeadShape, phase: Phase | str, label: str = "") -> float:
        """Append one varlen attention call (``compute``); returns its seconds before any NCCL slowdown."""
        t, f = blocks.seconds(hw, shape, phase)
        self.compute(rank, t, hw, label, f)
        return t

    def fa3_wrapper(self, rank: int, nq: float, nk: float, shape: HeadShape, phase: Phase | str, hw: SimHardware) -> None:
        """The unpad / pad copies around one kernel call of MagiAttention's FA3 wrappers
        (``SimHardware.fa3_wrapper_copies``) for ``nq`` q and ``nk`` kv tokens of ``shape``'s heads:
        each gather reads and writes its tensor (2×), each pad zero-fills, then scatters (3×).
        Forward: q, k, v in; out (+ fp32 lse) out. Backward: q, out, dout, lse, k, v in; dq, dk, dv out."""
        if not hw.fa3_wrapper_copies:
            return
        b = shape.dtype_bytes
        q = nq * shape.num_heads * shape.head_dim * b
        o = nq * shape.num_heads * shape.head_dim_v * b
        lse = nq * shape.num_heads * 4
        kv = nk * shape.num_kv_heads * (shape.head_dim + shape.head_dim_v) * b
        if phase == Phase.FWD:
            nbytes = 2 * (q + kv) + 3 * (o + lse)
        else:
            nbytes = 2 * (q + 2 * o + lse + kv) + 3 * (q + kv)
        self.busy(rank, hw.elementwise_time(nbytes), "merge", "fa3 unpad/pad")

    def elementwise(self, rank: int, nbytes: float, hw: SimHardware, label: str = "merge") -> None:
        self.busy(rank, hw.elementwise_time(nbytes), "merge", label)

    def collective(self, rank: int, tag: int, seconds: float, kind: str = "collective", label: str = "") -> None:
        """``rank`` joins blocking collective ``tag`` (a ``new_tag()`` shared by its members):
        all members leave at the last arrival + ``seconds``."""
        self.progs[rank].append(Collective(tag, seconds, kind, label))

    def build(self) -> Workload:
        for rank, i, tags, slowdown in self._beside:
            if any((tag, rank) in self._moves for tag in tags):
                busy = self.progs[rank][i]
                self.progs[rank][i] = replace(busy, seconds=busy.seconds * (1.0 + slowdown))  # type: ignore[type-var]
        self._beside = []
        transfers = [TaggedTransfer(s, d, b, t, self._labels[(t, s, d)]) for (t, s, d), b in sorted(self._bytes.items())]
        return Workload(programs=self.progs, transfers=transfers)

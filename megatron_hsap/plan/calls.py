"""Kernel calls: which compute items of a program run as ONE varlen attention call (docs/design.md §2.2).

This module is the one definition of the grouping; the runtime (``runtime/prepared.py``) launches
exactly these calls and the simulator (``sim/hsap.py``) and the head-chunk estimate price exactly
these calls.

The rule, per ``Compute`` instruction (one stage of one rank's program), walking its items in order:

* An item that reads an operand from a pool slot or writes a result into a slot (work done for
  another rank, or with another rank's rows) is a call of its own: its operands are views of whole
  slots, which no other item shares.
* Consecutive *local* items (every operand in the rank's local tensors, every result merged into its
  local accumulators) are fused into one call when they agree on causality and on the kernel window
  (``ComputeItem.kernel_window``) and each one's q rows and kv rows start at the local row where the
  previous item's stopped. The fused call reads the contiguous row ranges ``q_rows``/``kv_rows``
  with ``cu_seqlens`` built from the items' lengths; a varlen kernel treats every sequence on its
  own, so fusing changes no number.
* Items that bring remote kv to local q rows and see every pair (:func:`gatherable`: a rectangle
  without a window cut, q side local, kv from a pool slot) and share one q range form ONE
  *gathered* call when there are two or more of them: the runtime concatenates their kv slots
  (one copy of ``Σnk`` kv rows) and runs one sequence ``q`` against ``[Σnk]`` keys; a rectangle's
  keys all precede its queries, so their order does not matter. The call sits where its first
  member was; its other members' places break local fusion as before. One launch, one grid, and
  the q rows merged once instead of once per part (docs/coalesced_calls.md).

Calls keep the items' order and never cross a stage (a ``Compute``), so they respect every ``Post``
/ ``Wait`` dependency of the program. Pure Python: the local row of a global token comes from the
rank's layout segments (:class:`LocalRows`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from megatron_hsap.errors import RuntimeMismatchError
from megatron_hsap.plan.ir import Compute, ComputeItem, Phase, Program, Segment, TokenRange, Wire

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["LocalRows", "KernelCall", "all_local", "gatherable", "stage_calls", "program_calls", "call_counts"]


class LocalRows:
    """Global token range -> the slice of local rows of one inter rank (its layout ``segments``)."""

    __slots__ = ("_starts", "_segs")

    def __init__(self, segments: Sequence[Segment]) -> None:
        self._segs = tuple(segments)
        self._starts = [s.tokens.start for s in self._segs]

    def __call__(self, tokens: TokenRange) -> slice:
        i = bisect.bisect_right(self._starts, tokens.start) - 1
        if i < 0:
            raise RuntimeMismatchError(f"tokens {tokens} are not held by this rank; the plan and its layout disagree")
        seg = self._segs[i]
        a = seg.local_start + tokens.start - seg.tokens.start
        end_seg = self._segs[bisect.bisect_right(self._starts, tokens.stop - 1) - 1]
        b = end_seg.local_start + tokens.stop - end_seg.tokens.start
        if tokens.stop > end_seg.tokens.stop or b - a != len(tokens):
            raise RuntimeMismatchError(f"tokens {tokens} are not contiguous local rows of this rank; the plan and its layout disagree")
        return slice(a, b)


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One varlen attention call of stage ``stage``: ``items`` (one, or several fused local ones).

    ``q_rows`` / ``kv_rows``: the local rows the call reads (the items' rows back to back), or None
    when the operand is a pool slot (then ``items`` is that one item). ``gathered``: the items
    share local q rows ``q_rows`` and their kv slots are concatenated in item order — one
    sequence of ``len(q)`` queries against ``Σ len(kv)`` keys (``kv_parts``)."""

    stage: int
    items: tuple[ComputeItem, ...]
    q_rows: slice | None
    kv_rows: slice | None
    gathered: bool = False

    @property
    def causal(self) -> bool:
        return self.items[0].causal

    @property
    def window(self) -> tuple[int, int]:
        """flash-attn ``window_size`` of every item of the call (``ComputeItem.kernel_window``)."""
        return self.items[0].kernel_window

    @property
    def q_lengths(self) -> tuple[int, ...]:
        """Rows of each varlen sequence's queries (``cu_seqlens_q``)."""
        if self.gathered:
            return (len(self.items[0].q),)
        return tuple(len(it.q) for it in self.items)

    @property
    def kv_lengths(self) -> tuple[int, ...]:
        """Rows of each varlen sequence's keys (``cu_seqlens_k``)."""
        if self.gathered:
            return (sum(self.kv_parts),)
        return tuple(len(it.kv) for it in self.items)

    @property
    def blocks(self) -> tuple[tuple[int, int, int, int], ...]:
        """Each item's ``(q start, q stop, kv start, kv stop)``, in order: what pairs a backward call
        with the forward call over the same blocks (``runtime/dropout.py``)."""
        return tuple((it.q.start, it.q.stop, it.kv.start, it.kv.stop) for it in self.items)

    @property
    def kv_parts(self) -> tuple[int, ...]:
        """Each item's kv rows, in order: a gathered call's kv is their concatenation."""
        return tuple(len(it.kv) for it in self.items)

    @property
    def work(self) -> int:
        return sum(it.work for it in self.items)


def all_local(item: ComputeItem) -> bool:
    """Every operand in the rank's local tensors and every result into its local accumulators."""
    return all(s is None for _, s in item.srcs) and all(s is None for _, s in item.dsts)


def gatherable(item: ComputeItem) -> bool:
    """May join a gathered call: a rectangle whose every pair is visible (not causal, no window
    cut: ``kernel_window`` plain), every q-side operand local and every q-side result into the
    local accumulators, kv read from a pool slot (and, backward, dk/dv written to one)."""
    if item.causal or item.kernel_window != (-1, -1):
        return False
    for wire, slot in item.srcs:
        if (slot is None) is (wire is Wire.KV):
            return False
    return all((slot is None) is (wire is not Wire.DKV) for wire, slot in item.dsts)


def _fusable(prev: ComputeItem, item: ComputeItem, rows: LocalRows) -> bool:
    return (
        all_local(prev) and all_local(item) and item.causal == prev.causal and item.kernel_window == prev.kernel_window
        and rows(item.q).start == rows(prev.q).stop and rows(item.kv).start == rows(prev.kv).stop
    )  # fmt: skip


def stage_calls(compute: Compute, rows: LocalRows) -> tuple[KernelCall, ...]:
    """The kernel calls of one ``Compute`` instruction, in the items' order (the module's rule)."""
    calls: list[KernelCall] = []
    batch: list[ComputeItem] = []
    groups: dict[tuple[int, int], list[int]] = {}  # q range -> indices of its gatherable items
    for i, it in enumerate(compute.items):
        if gatherable(it):
            groups.setdefault((it.q.start, it.q.stop), []).append(i)
    first = {g[0]: g for g in groups.values() if len(g) > 1}
    member = {i for g in first.values() for i in g}

    def flush() -> None:
        if batch:
            first, last = batch[0], batch[-1]
            q_rows = slice(rows(first.q).start, rows(last.q).stop) if first.src(Wire.Q) is None else None
            kv_rows = slice(rows(first.kv).start, rows(last.kv).stop) if first.src(Wire.KV) is None else None
            calls.append(KernelCall(compute.stage, tuple(batch), q_rows, kv_rows))
            batch.clear()

    for i, it in enumerate(compute.items):
        if i in member:  # a gathered call's member: the call at the first one, a break at every one
            flush()
            if i in first:
                calls.append(KernelCall(compute.stage, tuple(compute.items[j] for j in first[i]), rows(it.q), None,
                                        gathered=True))  # fmt: skip
            continue
        if batch and not _fusable(batch[-1], it, rows):
            flush()
        batch.append(it)
        if not all_local(it):
            flush()
    flush()
    return tuple(calls)


def program_calls(program: Program, segments: Sequence[Segment]) -> tuple[tuple[KernelCall, ...], ...]:
    """The kernel calls of each ``Compute`` of ``program`` (in program order), one tuple per stage;
    ``segments``: the layout segments of ``program``'s rank."""
    rows = LocalRows(segments)
    return tuple(stage_calls(ins, rows) for ins in program.instrs if isinstance(ins, Compute))


def call_counts(plan: "Plan", phase: Phase | str) -> tuple[int, ...]:
    """Kernel calls each inter rank makes in one SAP run of ``phase`` (per head chunk): the calls
    ``program_calls`` finds in its program. Without a sliding window they are counted from the
    plan's staged blocks instead (``_counts_from_blocks``; at 1,024 GPUs walking the programs took
    a third of a 4M-token compile); tested equal (``tests/plan/test_calls.py``)."""
    ph = Phase(phase)
    if plan.options.window < 0:
        return _counts_from_blocks(plan)
    return tuple(sum(len(calls) for calls in program_calls(plan.program(r, ph), plan.layout.segments[r]))
                 for r in range(plan.inter_size))  # fmt: skip


def _counts_from_blocks(plan: "Plan") -> tuple[int, ...]:
    """``call_counts`` of a plan without a window, in closed form: the items of a rank's
    ``Compute`` are its blocks of that stage in program order, an item is all-local exactly when
    its block is (the same in both phases), and every item's kernel window is the plain one, so
    the calls are ``block_costs.BlockGroups``' (this module's rule over the blocks' rows)."""
    from megatron_hsap.plan.block_costs import BlockGroups, _arrays
    from megatron_hsap.plan.placement import CostRates

    size = plan.inter_size
    a = _arrays(plan.chosen.units)
    if len(a) == 0:
        return (0,) * size
    n = 1 + int(a[:, 1].max())
    segments = tuple(tuple((s.tokens.start, s.local_start) for s in segs) for segs in plan.layout.segments)
    rows_only = CostRates(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, segments=segments)  # BlockGroups reads the segments only
    calls = BlockGroups.of(a, size, n, rows_only).gcell // n  # each call's rank
    return tuple(int(c) for c in np.bincount(calls, minlength=size))


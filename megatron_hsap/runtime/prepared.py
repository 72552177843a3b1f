"""A plan's programs prepared for the executor: typed instructions, kernel metadata on the device once.

:func:`prepare` turns one inter rank's forward and backward programs (``plan/ir.py``) into tuples
of typed instructions (:data:`Step`) that :class:`~megatron_hsap.runtime.executor.Executor`
interprets by type (docs/design.md §2.2):

* :class:`PostRound` / :class:`WaitRound` — launch / wait one P2P round;
* :class:`ComputeCalls` — one stage's kernel calls, exactly those of ``plan/calls.py`` (the one
  definition of which items fuse into one varlen call, which the simulator prices too), each a
  :class:`PreparedCall` with its ``cu_seqlens`` on the device and maximum lengths as host ints;
* :class:`MergePartial` / :class:`AccumulatePartial` — a received partial into the local fp32
  accumulators, its local rows resolved here.

Metadata (issue 16 item 3): every call's ``cu_seqlens`` of *both* phases is built on the host and
uploaded in one packed, asynchronous copy from pinned memory (``runtime/upload.py``) — never one
``torch.tensor(..., device=cuda)`` per call (each a synchronous copy, the first draining the
stream). The executor is built once per (plan, group, device) and cached (``executor_for``), so a
plan's metadata moves to the device once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megatron_hsap.errors import RuntimeMismatchError
from megatron_hsap.plan.calls import KernelCall, LocalRows, stage_calls
from megatron_hsap.plan.ir import Accumulate, Compute, ComputeItem, Merge, Post, Program, Round, Send, Slot, Wait, Wire
from megatron_hsap.runtime.upload import upload

__all__ = ["PreparedCall", "PostRound", "WaitRound", "ComputeCalls", "MergePartial", "AccumulatePartial", "Step",
           "Prepared", "prepare"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """One kernel call of ``plan/calls.py`` with its ``cu_seqlens_q/k`` (int32, on the device once
    placed; ``meta``: their indices in the plan's metadata upload), maximum lengths and blocks
    (``KernelCall.blocks``, computed here once rather than per call on the hot path)."""

    call: KernelCall
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    meta: tuple[int, int] = (-1, -1)
    blocks: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def items(self) -> tuple[ComputeItem, ...]:
        return self.call.items

    @property
    def q_rows(self) -> slice | None:
        return self.call.q_rows

    @property
    def kv_rows(self) -> slice | None:
        return self.call.kv_rows

    @property
    def causal(self) -> bool:
        return self.call.causal

    @property
    def gathered(self) -> bool:
        return self.call.gathered

    @property
    def window(self) -> tuple[int, int]:
        return self.call.window


@dataclass(frozen=True, slots=True)
class PostRound:
    """Launch ``round`` (one ``batch_isend_irecv``); ``stage`` names it in errors."""

    round: Round
    stage: int


@dataclass(frozen=True, slots=True)
class WaitRound:
    """Wait for round ``index`` (with the executor's deadline)."""

    index: int


@dataclass(frozen=True, slots=True)
class ComputeCalls:
    """Stage ``stage``'s kernel calls, in order."""

    stage: int
    calls: tuple[PreparedCall, ...]


@dataclass(frozen=True, slots=True)
class MergePartial:
    """Merge a received partial (``o``, ``lse`` slots, ``tokens`` rows) into the local rows ``rows``
    of the forward accumulators (overflow-safe LSE merge)."""

    rows: slice
    tokens: int
    o: Slot
    lse: Slot


@dataclass(frozen=True, slots=True)
class AccumulatePartial:
    """Add a received partial gradient of ``wire`` (DQ or DKV, in the plan's gradient wire dtype)
    from ``src`` into the fp32 accumulators' local ``rows``."""

    wire: Wire
    rows: slice
    tokens: int
    src: Slot


Step = PostRound | WaitRound | ComputeCalls | MergePartial | AccumulatePartial


@dataclass(frozen=True, slots=True)
class Prepared:
    """One program, prepared: its steps and the bytes it sends and receives per run."""

    steps: tuple[Step, ...]
    expected_sent: int
    expected_recv: int

    @property
    def kernel_calls(self) -> int:
        return sum(len(s.calls) for s in self.steps if isinstance(s, ComputeCalls))


def prepare(programs: tuple[Program, ...], rows: LocalRows, device: torch.device,
            round_bases: tuple[int, ...] | None = None) -> tuple[Prepared, ...]:  # fmt: skip
    """Each of ``programs`` prepared, with the ``cu_seqlens`` of every kernel call of all of them
    on ``device`` (views of one buffer: one upload). ``round_bases``: per program, the global index
    of its phase's first round (``Plan.round_base``), subtracted to number its stages; default 0."""
    bases = (0,) * len(programs) if round_bases is None else round_bases
    if len(bases) != len(programs):
        raise RuntimeMismatchError(f"{len(programs)} programs but {len(bases)} round bases; pass one per program")
    host: list[Tensor] = []
    preps = [_prepare(program, rows, host, base) for program, base in zip(programs, bases)]
    on_device = upload(host, device)
    return tuple(_placed(p, on_device) for p in preps)


def _placed(prep: Prepared, tensors: tuple[Tensor, ...]) -> Prepared:
    """``prep`` with its calls' ``cu_seqlens`` (host tensors tagged by index) swapped for ``tensors``."""
    steps: list[Step] = []
    for step in prep.steps:
        if isinstance(step, ComputeCalls):
            calls = tuple(replace(c, cu_q=tensors[c.meta[0]], cu_k=tensors[c.meta[1]]) for c in step.calls)
            step = ComputeCalls(step.stage, calls)
        steps.append(step)
    return replace(prep, steps=tuple(steps))


def _prepare(program: Program, rows: LocalRows, host: list[Tensor], base: int) -> Prepared:
    """One program's steps; its calls' ``cu_seqlens`` are appended to ``host`` (int32) and the
    calls keep their indices in ``meta``."""
    steps: list[Step] = []
    sent = recv = 0

    def cu(lengths: tuple[int, ...]) -> int:
        host.append(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32))
        return len(host) - 1

    def prepared(call: KernelCall) -> PreparedCall:
        lq, lk = call.q_lengths, call.kv_lengths
        iq, ik = cu(lq), cu(lk)
        return PreparedCall(call, host[iq], host[ik], max(lq), max(lk), (iq, ik), call.blocks)

    for ins in program.instrs:
        match ins:
            case Post(round=rnd):
                steps.append(PostRound(rnd, rnd.index - base))
                for op in rnd.ops:
                    if isinstance(op, Send):
                        sent += op.nbytes
                    else:
                        recv += op.nbytes
            case Wait(index=index):
                steps.append(WaitRound(index))
            case Compute():
                steps.append(ComputeCalls(ins.stage, tuple(prepared(c) for c in stage_calls(ins, rows))))
            case Merge(tokens=tokens, o=o, lse=lse):
                steps.append(MergePartial(rows(tokens), len(tokens), o, lse))
            case Accumulate(wire=wire, tokens=tokens, src=src):
                steps.append(AccumulatePartial(wire, rows(tokens), len(tokens), src))
            case _:  # pragma: no cover - the IR has no other instruction
                raise RuntimeMismatchError(f"unknown instruction {ins!r}")
    return Prepared(tuple(steps), sent, recv)

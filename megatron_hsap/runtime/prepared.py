"""A plan's programs prepared for the executor: kernel calls batched, metadata on the device once.

:func:`prepare` turns one inter rank's forward and backward programs (``plan.ir``) into the flat
step lists ``Executor`` interprets: consecutive compute items whose operands are adjacent local
rows are batched into one varlen kernel call (same numbers: the calls are per sequence), each with
its ``cu_seqlens_q/k`` and maximum lengths.

Metadata (issue 16 item 3): every call's ``cu_seqlens`` of *both* phases is built on the host and
uploaded in one packed, asynchronous copy from pinned memory (``runtime/upload.py``) — never one
``torch.tensor(..., device=cuda)`` per call (each a synchronous copy, the first draining the
stream). The executor is built once per (plan, group, device) and cached (``executor_for``), so a
plan's metadata moves to the device once. Maximum lengths stay host ints (the kernels take them
as arguments).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megatron_hsap.errors import RuntimeMismatchError
from megatron_hsap.plan.ir import Accumulate, Compute, ComputeItem, Merge, Post, Program, Send, TokenRange, Wait, Wire
from megatron_hsap.runtime.upload import upload

__all__ = ["Rows", "KernelCall", "Prepared", "prepare"]


class Rows:
    """Global token range -> local rows of one inter rank (its layout segments)."""

    def __init__(self, segments: tuple) -> None:
        self._starts = [s.tokens.start for s in segments]
        self._segs = segments

    def __call__(self, tokens: TokenRange) -> slice:
        i = bisect.bisect_right(self._starts, tokens.start) - 1
        if i < 0:
            raise RuntimeMismatchError(f"tokens {tokens} are not held by this rank")
        seg = self._segs[i]
        a = seg.local_start + tokens.start - seg.tokens.start
        end_seg = self._segs[bisect.bisect_right(self._starts, tokens.stop - 1) - 1]
        b = end_seg.local_start + tokens.stop - end_seg.tokens.start
        if tokens.stop > end_seg.tokens.stop or b - a != len(tokens):
            raise RuntimeMismatchError(f"tokens {tokens} are not contiguous local rows of this rank")
        return slice(a, b)


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One kernel call: ``items`` (one, or several batched), their local rows (None: from a slot)."""

    items: tuple[ComputeItem, ...]
    causal: bool
    q_rows: slice | None
    kv_rows: slice | None
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    meta: tuple[int, int] = (-1, -1)  # indices of cu_q, cu_k in the plan's metadata upload
    window: tuple[int, int] = (-1, -1)  # the items' sliding window relative to each block (ComputeItem.kernel_window)


@dataclass(frozen=True, slots=True)
class Prepared:
    steps: tuple  # ("post", Round) | ("compute", stage, (KernelCall, ...)) | ("wait", int) | Merge | Accumulate
    expected_sent: int
    expected_recv: int


def _local_only(item: ComputeItem) -> bool:
    return all(s is None for _, s in item.srcs) and all(s is None for _, s in item.dsts)


def prepare(programs: tuple[Program, ...], rows: Rows, device: torch.device) -> tuple[Prepared, ...]:
    """Each of ``programs`` prepared, with the ``cu_seqlens`` of every kernel call of all of them
    on ``device`` (views of one buffer: one upload)."""
    host: list[Tensor] = []
    preps = [_prepare(program, rows, host) for program in programs]
    on_device = upload(host, device)
    return tuple(_placed(p, on_device) for p in preps)


def _placed(prep: Prepared, tensors: tuple[Tensor, ...]) -> Prepared:
    """``prep`` with its calls' ``cu_seqlens`` (host tensors tagged by index) swapped for ``tensors``."""
    steps = []
    for step in prep.steps:
        if isinstance(step, tuple) and step[0] == "compute":
            calls = tuple(replace(c, cu_q=tensors[c.meta[0]], cu_k=tensors[c.meta[1]]) for c in step[2])
            step = ("compute", step[1], calls)
        steps.append(step)
    return replace(prep, steps=tuple(steps))


def _prepare(program: Program, rows: Rows, host: list[Tensor]) -> Prepared:
    """One program's steps; its calls' ``cu_seqlens`` are appended to ``host`` (int32) and the
    calls keep their indices in ``meta``."""
    steps: list = []
    sent = recv = 0

    def cu(lengths: list[int]) -> Tensor:
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        host.append(torch.tensor(out, dtype=torch.int32))
        return host[-1]

    def flush(batch: list[ComputeItem], calls: list[KernelCall]) -> None:
        if not batch:
            return
        first = batch[0]
        q_local = dict(first.srcs)[Wire.Q] is None
        kv_local = dict(first.srcs)[Wire.KV] is None
        q_rows = slice(rows(batch[0].q).start, rows(batch[-1].q).stop) if q_local else None
        kv_rows = slice(rows(batch[0].kv).start, rows(batch[-1].kv).stop) if kv_local else None
        lq, lk = [len(it.q) for it in batch], [len(it.kv) for it in batch]
        cu_q, cu_k = cu(lq), cu(lk)
        calls.append(KernelCall(tuple(batch), first.causal, q_rows, kv_rows, cu_q, cu_k, max(lq), max(lk),
                                (len(host) - 2, len(host) - 1), first.kernel_window))
        batch.clear()

    for ins in program.instrs:
        if isinstance(ins, Post):
            steps.append(("post", ins.round))
            for op in ins.round.ops:
                if isinstance(op, Send):
                    sent += op.nbytes
                else:
                    recv += op.nbytes
        elif isinstance(ins, Wait):
            steps.append(("wait", ins.index))
        elif isinstance(ins, Compute):
            calls: list[KernelCall] = []
            batch: list[ComputeItem] = []
            for it in ins.items:
                if batch:
                    prev = batch[-1]
                    joinable = (
                        _local_only(it) and _local_only(prev) and it.causal == prev.causal
                        and it.kernel_window == prev.kernel_window
                        and rows(it.q).start == rows(prev.q).stop and rows(it.kv).start == rows(prev.kv).stop
                    )  # fmt: skip
                    if not joinable:
                        flush(batch, calls)
                batch.append(it)
                if not _local_only(it):
                    flush(batch, calls)
            flush(batch, calls)
            steps.append(("compute", ins.stage, tuple(calls)))
        elif isinstance(ins, (Merge, Accumulate)):
            steps.append(ins)
        else:  # pragma: no cover - the IR has no other instruction
            raise RuntimeMismatchError(f"unknown instruction {ins!r}")
    return Prepared(tuple(steps), sent, recv)

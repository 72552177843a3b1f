"""Code generation (DESIGN §2.1 step 4): staged blocks → per-rank programs with rounds and slots.

Timeline of one phase on every rank (``S`` = number of compute stages)::

    for k in 0..S:   Post(round k) · Compute(stage k) · Wait(round k) · Merge/Accumulate(round k)

Round ``k`` carries the inputs of stage ``k + 1`` and the results of stage ``k − 1``; the last
round ``S`` only returns results. Messages are generated once in a canonical global order and
each rank takes its sends and receives from that one list, so the per-peer order of every
``batch_isend_irecv`` matches its peer's by construction (the verifier re-checks it).

Pool slots are allocated first-fit over (time, bytes) with exact lifetimes, in event steps
(``post k`` = 2k, ``wait k`` = 2k + 1): an input of stage k lives [2k−2, 2k+1], a result computed
at stage k lives [2k, 2k+3] on the computing rank, a result received in round k lives [2k, 2k+1].
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import (
    Accumulate,
    Compute,
    ComputeItem,
    Instr,
    Merge,
    Phase,
    Post,
    Program,
    Recv,
    Round,
    Send,
    Slot,
    TokenRange,
    Unit,
    Wait,
    Wire,
)

__all__ = ["Message", "PoolOverflow", "generate", "ALIGN"]

ALIGN = 256  # byte alignment of slots: any dtype view and vectorised kernel loads stay aligned

_WIRE_ORDER = {w: i for i, w in enumerate(Wire)}


class PoolOverflow(Exception):
    """Internal: a rank's live slots exceed the pool capacity (the planner re-stages)."""


@dataclass(frozen=True, slots=True)
class Message:
    round: int  # round index within the phase
    src: int
    dst: int
    wire: Wire
    tokens: TokenRange
    nbytes: int
    part: int = 0  # tells apart results of several blocks with the same rows (never merged in flight)

    def key(self) -> tuple:
        return (self.src, self.dst, _WIRE_ORDER[self.wire], self.tokens.start, self.tokens.stop, self.part)


_INPUTS = {
    Phase.FWD: ((Wire.Q,), (Wire.KV,)),
    Phase.BWD: ((Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA), (Wire.KV,)),
}


def phase_messages(units: list[Unit], phase: Phase, shape: HeadShape) -> list[Message]:
    """Every message of one phase (inputs deduplicated per rank, stage and range)."""
    q_wires, kv_wires = _INPUTS[phase]
    seen: set[tuple] = set()
    parts: dict[tuple, int] = defaultdict(int)
    out: list[Message] = []

    def add(rnd: int, src: int, dst: int, wire: Wire, tokens: TokenRange, result: bool = False) -> None:
        key = (rnd, src, dst, wire, tokens)
        if result:  # one message per block
            out.append(Message(rnd, src, dst, wire, tokens, shape.nbytes(wire, len(tokens)), parts[key]))
            parts[key] += 1
        elif key not in seen:  # inputs: one copy per (rank, stage, range)
            seen.add(key)
            out.append(Message(rnd, src, dst, wire, tokens, shape.nbytes(wire, len(tokens))))

    for u in units:
        k = u.stage
        if u.rank != u.q_owner:
            for w in q_wires:
                add(k - 1, u.q_owner, u.rank, w, u.q)
            for w in ((Wire.O, Wire.LSE) if phase is Phase.FWD else (Wire.DQ,)):
                add(k + 1, u.rank, u.q_owner, w, u.q, result=True)
        if u.rank != u.kv_owner:
            for w in kv_wires:
                add(k - 1, u.kv_owner, u.rank, w, u.kv)
            if phase is Phase.BWD:
                add(k + 1, u.rank, u.kv_owner, Wire.DKV, u.kv, result=True)
    out.sort(key=lambda m: (m.round, m.key()))
    return out


_RESULT_WIRES = {Phase.FWD: (Wire.O, Wire.LSE), Phase.BWD: (Wire.DQ, Wire.DKV)}


class _Pool:
    """First-fit allocator over (event-step interval, byte range) for one rank."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: list[tuple[int, int, int, int]] = []  # (offset, end, t0, t1)
        self.peak = 0

    def alloc(self, nbytes: int, t0: int, t1: int) -> Slot:
        size = -(-nbytes // ALIGN) * ALIGN
        busy = sorted((o, e) for o, e, s0, s1 in self.live if not (s1 < t0 or t1 < s0))
        off = 0
        for o, e in busy:
            if off + size <= o:
                break
            off = max(off, e)
        if off + size > self.capacity:
            raise PoolOverflow(f"needs {off + size} bytes > capacity {self.capacity}")
        self.live.append((off, off + size, t0, t1))
        self.peak = max(self.peak, off + size)
        return Slot(off, nbytes)


@dataclass(frozen=True, slots=True)
class PhaseCode:
    programs: tuple[Program, ...]
    messages: tuple[Message, ...]
    rounds: int  # S + 1 rounds (some possibly empty)
    pool_peak: tuple[int, ...]  # bytes per rank


def generate(units: list[Unit], phase: Phase, size: int, shape: HeadShape, capacity: int, round_base: int) -> PhaseCode:
    """Emit every rank's program for one phase. Raises ``PoolOverflow`` when slots do not fit."""
    stages = 1 + max((u.stage for u in units), default=0)
    msgs = phase_messages(units, phase, shape)
    pools = [_Pool(capacity) for _ in range(size)]
    recv_slot: dict[tuple, Slot] = {}  # (dst, round, src, wire, tokens) -> slot
    for m in msgs:
        k = m.round
        if m.wire in _RESULT_WIRES[phase]:
            life = (2 * k, 2 * k + 1)  # merged right after the wait
        else:
            life = (2 * k, 2 * k + 3)  # used by the compute of stage k + 1
        recv_slot[(m.dst, k, m.src, m.wire, m.tokens, m.part)] = pools[m.dst].alloc(m.nbytes, *life)
    out_slot: dict[tuple, Slot] = {}  # (rank, stage, wire, q/kv tokens) -> result slot
    q_wires, kv_wires = _INPUTS[phase]
    by_rank_stage: dict[tuple[int, int], list[ComputeItem]] = defaultdict(list)
    for u in sorted(units, key=lambda u: (u.rank, u.stage, u.rank == u.q_owner, u.q.start, u.kv.start)):
        k, r = u.stage, u.rank
        srcs: list[tuple[Wire, Slot | None]] = []
        for w in q_wires:
            srcs.append((w, None if r == u.q_owner else recv_slot[(r, k - 1, u.q_owner, w, u.q, 0)]))
        for w in kv_wires:
            srcs.append((w, None if r == u.kv_owner else recv_slot[(r, k - 1, u.kv_owner, w, u.kv, 0)]))
        dsts: list[tuple[Wire, Slot | None]] = []
        result_wires = ((Wire.O, u.q), (Wire.LSE, u.q)) if phase is Phase.FWD else ((Wire.DQ, u.q), (Wire.DKV, u.kv))
        for w, toks in result_wires:
            owner = u.kv_owner if w is Wire.DKV else u.q_owner
            if r == owner:
                dsts.append((w, None))
            else:
                slot = pools[r].alloc(shape.nbytes(w, len(toks)), 2 * k, 2 * k + 3)
                out_slot[(r, k, w, toks, id(u))] = slot
                dsts.append((w, slot))
        item = ComputeItem(q=u.q, kv=u.kv, causal=u.causal, srcs=tuple(srcs), dsts=tuple(dsts))
        by_rank_stage[(r, k)].append(item)
    # Result sends read the slot their block wrote; match messages to blocks in canonical order.
    result_src: dict[tuple, list[Slot]] = defaultdict(list)
    for (r, k, w, toks, _), slot in sorted(out_slot.items(), key=lambda kv: (kv[0][0], kv[0][1], _WIRE_ORDER[kv[0][2]], kv[0][3])):
        result_src[(r, k + 1, w, toks)].append(slot)
    per_rank_round: dict[tuple[int, int], list[Send | Recv]] = defaultdict(list)
    post_merge: dict[tuple[int, int], list[Instr]] = defaultdict(list)
    for m in msgs:
        k = m.round
        src_slot = None
        if m.wire in _RESULT_WIRES[phase]:
            src_slot = result_src[(m.src, k, m.wire, m.tokens)].pop(0)
        dst = recv_slot[(m.dst, k, m.src, m.wire, m.tokens, m.part)]
        per_rank_round[(m.src, k)].append(Send(m.wire, m.tokens, m.dst, m.nbytes, src_slot))
        per_rank_round[(m.dst, k)].append(Recv(m.wire, m.tokens, m.src, m.nbytes, dst))
        if m.wire is Wire.O:
            lse = recv_slot[(m.dst, k, m.src, Wire.LSE, m.tokens, m.part)]
            post_merge[(m.dst, k)].append(Merge(m.tokens, dst, lse))
        elif m.wire in (Wire.DQ, Wire.DKV):
            post_merge[(m.dst, k)].append(Accumulate(m.wire, m.tokens, dst))
    programs = []
    for r in range(size):
        instrs: list[Instr] = []
        for k in range(stages + 1):
            ops = per_rank_round.get((r, k))
            if ops:
                instrs.append(Post(Round(round_base + k, tuple(ops))))
            items = by_rank_stage.get((r, k))
            if items:
                instrs.append(Compute(k, tuple(items)))
            if ops:
                instrs.append(Wait(round_base + k))
            instrs.extend(post_merge.get((r, k), ()))
        programs.append(Program(rank=r, phase=phase, instrs=tuple(instrs)))
    return PhaseCode(
        programs=tuple(programs),
        messages=tuple(msgs),
        rounds=stages + 1,
        pool_peak=tuple(p.peak for p in pools),
    )

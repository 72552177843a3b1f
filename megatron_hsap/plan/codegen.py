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


def _first_fit(requests: list[tuple[int, int, int, int]], capacity: int) -> tuple[dict[int, Slot], int]:
    """Allocate ``(t0, t1, nbytes, key)`` requests (closed event-step lifetimes) first-fit by
    offset, in order of start time: an entry dead before the current start can never overlap a
    later request, so the live list stays short. Returns ({key: slot}, peak bytes)."""
    slots: dict[int, Slot] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, t1), sorted by offset
    peak = 0
    for t0, t1, nbytes, key in sorted(requests, key=lambda r: (r[0], -r[2], r[3])):
        live = [e for e in live if e[2] >= t0]
        size = -(-nbytes // ALIGN) * ALIGN
        off = 0
        pos = 0
        for pos, (o, e, _) in enumerate(live):
            if off + size <= o:
                break
            off = max(off, e)
        else:
            pos = len(live)
        if off + size > capacity:
            raise PoolOverflow(f"needs {off + size} bytes > capacity {capacity}")
        live.insert(pos, (off, off + size, t1))
        live.sort()
        peak = max(peak, off + size)
        slots[key] = Slot(off, nbytes)
    return slots, peak


@dataclass(frozen=True, slots=True)
class PhaseCode:
    programs: tuple[Program, ...]
    messages: tuple[Message, ...]
    rounds: int  # S + 1 rounds (some possibly empty)
    pool_peak: tuple[int, ...]  # bytes per rank


def generate(units: list[Unit], phase: Phase, size: int, shape: HeadShape, capacity: int, round_base: int,
             msgs: list[Message] | None = None) -> PhaseCode:
    """Emit every rank's program for one phase. Raises ``PoolOverflow`` when slots do not fit.

    Slot lifetimes in event steps (``post k`` = 2k, ``wait k`` = 2k + 1): an input received in
    round k (for stage k + 1) lives [2k, 2k + 3]; a result computed at stage k lives [2k, 2k + 3]
    (sent in round k + 1); a result received in round k lives [2k, 2k + 1] (merged after the wait).
    """
    stages = 1 + max((u.stage for u in units), default=0)
    if msgs is None:
        msgs = phase_messages(units, phase, shape)
    results = _RESULT_WIRES[phase]
    q_wires, kv_wires = _INPUTS[phase]
    requests: list[list[tuple[int, int, int, int]]] = [[] for _ in range(size)]
    for idx, m in enumerate(msgs):
        k = m.round
        life = (2 * k, 2 * k + 1) if m.wire in results else (2 * k, 2 * k + 3)
        requests[m.dst].append((life[0], life[1], m.nbytes, idx))
    order = sorted(range(len(units)), key=lambda i: (units[i].rank, units[i].stage, units[i].rank == units[i].q_owner,
                                                     units[i].q.start, units[i].kv.start))
    out_keys: list[tuple[int, Wire, TokenRange]] = []  # per result slot: (unit index, wire, rows)
    base = len(msgs)
    for i in order:
        u = units[i]
        k = u.stage
        for w in results:
            owner = u.kv_owner if w is Wire.DKV else u.q_owner
            if u.rank != owner:
                toks = u.kv if w is Wire.DKV else u.q
                requests[u.rank].append((2 * k, 2 * k + 3, shape.nbytes(w, len(toks)), base + len(out_keys)))
                out_keys.append((i, w, toks))
    slot_of: dict[int, Slot] = {}
    peaks = []
    for r in range(size):
        got, peak = _first_fit(requests[r], capacity)
        slot_of.update(got)
        peaks.append(peak)
    recv_slot: dict[tuple, Slot] = {}  # (dst, round, src, wire, tokens, part) -> slot
    for idx, m in enumerate(msgs):
        recv_slot[(m.dst, m.round, m.src, m.wire, m.tokens, m.part)] = slot_of[idx]
    unit_out: dict[tuple[int, Wire], Slot] = {(i, w): slot_of[base + j] for j, (i, w, _) in enumerate(out_keys)}
    by_rank_stage: dict[tuple[int, int], list[ComputeItem]] = defaultdict(list)
    # result sends read the slots their blocks wrote, matched in canonical order
    result_src: dict[tuple, list[Slot]] = defaultdict(list)
    for i in order:
        u = units[i]
        k, r = u.stage, u.rank
        srcs: list[tuple[Wire, Slot | None]] = []
        for w in q_wires:
            srcs.append((w, None if r == u.q_owner else recv_slot[(r, k - 1, u.q_owner, w, u.q, 0)]))
        for w in kv_wires:
            srcs.append((w, None if r == u.kv_owner else recv_slot[(r, k - 1, u.kv_owner, w, u.kv, 0)]))
        dsts: list[tuple[Wire, Slot | None]] = []
        for w in results:
            slot = unit_out.get((i, w))
            dsts.append((w, slot))
            if slot is not None:
                result_src[(r, k + 1, w, u.kv if w is Wire.DKV else u.q)].append(slot)
        by_rank_stage[(r, k)].append(ComputeItem(q=u.q, kv=u.kv, causal=u.causal, srcs=tuple(srcs), dsts=tuple(dsts)))
    per_rank_round: dict[tuple[int, int], list[Send | Recv]] = defaultdict(list)
    post_merge: dict[tuple[int, int], list[Instr]] = defaultdict(list)
    for m in msgs:
        k = m.round
        src_slot = result_src[(m.src, k, m.wire, m.tokens)].pop(0) if m.wire in results else None
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
    return PhaseCode(programs=tuple(programs), messages=tuple(msgs), rounds=stages + 1, pool_peak=tuple(peaks))

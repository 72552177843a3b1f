"""Code generation (docs/design.md §2.1 step 4): staged blocks → per-rank programs with rounds and slots.

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
    PHASE_WIRES,
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
    new_compute_item,
    new_recv,
    new_send,
    pickle_by_fields,
    positional_builder,
)

__all__ = ["Message", "new_message", "PoolOverflow", "generate", "phase_rounds", "ALIGN"]

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


pickle_by_fields(Message)


# Slot lifetimes (the module docstring), one rule for ``generate``'s slots and ``_live_peak``'s
# bound: a slot opened at event step 2k lives through step 2k + span.
_INPUT_SPAN = 3  # an input received in round k, for stage k + 1: until stage k + 1's compute ends
_RESULT_SPAN = 3  # a result computed at stage k: until round k + 1, which sends it, is waited on
_RECEIVED_SPAN = 1  # a result received in round k: merged right after its wait


new_message = positional_builder(Message)  # ``Message(*fields)``, ~2x faster (``ir.positional_builder``)


def wire_bytes(shape: HeadShape) -> dict[Wire, int]:
    """Bytes per token row of every wire (``HeadShape.token_bytes``, looked up once)."""
    return {w: shape.token_bytes(w) for w in Wire}


def _messages(units: list[Unit], phase: Phase, shape: HeadShape) -> tuple[list[Message], list[list[int] | None], dict[tuple[int, Wire], int]]:
    """Every message of one phase in canonical order (inputs deduplicated per rank, stage and
    range; one result message per block and wire), and where each block's inputs and results
    are: (per block, the message index of each input wire in ``srcs`` order, -1 for its rank's own
    rows, None for a local block; {(block index, wire): message index})."""
    q_wires, kv_wires, results = PHASE_WIRES[phase]
    row_bytes = wire_bytes(shape)
    order = _WIRE_ORDER
    # (round, src, dst, wire order, start, stop, part, record index): the first 7 fields are unique
    # (inputs deduplicated, results numbered by part; a phase's input and result wires differ), so
    # sorting the keys sorts the records in the canonical order
    keys: list[tuple] = []
    recs: list[tuple[Wire, TokenRange]] = []
    inputs: dict[tuple, int] = {}
    parts: dict[tuple, int] = {}
    result_rec: list[tuple[tuple[int, Wire], int]] = []
    inputs_of: list[list[int] | None] = []
    for i, u in enumerate(units):
        r, k = u.rank, u.stage
        a, c = u.q_owner, u.kv_owner
        if r == a == c:  # local (``Unit.is_local``)
            inputs_of.append(None)
            continue
        got: list[int] = []
        for owner, toks, wires in ((a, u.q, q_wires), (c, u.kv, kv_wires)):
            if owner == r:
                got += [-1] * len(wires)
                continue
            lo, hi = toks.start, toks.stop
            for w in wires:
                key = (r, k, owner, w, lo, hi)
                j = inputs.get(key)
                if j is None:
                    j = inputs[key] = len(recs)
                    keys.append((k - 1, owner, r, order[w], lo, hi, 0, j))
                    recs.append((w, toks))
                got.append(j)
        inputs_of.append(got)
        for w in results:
            owner, toks = (c, u.kv) if w is Wire.DKV else (a, u.q)
            if owner == r:
                continue
            pkey = (k + 1, r, owner, w, toks.start, toks.stop)
            part = parts.get(pkey, 0)
            parts[pkey] = part + 1
            j = len(recs)
            keys.append((k + 1, r, owner, order[w], toks.start, toks.stop, part, j))
            recs.append((w, toks))
            result_rec.append(((i, w), j))
    keys.sort()
    pos = [0] * len(recs)
    msgs: list[Message] = []
    for new, key in enumerate(keys):
        j = key[7]
        pos[j] = new
        w, toks = recs[j]
        msgs.append(new_message(key[0], key[1], key[2], w, toks, row_bytes[w] * (key[5] - key[4]), key[6]))
    inputs_of = [None if got is None else [-1 if j < 0 else pos[j] for j in got] for got in inputs_of]
    result_at = {key: pos[j] for key, j in result_rec}
    return msgs, inputs_of, result_at


def _first_fit(requests: list[tuple[int, int, int, int]], capacity: int) -> tuple[dict[int, Slot], int]:
    """Allocate ``(t0, t1, nbytes, key)`` requests (closed event-step lifetimes) first-fit by
    offset, in order of start time: an entry dead before the current start can never overlap a
    later request, so the live list stays short. Returns ({key: slot}, peak bytes)."""
    slots: dict[int, Slot] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, t1), sorted by offset, disjoint
    peak = 0
    now = None  # the start time the live list was last pruned for
    # an upper bound of the widest free gap below the last live entry: a request wider than it
    # fits no gap, so first fit puts it at the end (exact after a prune or a scan to the end;
    # taking part of a gap only narrows the gaps)
    widest = 0
    for t0, t1, nbytes, key in sorted(requests, key=lambda r: (r[0], -r[2], r[3])):
        if t0 != now:  # requests come by start time and every t1 > t0: prune once per start time
            live = [e for e in live if e[2] >= t0]
            now = t0
            widest = _widest_gap(live)
        size = -(-nbytes // ALIGN) * ALIGN
        if size > widest:  # no gap fits: first fit is the end of the last live entry
            pos = len(live)
            off = live[-1][1] if live else 0
        else:
            off = 0
            pos = 0
            gaps = 0  # the widest gap passed so far
            for pos, (o, e, _) in enumerate(live):
                if off + size <= o:
                    break
                if o - off > gaps:
                    gaps = o - off
                if e > off:
                    off = e
            else:
                pos = len(live)
                widest = gaps  # scanned to the end: the bound is exact again
        if off + size > capacity:
            raise PoolOverflow(f"needs {off + size} bytes > capacity {capacity}")
        live.insert(pos, (off, off + size, t1))  # entries before pos end at or before off
        if off + size > peak:
            peak = off + size
        slots[key] = Slot(off, nbytes)
    return slots, peak


def _widest_gap(live: list[tuple[int, int, int]]) -> int:
    """The widest free byte range before some entry of ``live`` (sorted by offset, disjoint)."""
    widest, end = 0, 0
    for o, e, _ in live:
        if o - end > widest:
            widest = o - end
        end = e
    return widest


@dataclass(frozen=True, slots=True)
class PhaseCode:
    programs: tuple[Program, ...]
    messages: tuple[Message, ...]
    rounds: int  # S + 1 rounds (some possibly empty)
    pool_peak: tuple[int, ...]  # bytes per rank


def _live_peak(units: list[Unit], phase: Phase, size: int, shape: HeadShape, stages: int) -> list[int]:
    """A lower bound of each rank's slot peak in one phase, before any message is made: the most
    bytes live at one event step (``generate``'s lifetimes; inputs deduplicated as ``_messages``
    does, sizes unaligned). Slots live at once are disjoint, so first fit needs at least this."""
    q_wires, kv_wires, results = PHASE_WIRES[phase]
    row_bytes = wire_bytes(shape)
    steps = 2 * stages + 6
    delta = [[0] * steps for _ in range(size)]
    seen: set[tuple] = set()
    for u in units:
        r, k = u.rank, u.stage
        a, c = u.q_owner, u.kv_owner
        if r == a == c:
            continue
        d = delta[r]
        for owner, toks, wires in ((a, u.q, q_wires), (c, u.kv, kv_wires)):
            if owner == r:
                continue
            n = toks.stop - toks.start
            for w in wires:
                key = (r, k, owner, w, toks.start, toks.stop)
                if key not in seen:  # received in round k - 1 (clipped at step 0: a subset)
                    seen.add(key)
                    d[max(2 * k - 2, 0)] += row_bytes[w] * n
                    d[2 * k - 2 + _INPUT_SPAN + 1] -= row_bytes[w] * n
        for w in results:
            owner, toks = (c, u.kv) if w is Wire.DKV else (a, u.q)
            if owner == r:
                continue
            b = row_bytes[w] * (toks.stop - toks.start)
            d[2 * k] += b  # its slot here
            d[2 * k + _RESULT_SPAN + 1] -= b
            e = delta[owner]  # received in round k + 1
            e[2 * k + 2] += b
            e[2 * k + 2 + _RECEIVED_SPAN + 1] -= b
    out = []
    for d in delta:
        live = peak = 0
        for x in d:
            live += x
            if live > peak:
                peak = live
        out.append(peak)
    return out


def phase_rounds(units: list[Unit]) -> int:
    """Rounds of one phase of ``units``' code (``PhaseCode.rounds``): one per stage and the tail."""
    return 2 + max((u.stage for u in units), default=0)


def generate(units: list[Unit], phase: Phase, size: int, shape: HeadShape, capacity: int, round_base: int) -> PhaseCode:
    """Emit every rank's program for one phase. Raises ``PoolOverflow`` when slots do not fit.

    Slot lifetimes in event steps (``post k`` = 2k, ``wait k`` = 2k + 1): an input received in
    round k (for stage k + 1) lives [2k, 2k + 3]; a result computed at stage k lives [2k, 2k + 3]
    (sent in round k + 1); a result received in round k lives [2k, 2k + 1] (merged after the wait).
    Blocks should come sorted by (rank, stage, ...): that is the order of each stage's items.
    """
    stages = phase_rounds(units) - 1
    # most overflowing stagings overflow outright (more bytes live at one step than the pool
    # holds: all 179 overflows of the 809 builds of the 167 benchmark batches, 10 of 10 for one
    # 1M-token document at 8x64); telling them from the staging skips their messages and slot fit
    bound = max(_live_peak(units, phase, size, shape, stages), default=0)
    if bound > capacity:
        raise PoolOverflow(f"{bound} bytes live at once > capacity {capacity}")
    msgs, inputs_of, result_at = _messages(units, phase, shape)
    q_wires, kv_wires, results = PHASE_WIRES[phase]
    row_bytes = wire_bytes(shape)
    requests: list[list[tuple[int, int, int, int]]] = [[] for _ in range(size)]
    for idx, m in enumerate(msgs):
        k = m.round
        requests[m.dst].append((2 * k, 2 * k + (_RECEIVED_SPAN if m.wire in results else _INPUT_SPAN), m.nbytes, idx))
    n_msgs = len(msgs)
    out_at: dict[tuple[int, Wire], int] = {}  # (block, wire) -> request key of its result slot
    for (i, w) in result_at:
        u = units[i]
        toks = u.kv if w is Wire.DKV else u.q
        key = n_msgs + len(out_at)
        out_at[(i, w)] = key
        requests[u.rank].append((2 * u.stage, 2 * u.stage + _RESULT_SPAN, row_bytes[w] * (toks.stop - toks.start), key))
    slot_of: dict[int, Slot] = {}
    peaks = []
    for r in range(size):
        got, peak = _first_fit(requests[r], capacity)
        slot_of.update(got)
        peaks.append(peak)
    items: dict[tuple[int, int], list[ComputeItem]] = {}
    in_wires = q_wires + kv_wires
    local_srcs = tuple((w, None) for w in in_wires)
    local_dsts = tuple((w, None) for w in results)
    for i, u in enumerate(units):
        rk = (u.rank, u.stage)
        its = items.get(rk)
        if its is None:
            its = items[rk] = []
        got = inputs_of[i]
        if got is None:  # local: every input and result in the rank's own tensors
            its.append(new_compute_item(u.q, u.kv, u.causal, local_srcs, local_dsts, u.window))
            continue
        srcs = tuple([(w, None if j < 0 else slot_of[j]) for w, j in zip(in_wires, got)])
        dsts = tuple([(w, slot_of[out_at[(i, w)]] if (i, w) in out_at else None) for w in results])
        its.append(new_compute_item(u.q, u.kv, u.causal, srcs, dsts, u.window))
    src_of_result = {result_at[key]: slot_of[out_key] for key, out_key in out_at.items()}
    ops: dict[tuple[int, int], list[Send | Recv]] = defaultdict(list)
    after: dict[tuple[int, int], list[Instr]] = defaultdict(list)
    lse_of: dict[tuple, Slot] = {}
    for idx, m in enumerate(msgs):
        if m.wire is Wire.LSE and phase is Phase.FWD:
            lse_of[(m.dst, m.round, m.src, m.tokens.start, m.tokens.stop, m.part)] = slot_of[idx]
    for idx, m in enumerate(msgs):
        k = m.round
        dst = slot_of[idx]
        ops[(m.src, k)].append(new_send(m.wire, m.tokens, m.dst, m.nbytes, src_of_result.get(idx)))
        ops[(m.dst, k)].append(new_recv(m.wire, m.tokens, m.src, m.nbytes, dst))
        if m.wire is Wire.O:
            after[(m.dst, k)].append(Merge(m.tokens, dst, lse_of[(m.dst, k, m.src, m.tokens.start, m.tokens.stop, m.part)]))
        elif m.wire is Wire.DQ or m.wire is Wire.DKV:
            after[(m.dst, k)].append(Accumulate(m.wire, m.tokens, dst))
    programs = []
    for r in range(size):
        instrs: list[Instr] = []
        for k in range(stages + 1):
            rops = ops.get((r, k))
            if rops:
                instrs.append(Post(Round(round_base + k, tuple(rops))))
            its = items.get((r, k))
            if its:
                instrs.append(Compute(k, tuple(its)))
            if rops:
                instrs.append(Wait(round_base + k))
            instrs.extend(after.get((r, k), ()))
        programs.append(Program(rank=r, phase=phase, instrs=tuple(instrs)))
    return PhaseCode(programs=tuple(programs), messages=tuple(msgs), rounds=stages + 1, pool_peak=tuple(peaks))

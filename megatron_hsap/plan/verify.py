"""The verifier (docs/design.md §2.1 step 5): a symbolic interpreter that runs every rank's programs
together and proves the plan correct, or raises ``PlanError`` naming the first violation.

It proves, per phase:

* **rounds match**: in every round, the ordered list of ``a``'s sends to ``b`` equals ``b``'s
  receives from ``a`` (wire, tokens, bytes) — an asymmetric batch would hang NCCL;
* **data present**: every operand read from a slot is exactly the datum the plan names and has
  arrived (its round was waited); local operands are rows the rank owns; no slot is written while a
  send from it or a receive into it is in flight, and an overwritten datum is reported when read;
* **pool bounds**: every slot lies inside the configured capacity;
* **coverage**: the compute items tile each document's causal mask — or, under a sliding window,
  its banded mask — exactly once (no pair twice, none missing, none across documents);
* **delivery**: every partial result (o/lse forward, dq and dkv backward) reaches its owner's
  accumulators exactly once;
* **program order** (what the executor runs): rounds posted and waited alternately, in order; the
  compute of stage s after the wait of round s − 1 and inside round s when the rank has one;
  merges and accumulates only after the wait of the round that brought their data.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsap.errors import PlanError
from megatron_hsap.plan.ir import PHASE_WIRES, Accumulate, Compute, ComputeItem, Merge, Phase, Post, Program, Send, Slot, TokenRange, Wait, Wire

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["verify_plan", "check_coverage"]



class _Pool:
    """Symbolic contents of one rank's pool. Entries are disjoint byte ranges (so at most one per
    offset), kept sorted by offset: ``entries[(offset, nbytes)] = [datum, state, who]`` with state
    pending (receive in flight), sending (send in flight), ready or sent."""

    def __init__(self, rank: int, capacity: int) -> None:
        self.rank, self.capacity = rank, capacity
        self.offsets: list[int] = []  # sorted
        self.size_at: dict[int, int] = {}  # offset -> nbytes
        self.entries: dict[tuple[int, int], list] = {}
        self.graves: dict[tuple[int, int], str] = {}
        self.in_flight: set[tuple[int, int]] = set()

    def _check_bounds(self, slot: Slot, what: str) -> None:
        if slot.offset < 0 or slot.end > self.capacity:
            raise PlanError(f"rank {self.rank}: {what} uses {slot} outside the pool capacity {self.capacity}")

    def _overlapping(self, slot: Slot) -> list[tuple[int, int]]:
        i = max(bisect.bisect_left(self.offsets, slot.offset) - 1, 0)  # the one before may reach in
        out = []
        while i < len(self.offsets) and self.offsets[i] < slot.end:
            off = self.offsets[i]
            if off + self.size_at[off] > slot.offset:
                out.append((off, self.size_at[off]))
            i += 1
        return out

    def write(self, slot: Slot, datum: tuple, state: str, what: str) -> None:
        self._check_bounds(slot, what)
        for key in self._overlapping(slot):
            old, st, who = self.entries[key]
            if st in ("pending", "sending"):
                raise PlanError(
                    f"rank {self.rank}: {what} writes {slot} while {who} ({st}) still uses $pool[{key[0]}:+{key[1]}] — slot reused while live"
                )
            self._remove(key)
            self.graves[key] = f"{_fmt(old)} overwritten by {what}"
        key = (slot.offset, slot.nbytes)
        self.entries[key] = [datum, state, what]
        bisect.insort(self.offsets, slot.offset)
        self.size_at[slot.offset] = slot.nbytes
        if state in ("pending", "sending"):
            self.in_flight.add(key)

    def _remove(self, key: tuple[int, int]) -> None:
        del self.entries[key]
        self.offsets.pop(bisect.bisect_left(self.offsets, key[0]))
        del self.size_at[key[0]]
        self.in_flight.discard(key)

    def read(self, slot: Slot, datum: tuple, what: str) -> list:
        self._check_bounds(slot, what)
        entry = self.entries.get((slot.offset, slot.nbytes))
        if entry is None:
            why = self.graves.get((slot.offset, slot.nbytes), "never written")
            raise PlanError(f"rank {self.rank}: {what} reads {slot} expecting {_fmt(datum)}, but it holds nothing ({why})")
        if entry[1] == "pending":
            raise PlanError(f"rank {self.rank}: {what} reads {slot} before its receive ({entry[2]}) was waited")
        if entry[0][:2] != datum[:2]:
            raise PlanError(f"rank {self.rank}: {what} reads {slot} expecting {_fmt(datum)}, found {_fmt(entry[0])}")
        return entry

    def mark_sending(self, slot: Slot, what: str) -> None:
        key = (slot.offset, slot.nbytes)
        entry = self.entries[key]
        entry[1], entry[2] = "sending", what
        self.in_flight.add(key)

    def complete(self) -> None:
        """The open round was waited: receives arrived, sends finished."""
        for key in self.in_flight:
            entry = self.entries[key]
            entry[1] = "ready" if entry[1] == "pending" else "sent"
        self.in_flight.clear()


def _fmt(datum: tuple) -> str:
    return f"{datum[0].value}{datum[1]}"


class _Owner:
    """Which rows each inter rank holds (its layout segments), answered by bisection."""

    def __init__(self, plan: "Plan") -> None:
        self.segs = [sorted((s.tokens.start, s.tokens.stop) for s in segs) for segs in plan.layout.segments]
        self.starts = [[a for a, _ in segs] for segs in self.segs]
        self.owner, _ = plan.layout.owner_array(plan.padded_tokens)

    def owns(self, rank: int, rng: TokenRange) -> bool:
        i = bisect.bisect_right(self.starts[rank], rng.start) - 1
        return i >= 0 and self.segs[rank][i][1] >= rng.stop

    def of(self, token: int) -> int:
        return int(self.owner[token])


def _structure(prog: Program, base: int) -> dict[int, dict]:
    """Group a program by round/stage ``k`` (global round index): {k: {post, compute, after}}.
    Checks the program order the executor relies on: rounds posted and waited alternately; the
    compute of stage s after the wait of round s − 1 and, if round s exists here, between its post
    and its wait; merges and accumulates after a wait (applied with that round)."""
    steps: dict[int, dict] = defaultdict(lambda: {"post": None, "compute": None, "after": [], "waited": False})
    open_round: int | None = None
    last_wait: int | None = None
    last_stage = -1
    for pos, ins in enumerate(prog.instrs):
        where = f"rank {prog.rank} {prog.phase.value} instr {pos}"
        if isinstance(ins, Post):
            k = ins.round.index
            if open_round is not None:
                raise PlanError(f"{where}: round {k} posted while round {open_round} is not waited")
            if steps[k]["post"] is not None:
                raise PlanError(f"{where}: round {k} posted twice")
            if last_wait is not None and k <= last_wait:
                raise PlanError(f"{where}: round {k} posted after round {last_wait} was waited")
            if last_stage >= k - base:
                raise PlanError(f"{where}: round {k} posted after stage {last_stage} was computed (it feeds stage {k - base + 1})")
            open_round = k
            steps[k]["post"] = ins.round
        elif isinstance(ins, Wait):
            if open_round != ins.index:
                raise PlanError(f"{where}: waits round {ins.index} but the open round is {open_round}")
            steps[ins.index]["waited"] = True
            open_round, last_wait = None, ins.index
        elif isinstance(ins, Compute):
            k = base + ins.stage
            if ins.stage <= last_stage:
                raise PlanError(f"{where}: stage {ins.stage} after stage {last_stage}")
            if last_wait is not None and last_wait >= k:
                raise PlanError(f"{where}: stage {ins.stage} computed after round {last_wait} was waited")
            if open_round is not None and open_round != k:
                raise PlanError(f"{where}: stage {ins.stage} computed while round {open_round} is open")
            last_stage = ins.stage
            steps[k]["compute"] = ins
        elif isinstance(ins, (Merge, Accumulate)):
            if last_wait is None or open_round is not None:
                raise PlanError(f"{where}: {type(ins).__name__} of {ins.tokens} before its round was waited")
            steps[last_wait]["after"].append(ins)
        else:
            raise PlanError(f"{where}: unknown instruction {type(ins).__name__}")
    if open_round is not None:
        raise PlanError(f"rank {prog.rank} {prog.phase.value}: round {open_round} posted but never waited")
    return steps


def verify_plan(plan: "Plan") -> None:
    owner = _Owner(plan)
    size = plan.inter_size
    for phase, progs in ((Phase.FWD, plan.fwd_programs), (Phase.BWD, plan.bwd_programs)):
        if len(progs) != size:
            raise PlanError(f"{phase.value}: {len(progs)} programs for {size} inter ranks")
        for r, prog in enumerate(progs):
            if prog.rank != r or prog.phase is not phase:
                raise PlanError(f"{phase.value}: program {r} is rank {prog.rank}'s {prog.phase.value} program")
        _verify_phase(plan, phase, progs, owner)


def _op_str(k: int, op) -> str:
    kind = "send" if isinstance(op, Send) else "recv"
    return f"round {k} {kind} {op.wire.value}{op.tokens} peer {op.peer}"


def _verify_phase(plan: "Plan", phase: Phase, progs, owner: _Owner) -> None:
    size = plan.inter_size
    row_bytes = {w: plan.shape.token_bytes(w) for w in Wire}
    base = plan.round_base[phase]
    structs = [_structure(p, base) for p in progs]
    pools = [_Pool(r, plan.pool_capacity) for r in range(size)]
    delivered: dict[tuple, int] = defaultdict(int)  # (item tag, wire) -> deliveries
    expected: list[tuple] = []
    items_all: list[ComputeItem] = []
    results = PHASE_WIRES[phase].results
    inputs = set(PHASE_WIRES[phase].inputs)
    for k in sorted({k for st in structs for k in st}):
        s = k - base
        if s < 0:
            raise PlanError(f"{phase.value}: round {k} precedes the phase's first round {base}")
        # 1. posts: match rounds pairwise, read send sources, mark receive slots pending.
        msgs: dict[tuple[int, int], list] = defaultdict(list)
        recvs: dict[tuple[int, int], list] = defaultdict(list)
        for r in range(size):
            rnd = structs[r][k]["post"] if k in structs[r] else None
            if rnd is None:
                continue
            if rnd.index != k:
                raise PlanError(f"rank {r}: round {rnd.index} filed under {k}")
            for op in rnd.ops:
                if not 0 <= op.peer < size or op.peer == r:
                    raise PlanError(f"rank {r}: {_op_str(k, op)}: bad peer")
                if op.nbytes != row_bytes[op.wire] * len(op.tokens):
                    raise PlanError(f"rank {r}: {_op_str(k, op)}: {op.nbytes} bytes, expected {row_bytes[op.wire] * len(op.tokens)}")
                if isinstance(op, Send):
                    if op.src is None:
                        if op.wire in results:
                            raise PlanError(f"rank {r}: {_op_str(k, op)}: a partial result must be sent from the slot it was computed into")
                        if not owner.owns(r, op.tokens):
                            raise PlanError(f"rank {r}: {_op_str(k, op)}: sends rows it does not own")
                        datum = (op.wire, op.tokens, None)
                    else:
                        entry = pools[r].read(op.src, (op.wire, op.tokens), _op_str(k, op))
                        datum = entry[0]
                        pools[r].mark_sending(op.src, _op_str(k, op))
                    msgs[(r, op.peer)].append((op.wire, op.tokens, op.nbytes, datum))
                else:
                    if op.dst.nbytes != op.nbytes:
                        raise PlanError(f"rank {r}: {_op_str(k, op)}: slot {op.dst} holds {op.dst.nbytes} bytes, message has {op.nbytes}")
                    recvs[(op.peer, r)].append(op)
        for pair in set(msgs) | set(recvs):
            sent = [m[:3] for m in msgs.get(pair, [])]
            got = [(op.wire, op.tokens, op.nbytes) for op in recvs.get(pair, [])]
            if sent != got:
                raise PlanError(
                    f"round {k}: rank {pair[0]} sends {[(w.value, str(t)) for w, t, _ in sent]} to rank {pair[1]}, "
                    f"which receives {[(w.value, str(t)) for w, t, _ in got]} — unmatched batch (would hang)"
                )
            for m, op in zip(msgs.get(pair, []), recvs.get(pair, [])):
                pools[pair[1]].write(op.dst, m[3], "pending", f"round {k} recv {op.wire.value}{op.tokens} from {pair[0]}")
        # 2. computes of stage s.
        for r in range(size):
            comp = structs[r][k]["compute"] if k in structs[r] else None
            if comp is None:
                continue
            for it in comp.items:
                tag = (r, s, id(it))
                items_all.append(it)
                in_wires, out_wires = {w for w, _ in it.srcs}, {w for w, _ in it.dsts}
                if in_wires != inputs or len(in_wires) != len(it.srcs):
                    raise PlanError(f"rank {r}: {phase.value} stage {s} item q{it.q} kv{it.kv}: inputs "
                                    f"{sorted(w.value for w in in_wires)} are not the {phase.value} inputs")
                for w, slot in it.srcs:
                    rows = it.kv if w is Wire.KV else it.q
                    if slot is None:
                        if not owner.owns(r, rows):
                            raise PlanError(f"rank {r}: {phase.value} stage {s} item q{it.q} kv{it.kv}: reads local {w.value}{rows} it does not own")
                    else:
                        pools[r].read(slot, (w, rows), f"{phase.value} stage {s} item q{it.q} kv{it.kv}")
                if out_wires != set(results) or len(out_wires) != len(it.dsts):
                    raise PlanError(f"rank {r}: {phase.value} stage {s} item q{it.q} kv{it.kv}: outputs "
                                    f"{sorted(w.value for w in out_wires)} are not the {phase.value} results")
                for w in results:
                    rows = it.kv if w is Wire.DKV else it.q
                    expected.append((tag, w))
                    if it.dst(w) is None:
                        if not owner.owns(r, rows):
                            raise PlanError(f"rank {r}: {phase.value} stage {s} item q{it.q} kv{it.kv}: accumulates "
                                            f"{w.value}{rows} locally but does not own those rows")
                        delivered[(tag, w)] += 1
                    else:
                        if owner.of(rows.start) == r:
                            raise PlanError(f"rank {r}: {phase.value} stage {s} item q{it.q} kv{it.kv}: routes its own {w.value}{rows} through the pool")
                        pools[r].write(it.dst(w), (w, rows, tag), "ready", f"{phase.value} stage {s} item q{it.q} kv{it.kv}")
        # 3. waits: receives of round k arrive.
        for r in range(size):
            if k in structs[r] and structs[r][k]["post"] is not None:
                if not structs[r][k]["waited"]:
                    raise PlanError(f"rank {r}: round {k} never waited")
                pools[r].complete()
        # 4. merges / accumulates after the wait.
        for r in range(size):
            if k in structs[r]:
                for ins in structs[r][k]["after"]:
                    _apply_after(ins, r, k, phase, pools[r], owner, delivered)
    for tag, w in expected:
        n = delivered.get((tag, w), 0)
        if n != 1:
            raise PlanError(f"{phase.value}: result {w.value} of rank {tag[0]} stage {tag[1]} delivered {n} times (expected once)")
    if len(delivered) != len(expected):
        raise PlanError(f"{phase.value}: {len(delivered) - len(expected)} deliveries of results no item produced")
    check_coverage(plan, items_all, phase)


def _apply_after(ins, r: int, k: int, phase: Phase, pool: _Pool, owner: _Owner, delivered: dict) -> None:
    if isinstance(ins, Merge):
        if phase is not Phase.FWD:
            raise PlanError(f"rank {r}: Merge in backward")
        o = pool.read(ins.o, (Wire.O, ins.tokens), f"merge after round {k}")
        lse = pool.read(ins.lse, (Wire.LSE, ins.tokens), f"merge after round {k}")
        if o[0][2] is None or o[0][2] != lse[0][2]:
            raise PlanError(f"rank {r}: merge after round {k} pairs o and lse of different blocks")
        if not owner.owns(r, ins.tokens):
            raise PlanError(f"rank {r}: merges rows {ins.tokens} it does not own")
        delivered[(o[0][2], Wire.O)] += 1
        delivered[(o[0][2], Wire.LSE)] += 1
    elif isinstance(ins, Accumulate):
        if phase is not Phase.BWD or ins.wire not in PHASE_WIRES[Phase.BWD].results:
            raise PlanError(f"rank {r}: bad Accumulate {ins.wire.value} in {phase.value}")
        got = pool.read(ins.src, (ins.wire, ins.tokens), f"accumulate after round {k}")
        if got[0][2] is None:
            raise PlanError(f"rank {r}: accumulate after round {k} reads a datum that is not a partial result")
        if not owner.owns(r, ins.tokens):
            raise PlanError(f"rank {r}: accumulates rows {ins.tokens} it does not own")
        delivered[(got[0][2], ins.wire)] += 1
    else:
        raise PlanError(f"rank {r}: unexpected {type(ins).__name__} after round {k}")


def check_coverage(plan: "Plan", items: list[ComputeItem], phase: Phase | str = Phase.FWD) -> None:
    """The items tile every document's causal mask exactly once: no pair twice, none missing, none
    across documents. Exact, by a sweep over q rows (O(items log items)).

    Per document with first token ``d``: every row lies in exactly one causal item (rows ``[x, y)``,
    keys ``[a, y)``), which covers keys ``[a, x)`` as a rectangle and the diagonal triangle; the
    rectangles (those parts and the dense items) active on a row must tile ``[d, x)``. With
    distinct starts, every start equal to ``d`` or to another active stop, and total length
    ``x − d``, the active spans form one chain from ``d`` to ``x`` — an exact tiling."""
    name = Phase(phase).value
    starts = plan.batch.doc_starts
    by_doc: dict[int, list[ComputeItem]] = defaultdict(list)
    total = 0
    for it in items:
        d = int(np.searchsorted(starts, it.q.start, side="right") - 1)
        lo, hi = int(starts[d]), int(starts[d + 1])
        if not (lo <= it.kv.start and it.kv.stop <= hi and it.q.stop <= hi):
            raise PlanError(f"{name}: item q{it.q} kv{it.kv} crosses a document boundary")
        by_doc[d].append(it)
        total += it.work
    if total != plan.batch.total_work(plan.options.window):
        raise PlanError(f"{name}: items cover {total} pairs, the batch has {plan.batch.total_work(plan.options.window)}")
    left = plan.options.window
    for d in range(plan.batch.num_docs):
        if left < 0:
            _check_doc(d, int(starts[d]), int(starts[d + 1]), by_doc.get(d, []), name)
        else:
            _check_doc_banded(d, int(starts[d]), int(starts[d + 1]), by_doc.get(d, []), name, left)


def _check_doc_banded(d: int, lo: int, hi: int, its: list[ComputeItem], name: str, left: int) -> None:
    """Exact coverage of the banded mask ``i - left <= j <= i`` (``plan/window.py``): each item's
    banded pairs lie in the band by construction and their count is the item's work, so with the
    total equal to the band's (checked by the caller) it suffices that the items' blocks are
    pairwise disjoint — swept over q rows: on every row exactly one causal item (the pair (i, i)),
    and the active spans (rectangles ``[a, b)``, the causal item ``[a, row]``) do not overlap.
    Each item must also carry the plan's window and be clipped to it (every row and every key takes
    part in a pair: no byte moves for keys beyond the window, no row leaves the kernel empty)."""
    events: list[tuple[int, int, int]] = []
    for n, it in enumerate(its):
        if it.window != left:
            raise PlanError(f"{name}: item q{it.q} kv{it.kv} has window {it.window}, the plan's is {left}")
        if it.kv.start < it.q.start - left:
            raise PlanError(f"{name}: item q{it.q} kv{it.kv} holds keys older than every row's window of {left}")
        if not it.causal and it.q.stop - it.kv.stop > left:
            raise PlanError(f"{name}: item q{it.q} kv{it.kv} has rows that see no key inside the window of {left}")
        events.append((it.q.start, 1, n))
        events.append((it.q.stop, -1, n))
    events.sort()  # removals (-1) before additions at the same row
    active: set[int] = set()
    row, i = lo, 0
    while row < hi:
        while i < len(events) and events[i][0] <= row:
            _, sign, n = events[i]
            i += 1
            (active.add if sign > 0 else active.discard)(n)
        nxt = min(events[i][0] if i < len(events) else hi, hi)
        diag = [its[n] for n in active if its[n].causal]
        if len(diag) != 1:
            raise PlanError(f"{name}: rows [{row}:{nxt}) of document {d} have {len(diag)} diagonal blocks (expected 1)")
        spans = sorted((its[n].kv.start, its[n].kv.stop if not its[n].causal else hi) for n in active)
        for (a0, b0), (a1, _) in zip(spans, spans[1:]):
            if a1 < b0:
                raise PlanError(f"{name}: rows [{row}:{nxt}) of document {d}: keys [{a1}:{b0}) are computed twice")
        row = nxt


def _check_doc(d: int, lo: int, hi: int, its: list[ComputeItem], name: str) -> None:
    # events: (row, +1 add / -1 remove, span start, span stop, causal, x)
    events: list[tuple[int, int, int, int, bool, int]] = []
    for it in its:
        x = it.q.start if it.causal else it.kv.stop
        a = it.kv.start
        events.append((it.q.start, 1, a, x, it.causal, it.q.start))
        events.append((it.q.stop, -1, a, x, it.causal, it.q.start))
    events.sort(key=lambda e: (e[0], e[1]))  # removals before additions at the same row
    count_start: dict[int, int] = defaultdict(int)
    count_stop: dict[int, int] = defaultdict(int)
    dup = unlinked = 0
    length = 0
    causal: dict[int, int] = {}  # active causal items by x (their q start)
    row = lo
    i = 0
    while row < hi:
        while i < len(events) and events[i][0] <= row:
            _, sign, a, b, is_causal, x = events[i]
            i += 1
            if is_causal:
                causal[x] = causal.get(x, 0) + sign
                if not causal[x]:
                    del causal[x]
            if a == b:  # a causal item starting at its own first key: no rectangle part
                continue
            if sign > 0:
                count_start[a] += 1
                dup += count_start[a] == 2
                unlinked += a != lo and count_stop[a] == 0
                count_stop[b] += 1
                if count_stop[b] == 1 and b != lo:
                    unlinked -= count_start[b]
                length += b - a
            else:
                count_start[a] -= 1
                dup -= count_start[a] == 1
                unlinked -= a != lo and count_stop[a] == 0
                count_stop[b] -= 1
                if count_stop[b] == 0 and b != lo:
                    unlinked += count_start[b]
                length -= b - a
        nxt = events[i][0] if i < len(events) else hi
        nxt = min(nxt, hi)
        if len(causal) != 1 or next(iter(causal.values())) != 1:
            raise PlanError(f"{name}: rows [{row}:{nxt}) of document {d} have {sum(causal.values())} diagonal blocks (expected 1)")
        x = next(iter(causal))
        if dup or unlinked or length != x - lo:
            kind = "twice" if dup or length > x - lo else "never"
            raise PlanError(f"{name}: rows [{row}:{nxt}) of document {d}: some keys before {x} are computed {kind}")
        row = nxt

"""The verifier (DESIGN §2.1 step 5): a symbolic interpreter that runs every rank's programs
together and proves the plan correct, or raises ``PlanError`` naming the first violation.

It proves, per phase:

* **rounds match**: in every round, the ordered list of ``a``'s sends to ``b`` equals ``b``'s
  receives from ``a`` (wire, tokens, bytes) — an asymmetric batch would hang NCCL;
* **data present**: every operand read from a slot is exactly the datum the plan names and has
  arrived (its round was waited); local operands are rows the rank owns; no slot is written while a
  send from it or a receive into it is in flight, and an overwritten datum is reported when read;
* **pool bounds**: every slot lies inside the configured capacity;
* **coverage**: the compute items tile each document's causal mask exactly once (no pair twice,
  none missing, none across documents);
* **delivery**: every partial result (o/lse forward, dq and dkv backward) reaches its owner's
  accumulators exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsap.errors import PlanError
from megatron_hsap.plan.ir import Accumulate, Compute, ComputeItem, Merge, Phase, Post, Program, Recv, Send, Slot, TokenRange, Wait, Wire

if TYPE_CHECKING:
    from megatron_hsap.plan.plan import Plan

__all__ = ["verify_plan", "check_coverage"]

_RESULTS = {Phase.FWD: (Wire.O, Wire.LSE), Phase.BWD: (Wire.DQ, Wire.DKV)}


class _Pool:
    """Symbolic contents of one rank's pool: (offset, nbytes) -> (datum, state)."""

    def __init__(self, rank: int, capacity: int) -> None:
        self.rank, self.capacity = rank, capacity
        self.entries: dict[tuple[int, int], list] = {}  # key -> [datum, state, who]
        self.graves: dict[tuple[int, int], str] = {}

    def _check_bounds(self, slot: Slot, what: str) -> None:
        if slot.offset < 0 or slot.end > self.capacity:
            raise PlanError(f"rank {self.rank}: {what} uses {slot} outside the pool capacity {self.capacity}")

    def write(self, slot: Slot, datum: tuple, state: str, what: str) -> None:
        self._check_bounds(slot, what)
        for key, (old, st, who) in list(self.entries.items()):
            if key[0] < slot.end and slot.offset < key[0] + key[1]:
                if st in ("pending", "sending"):
                    raise PlanError(
                        f"rank {self.rank}: {what} writes {slot} while {who} ({st}) still uses $pool[{key[0]}:+{key[1]}] — slot reused while live"
                    )
                del self.entries[key]
                self.graves[key] = f"{_fmt(old)} overwritten by {what}"
        self.entries[(slot.offset, slot.nbytes)] = [datum, state, what]

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


def _fmt(datum: tuple) -> str:
    return f"{datum[0].value}{datum[1]}"


def _structure(prog: Program) -> dict[int, dict]:
    """Group a program by step k: {k: {post, compute, wait, after}}; checks the shape."""
    steps: dict[int, dict] = defaultdict(lambda: {"post": None, "compute": None, "wait": False, "after": []})
    open_round: int | None = None
    last_k = -1
    cur = None
    for pos, ins in enumerate(prog.instrs):
        where = f"rank {prog.rank} {prog.phase.value} instr {pos}"
        if isinstance(ins, Post):
            if open_round is not None:
                raise PlanError(f"{where}: round {ins.round.index} posted while round {open_round} is not waited")
            open_round = ins.round.index
            cur = ins.round.index
            steps[cur]["post"] = ins.round
        elif isinstance(ins, Wait):
            if open_round != ins.index:
                raise PlanError(f"{where}: waits round {ins.index} but the open round is {open_round}")
            steps[ins.index]["wait"] = True
            open_round = None
        elif isinstance(ins, Compute):
            if ins.stage < last_k:
                raise PlanError(f"{where}: stage {ins.stage} after stage {last_k}")
            last_k = ins.stage
            cur = ("stage", ins.stage)
            steps[("stage", ins.stage)]["compute"] = ins
        else:
            if cur is None:
                raise PlanError(f"{where}: {type(ins).__name__} before any round")
            steps[cur]["after"].append(ins)
    if open_round is not None:
        raise PlanError(f"rank {prog.rank} {prog.phase.value}: round {open_round} posted but never waited")
    return steps


def _owned(owner: np.ndarray, rank: int, rng: TokenRange) -> bool:
    return bool((owner[rng.start : rng.stop] == rank).all())


def verify_plan(plan: "Plan") -> None:
    owner, _ = plan.layout.owner_array(plan.padded_tokens)
    size = plan.inter_size
    for phase, progs in ((Phase.FWD, plan.fwd_programs), (Phase.BWD, plan.bwd_programs)):
        if len(progs) != size:
            raise PlanError(f"{phase.value}: {len(progs)} programs for {size} inter ranks")
        _verify_phase(plan, phase, progs, owner)


def _verify_phase(plan: "Plan", phase: Phase, progs, owner: np.ndarray) -> None:
    size = plan.inter_size
    shape = plan.shape
    base = plan.round_base[phase]
    structs = [_structure(p) for p in progs]
    rounds = sorted({k for s in structs for k in s if isinstance(k, int)})
    stages = sorted({k[1] for s in structs for k in s if isinstance(k, tuple)})
    pools = [_Pool(r, plan.pool_capacity) for r in range(size)]
    delivered: dict[tuple, int] = defaultdict(int)  # (item id, wire) -> deliveries
    expected: list[tuple] = []
    items_all: list[ComputeItem] = []
    q_in = (Wire.Q,) if phase is Phase.FWD else (Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA)
    for k in sorted(set(rounds) | {base + s for s in stages}):
        s = k - base
        # 1. posts: match rounds pairwise, read send sources, mark receive slots pending.
        msgs: dict[tuple[int, int], list] = defaultdict(list)
        recvs: dict[tuple[int, int], list] = defaultdict(list)
        for r in range(size):
            rnd = structs[r][k]["post"] if k in structs[r] else None
            if rnd is None:
                continue
            for op in rnd.ops:
                what = f"round {k} {'send' if isinstance(op, Send) else 'recv'} {op.wire.value}{op.tokens} peer {op.peer}"
                if not 0 <= op.peer < size or op.peer == r:
                    raise PlanError(f"rank {r}: {what}: bad peer")
                if op.nbytes != shape.nbytes(op.wire, len(op.tokens)):
                    raise PlanError(f"rank {r}: {what}: {op.nbytes} bytes, expected {shape.nbytes(op.wire, len(op.tokens))}")
                if isinstance(op, Send):
                    if op.src is None:
                        rows = op.tokens
                        if op.wire in _RESULTS[phase] and not (phase is Phase.BWD and op.wire is Wire.LSE):
                            raise PlanError(f"rank {r}: {what}: a partial result must be sent from the slot it was computed into")
                        if not _owned(owner, r, rows):
                            raise PlanError(f"rank {r}: {what}: sends rows it does not own")
                        datum = (op.wire, op.tokens, None)
                    else:
                        entry = pools[r].read(op.src, (op.wire, op.tokens), what)
                        datum = entry[0]
                        entry[1], entry[2] = "sending", what
                    msgs[(r, op.peer)].append((op.wire, op.tokens, op.nbytes, datum))
                else:
                    if op.dst.nbytes != op.nbytes:
                        raise PlanError(f"rank {r}: {what}: slot {op.dst} holds {op.dst.nbytes} bytes, message has {op.nbytes}")
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
            comp = structs[r].get(("stage", s), {}).get("compute") if ("stage", s) in structs[r] else None
            if comp is None:
                continue
            for it in comp.items:
                tag = (r, s, id(it))
                items_all.append(it)
                what = f"{phase.value} stage {s} item q{it.q} kv{it.kv}"
                srcs, dsts = dict(it.srcs), dict(it.dsts)
                if set(srcs) != set(q_in) | {Wire.KV}:
                    raise PlanError(f"rank {r}: {what}: inputs {sorted(w.value for w in srcs)} are not the {phase.value} inputs")
                for w, slot in srcs.items():
                    rows = it.kv if w is Wire.KV else it.q
                    if slot is None:
                        if not _owned(owner, r, rows):
                            raise PlanError(f"rank {r}: {what}: reads local {w.value}{rows} it does not own")
                    else:
                        pools[r].read(slot, (w, rows), what)
                for w in _RESULTS[phase]:
                    if w not in dsts:
                        raise PlanError(f"rank {r}: {what}: no destination for {w.value}")
                    rows = it.kv if w is Wire.DKV else it.q
                    home = int(owner[rows.start])
                    expected.append((tag, w))
                    if dsts[w] is None:
                        if not _owned(owner, r, rows):
                            raise PlanError(f"rank {r}: {what}: accumulates {w.value}{rows} locally but does not own those rows")
                        delivered[(tag, w)] += 1
                    else:
                        if home == r:
                            raise PlanError(f"rank {r}: {what}: routes its own {w.value}{rows} through the pool")
                        pools[r].write(dsts[w], (w, rows, tag), "ready", what)
        # 3. waits: receives of round k arrive.
        for r in range(size):
            if k in structs[r] and structs[r][k]["post"] is not None:
                if not structs[r][k]["wait"]:
                    raise PlanError(f"rank {r}: round {k} never waited")
                for entry in pools[r].entries.values():
                    if entry[1] in ("pending", "sending"):
                        entry[1] = "ready" if entry[1] == "pending" else "sent"
        # 4. merges / accumulates after the wait.
        for r in range(size):
            for key in (k, ("stage", s)):
                for ins in structs[r].get(key, {}).get("after", []) if key in structs[r] else []:
                    _apply_after(ins, r, k, phase, pools[r], owner, delivered)
    # Everything delivered exactly once.
    for tag, w in expected:
        n = delivered.get((tag, w), 0)
        if n != 1:
            raise PlanError(f"{phase.value}: result {w.value} of rank {tag[0]} stage {tag[1]} delivered {n} times (expected once)")
    check_coverage(plan, items_all, phase)


def _apply_after(ins, r: int, k: int, phase: Phase, pool: _Pool, owner: np.ndarray, delivered: dict) -> None:
    if isinstance(ins, Merge):
        if phase is not Phase.FWD:
            raise PlanError(f"rank {r}: Merge in backward")
        o = pool.read(ins.o, (Wire.O, ins.tokens), f"merge after round {k}")
        lse = pool.read(ins.lse, (Wire.LSE, ins.tokens), f"merge after round {k}")
        if o[0][2] != lse[0][2] or o[0][2] is None:
            raise PlanError(f"rank {r}: merge after round {k} pairs o and lse of different blocks")
        if not _owned(owner, r, ins.tokens):
            raise PlanError(f"rank {r}: merges rows {ins.tokens} it does not own")
        delivered[(o[0][2], Wire.O)] += 1
        delivered[(o[0][2], Wire.LSE)] += 1
    elif isinstance(ins, Accumulate):
        if phase is not Phase.BWD or ins.wire not in (Wire.DQ, Wire.DKV):
            raise PlanError(f"rank {r}: bad Accumulate {ins.wire.value} in {phase.value}")
        got = pool.read(ins.src, (ins.wire, ins.tokens), f"accumulate after round {k}")
        if got[0][2] is None:
            raise PlanError(f"rank {r}: accumulate after round {k} reads a datum that is not a partial result")
        if not _owned(owner, r, ins.tokens):
            raise PlanError(f"rank {r}: accumulates rows {ins.tokens} it does not own")
        delivered[(got[0][2], ins.wire)] += 1
    else:
        raise PlanError(f"rank {r}: unexpected {type(ins).__name__} after round {k}")


def check_coverage(plan: "Plan", items: list[ComputeItem], phase: Phase | str = Phase.FWD) -> None:
    """The items tile every document's causal mask exactly once (exact, O(items log items))."""
    starts = plan.batch.doc_starts
    by_doc: dict[int, list[ComputeItem]] = defaultdict(list)
    for it in items:
        d = int(np.searchsorted(starts, it.q.start, side="right") - 1)
        lo, hi = int(starts[d]), int(starts[d + 1])
        if not (lo <= it.kv.start and it.kv.stop <= hi and it.q.stop <= hi):
            raise PlanError(f"{Phase(phase).value}: item q{it.q} kv{it.kv} crosses a document boundary")
        by_doc[d].append(it)
    total = 0
    for d, its in by_doc.items():
        lo = int(starts[d])
        cuts = sorted({lo, int(starts[d + 1])} | {it.q.start for it in its} | {it.q.stop for it in its})
        for a, b in zip(cuts, cuts[1:]):
            row_items = [it for it in its if it.q.start <= a and b <= it.q.stop]
            causal = [it for it in row_items if it.causal]
            if len(causal) != 1:
                raise PlanError(f"{Phase(phase).value}: rows [{a}:{b}) of document {d} have {len(causal)} diagonal blocks (expected 1)")
            spans = sorted((it.kv.start, it.kv.stop) for it in row_items if not it.causal) + [(causal[0].kv.start, None)]
            pos = lo
            for s0, s1 in spans:
                if s0 != pos:
                    kind = "twice" if s0 < pos else "never"
                    raise PlanError(f"{Phase(phase).value}: rows [{a}:{b}) of document {d}: keys from {min(pos, s0)} computed {kind}")
                pos = s1 if s1 is not None else pos
        total += sum(it.work for it in its)
    if total != plan.batch.total_work():
        raise PlanError(f"{Phase(phase).value}: items cover {total} pairs, the batch has {plan.batch.total_work()}")

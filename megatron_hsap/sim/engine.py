"""Event-driven execution of per-rank programs on a fluid network model.

A ``Workload`` is one program per simulated rank plus the point-to-point ``TaggedTransfer``s between
them. Each rank runs its instructions in order on its own clock (its compute stream):

* ``Busy(seconds)``: a kernel (attention, merge, a copy) occupies the rank.
* ``PostTag(tag)``: launch one ``batch_isend_irecv``: every transfer with this tag that the rank
  sends or receives. A transfer starts once BOTH endpoints have posted it, plus the link's
  per-operation latency (NCCL P2P is pairwise-synchronous), then flows through the network.
* ``WaitTag(tag)``: block until all of the rank's transfers of ``tag`` are done (its own sends and
  receives only, whatever its peers still have in flight).
* ``Collective(tag, seconds)``: every rank holding this tag enters; all leave together at
  ``max(arrivals) + seconds`` (a blocking all-gather, reduce-scatter or all-to-all).
* ``Launch(tag, seconds)``: enqueue ``seconds`` of work on the rank's *side stream* (an
  asynchronous collective whose members run identical programs, priced in closed form: HSAP's
  pipelined intra all-to-all); it starts when the rank reaches it and the side stream is free,
  and the compute stream goes on. ``Join(tag)``: block until that item is done (exposed time is a
  span of kind ``a2a``; the side stream's own spans are ``a2a_overlapped``).
* ``Busy(..., overlap_slowdown=s)``: a kernel that shares the GPU with the side stream: the part
  of it that overlaps side-stream work runs ``1 + s`` times slower (NCCL kernels hold SMs and HBM).

Network: each rank has a send and a receive port per link class (NVLink, InfiniBand), each of
the class's bandwidth; concurrent transfers share ports max-min fairly (progressive filling),
rates are recomputed whenever a transfer starts or ends. ``flow_cap(a, b)`` (optional) bounds one
transfer's own rate (a private port of that capacity): NCCL drives a point-to-point stream to a
network peer with a few channels only (``Cluster.p2p_cap``, docs/design.md §2.4). Output: a ``Timeline`` of spans per
rank (busy kinds and exposed waits) and of transfers, for breakdowns and Gantt charts.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import LinkClass

__all__ = ["Busy", "PostTag", "WaitTag", "Collective", "Launch", "Join", "TaggedTransfer", "Workload", "Span", "Timeline", "simulate"]


@dataclass(frozen=True, slots=True)
class Busy:
    seconds: float
    kind: str = "compute"  # compute | merge | a2a | copy | host
    label: str = ""
    flops: float = 0.0
    overlap_slowdown: float = 0.0  # slowdown of the part that overlaps this rank's side stream


@dataclass(frozen=True, slots=True)
class PostTag:
    """Start every transfer of ``tag`` this rank takes part in (one ``batch_isend_irecv``; the
    plan's ``ir.Post`` of a round maps to it)."""

    tag: int


@dataclass(frozen=True, slots=True)
class WaitTag:
    """Block until this rank's transfers of ``tag`` are done (the plan's ``ir.Wait``)."""

    tag: int


@dataclass(frozen=True, slots=True)
class Collective:
    tag: int
    seconds: float
    kind: str = "collective"
    label: str = ""


@dataclass(frozen=True, slots=True)
class Launch:
    tag: int
    seconds: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class Join:
    tag: int


Instr = Busy | PostTag | WaitTag | Collective | Launch | Join


@dataclass(frozen=True, slots=True)
class TaggedTransfer:
    """Bytes one simulated rank sends another under ``tag`` (a round's sends between the two,
    summed; not the runtime's ``p2p.Transfer``, which is one tensor's send or receive)."""

    src: int
    dst: int
    nbytes: float
    tag: int
    label: str = ""


@dataclass(slots=True)
class Workload:
    """Programs (one per simulated rank) and the transfers between those ranks."""

    programs: list[list[Instr]]
    transfers: list[TaggedTransfer] = field(default_factory=list)

    def validate(self) -> None:
        n = len(self.programs)
        posts = [{i.tag for i in p if isinstance(i, PostTag)} for p in self.programs]
        for t in self.transfers:
            if not (0 <= t.src < n and 0 <= t.dst < n) or t.src == t.dst:
                raise ConfigError(f"transfer {t} needs two distinct ranks in [0, {n})")
            if t.tag not in posts[t.src] or t.tag not in posts[t.dst]:
                raise ConfigError(f"transfer {t}: both endpoints must post tag {t.tag} (PostTag)")
        for r, p in enumerate(self.programs):
            seen: set[int] = set()
            launched: set[int] = set()
            for ins in p:
                if isinstance(ins, PostTag):
                    seen.add(ins.tag)
                elif isinstance(ins, WaitTag) and ins.tag not in seen:
                    raise ConfigError(f"rank {r} waits on tag {ins.tag} before posting it")
                elif isinstance(ins, Launch):
                    launched.add(ins.tag)
                elif isinstance(ins, Join) and ins.tag not in launched:
                    raise ConfigError(f"rank {r} joins side-stream item {ins.tag} before launching it")


@dataclass(frozen=True, slots=True)
class Span:
    rank: int
    kind: str  # a Busy kind, "wait" (exposed communication) or "sync" (collective skew)
    start: float
    end: float
    label: str = ""
    tag: int = -1  # the round a "wait" span waits for


@dataclass(slots=True)
class Timeline:
    spans: list[Span]
    transfers: list[tuple[int, int, float, float, float, str]]  # src, dst, start, end, bytes, label
    finish: np.ndarray  # [ranks] seconds
    flops: np.ndarray  # [ranks] FLOPs of Busy spans
    ready: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, tag) -> when its last transfer had both posts

    @property
    def makespan(self) -> float:
        return float(self.finish.max()) if len(self.finish) else 0.0

    def busy(self, kind: str) -> np.ndarray:
        """Seconds per rank spent in spans of ``kind``: float64 ``[ranks]``."""
        out = np.zeros(len(self.finish))
        for s in self.spans:
            if s.kind == kind:
                out[s.rank] += s.end - s.start
        return out


def _ports(f: list) -> tuple[int, ...]:
    """Ports of flow record ``[bytes left, out port, in port, rate, (private port)]``."""
    return (f[1], f[2], *f[4:])


class _Net:
    """Active transfers and their max-min fair rates. Max-min allocations decompose over the
    connected components of the port–flow graph, so after an event only the component of the
    ports it touched is refilled."""

    def __init__(self, caps: list[float]) -> None:
        self.caps = caps
        self.flows: dict[int, list] = {}  # tid -> [bytes left, out port, in port, rate]
        self.at_port: dict[int, set[int]] = defaultdict(set)
        self.dirty: set[int] = set()

    def add(self, tid: int, nbytes: float, out_port: int, in_port: int, cap: float = float("inf")) -> None:
        ports = [out_port, in_port]
        if cap < float("inf"):  # the flow's own ceiling: a private port nobody else uses
            self.caps.append(cap)
            ports.append(len(self.caps) - 1)
        self.flows[tid] = [nbytes, *ports[:2], 0.0, *ports[2:]]
        for p in ports:
            self.at_port[p].add(tid)
        self.dirty.update(ports)

    def advance(self, dt: float) -> None:
        if dt > 0:
            for f in self.flows.values():
                f[0] -= f[3] * dt

    def next_finish(self) -> float:
        return min((f[0] / f[3] for f in self.flows.values()), default=float("inf"))

    def pop_done(self, tol: float) -> list[int]:
        done = [t for t, f in self.flows.items() if f[0] <= max(tol, 1e-9 * f[3])]
        for t in done:
            f = self.flows.pop(t)
            for p in _ports(f):
                self.at_port[p].discard(t)
                self.dirty.add(p)
        return done

    def recompute(self) -> None:
        """Progressive filling over the component(s) reachable from the dirty ports."""
        comp: set[int] = set()
        ports = set(self.dirty)
        todo = list(ports)
        self.dirty.clear()
        while todo:
            for t in self.at_port.get(todo.pop(), ()):
                if t not in comp:
                    comp.add(t)
                    for p in _ports(self.flows[t]):
                        if p not in ports:
                            ports.add(p)
                            todo.append(p)
        if not comp:
            return
        count: dict[int, int] = defaultdict(int)
        for t in comp:
            for p in _ports(self.flows[t]):
                count[p] += 1
        cap = {p: self.caps[p] for p in count}
        live = {t: self.flows[t] for t in comp}
        while live:
            m = min(cap[p] / c for p, c in count.items() if c > 0)
            bott = {p for p, c in count.items() if c > 0 and cap[p] / c <= m * (1 + 1e-9)}
            for t in [t for t, f in live.items() if any(p in bott for p in _ports(f))]:
                f = live.pop(t)
                f[3] = m
                for p in _ports(f):
                    cap[p] = max(cap[p] - m, 0.0)
                    count[p] -= 1


def simulate(
    work: Workload,
    link: Callable[[int, int], LinkClass],
    bandwidth: Callable[[LinkClass], float],
    latency: Callable[[LinkClass], float],
    flow_cap: Callable[[int, int], float] | None = None,
) -> Timeline:
    """Run ``work``; ``link(a, b)`` gives the class between simulated ranks ``a`` and ``b``;
    ``flow_cap(a, b)`` (bytes/s, optional) bounds one transfer between them."""
    work.validate()
    progs = work.programs
    n = len(progs)
    classes = (LinkClass.NVLINK, LinkClass.INFINIBAND)
    caps = [bandwidth(c) for _ in range(n) for c in classes for _ in (0, 1)]

    def port(rank: int, cls: LinkClass, direction: int) -> int:
        return rank * 4 + classes.index(cls) * 2 + direction

    by_tag: dict[tuple[int, int], list[int]] = defaultdict(list)  # (rank, tag) -> transfer ids
    for tid, t in enumerate(work.transfers):
        by_tag[(t.src, t.tag)].append(tid)
        by_tag[(t.dst, t.tag)].append(tid)
    pending = {k: len(v) for k, v in by_tag.items()}
    done_at: dict[tuple[int, int], float] = defaultdict(float)
    posted = [0] * len(work.transfers)
    start_time = [0.0] * len(work.transfers)
    members: dict[int, set[int]] = defaultdict(set)
    for r, p in enumerate(progs):
        for ins in p:
            if isinstance(ins, Collective):
                members[ins.tag].add(r)
    arrivals: dict[int, dict[int, float]] = defaultdict(dict)
    side: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # side-stream items (start, end) per rank
    side_done: dict[tuple[int, int], float] = {}

    pc = [0] * n
    clock = [0.0] * n
    blocked: dict[int, tuple[int, float]] = {}  # rank -> (tag, since)
    spans: list[Span] = []
    flops = [0.0] * n
    xfers: list[tuple[int, int, float, float, float, str]] = []
    heap: list[tuple[float, int, str, int, int]] = []
    seq = 0
    net = _Net(caps)
    now = 0.0
    dirty = False
    runnable: list[int] = list(range(n))
    ready: dict[tuple[int, int], float] = {}

    def push(t: float, kind: str, a: int, b: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, a, b))
        seq += 1

    def run(r: int) -> None:
        prog = progs[r]
        while pc[r] < len(prog):
            ins = prog[pc[r]]
            t = clock[r]
            if isinstance(ins, Busy):
                secs = ins.seconds
                if ins.overlap_slowdown > 0 and side[r]:
                    secs += ins.overlap_slowdown * sum(max(0.0, min(e, t + secs) - max(s0, t)) for s0, e in side[r] if e > t)
                if secs > 0:
                    spans.append(Span(r, ins.kind, t, t + secs, ins.label))
                clock[r] = t + secs
                flops[r] += ins.flops
            elif isinstance(ins, Launch):
                start = max(t, side[r][-1][1] if side[r] else 0.0)
                side[r].append((start, start + ins.seconds))
                side_done[(r, ins.tag)] = start + ins.seconds
                if ins.seconds > 0:
                    spans.append(Span(r, "a2a_overlapped", start, start + ins.seconds, ins.label))
            elif isinstance(ins, Join):
                end = side_done[(r, ins.tag)]
                if end > t:
                    spans.append(Span(r, "a2a", t, end, "all-to-all exposed"))
                    clock[r] = end
            elif isinstance(ins, PostTag):
                push(t, "post", r, ins.tag)
            elif isinstance(ins, WaitTag):
                if pending.get((r, ins.tag), 0) > 0:
                    blocked[r] = (ins.tag, t)
                    return
                end = done_at.get((r, ins.tag), 0.0)
                if end > t:
                    spans.append(Span(r, "wait", t, end, f"round {ins.tag}", ins.tag))
                    clock[r] = end
            elif isinstance(ins, Collective):
                arrivals[ins.tag][r] = t
                if len(arrivals[ins.tag]) < len(members[ins.tag]):
                    blocked[r] = (-1, t)
                    return
                start = max(arrivals[ins.tag].values())
                for m, since in arrivals[ins.tag].items():
                    if start > since:
                        spans.append(Span(m, "sync", since, start, ins.label))
                    if ins.seconds > 0:
                        spans.append(Span(m, ins.kind, start, start + ins.seconds, ins.label))
                    clock[m] = start + ins.seconds
                    if m != r:
                        blocked.pop(m, None)
                        pc[m] += 1
                        runnable.append(m)
            pc[r] += 1

    def finish_transfer(tid: int) -> None:
        t = work.transfers[tid]
        xfers.append((t.src, t.dst, float(start_time[tid]), now, t.nbytes, t.label))
        for r in (t.src, t.dst):
            key = (r, t.tag)
            pending[key] -= 1
            done_at[key] = max(done_at[key], now)
            if pending[key] == 0 and r in blocked and blocked[r][0] == t.tag:
                _, since = blocked.pop(r)
                if now > since:
                    spans.append(Span(r, "wait", since, now, f"round {t.tag}", t.tag))
                clock[r] = max(since, now)
                pc[r] += 1
                runnable.append(r)

    while True:
        while runnable:
            run(runnable.pop())
        t_event = heap[0][0] if heap else float("inf")
        if dirty:
            net.recompute()
            dirty = False
        t_finish = now + net.next_finish()
        if t_event == float("inf") and t_finish == float("inf"):
            break
        if t_finish <= t_event:
            net.advance(t_finish - now)
            now = t_finish
            for tid in net.pop_done(tol=1e-6):
                finish_transfer(tid)
            dirty = True
            continue
        net.advance(t_event - now)
        now = t_event
        while heap and heap[0][0] <= now:
            _, _, kind, a, b = heapq.heappop(heap)
            if kind == "post":
                for tid in by_tag.get((a, b), ()):
                    posted[tid] += 1
                    if posted[tid] == 2:
                        tr = work.transfers[tid]
                        for key in ((tr.src, tr.tag), (tr.dst, tr.tag)):
                            ready[key] = max(ready.get(key, 0.0), now)
                        push(now + latency(link(tr.src, tr.dst)), "start", tid, 0)
            else:  # start
                tr = work.transfers[a]
                start_time[a] = now
                if tr.nbytes <= 0:
                    finish_transfer(a)
                    continue
                cls = link(tr.src, tr.dst)
                net.add(a, tr.nbytes, port(tr.src, cls, 0), port(tr.dst, cls, 1),
                        flow_cap(tr.src, tr.dst) if flow_cap else float("inf"))
                dirty = True
    stuck = [r for r in range(n) if pc[r] < len(progs[r])]
    if stuck:
        raise ConfigError(f"simulation deadlocked: ranks {stuck[:8]} never finished (unmatched post/wait or collective)")
    return Timeline(spans=spans, transfers=xfers, finish=np.asarray(clock, dtype=np.float64), flops=np.asarray(flops), ready=ready)


def simulate_on(work: Workload, cluster: "object", gpus: Sequence[int], comm_size: int | None = None) -> Timeline:
    """``simulate`` with links from a ``Cluster``: simulated rank ``k`` is CP rank ``gpus[k]``.
    ``comm_size``: ranks of the communicator the point-to-point traffic runs on (default
    ``len(gpus)``): NCCL sizes its channels per network peer by it (``Cluster.p2p_cap``)."""
    hw = cluster.hw  # type: ignore[attr-defined]
    n = comm_size or len(gpus)
    return simulate(
        work,
        link=lambda a, b: cluster.link(gpus[a], gpus[b]),  # type: ignore[attr-defined]
        bandwidth=hw.bandwidth,
        latency=hw.latency,
        flow_cap=lambda a, b: cluster.p2p_cap(gpus[a], gpus[b], n),  # type: ignore[attr-defined]
    )

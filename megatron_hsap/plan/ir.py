"""The plan IR: frozen, slotted dataclasses shared by the planner, verifier, runtime and simulator.

Vocabulary (docs/design.md §1–2):

* Token ids are *global* positions in the padded packed batch ``[0, T')``; a ``TokenRange`` is
  ``[start, stop)``. Every range used by an instruction lies inside ONE document.
* Each inter rank holds an ordered list of ``Segment``s (its layout); a token's *local row* is its
  position in that concatenation. The contiguous layout gives one segment per rank.
* A rank's *local* tensors (never in the pool): ``q [t, h, d]``, ``k [t, hkv, d]``,
  ``v [t, hkv, dv]``, forward accumulators ``o [t, h, dv]``/``lse [t, h]`` (fp32), and in backward
  ``do``, ``lse``, ``delta`` and fp32 accumulators ``dq``, ``dk``, ``dv``.
* Everything received lands in the rank's receive *pool*: one byte buffer allocated once at the
  plan's capacity; a ``Slot`` is a byte range of it. Results computed for another rank are also
  written into slots before being sent back.

Program structure, per rank and phase: ``Post(r)`` launches round ``r`` (one
``batch_isend_irecv`` of the ``Send``/``Recv`` ops listed in it), then ``Compute``s of the stage
run, then ``Wait(r)``, then ``Merge``/``Accumulate`` of what round ``r`` brought back.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.window import banded_pairs, kernel_window

__all__ = [
    "Wire",
    "Phase",
    "PhaseWires",
    "PHASE_WIRES",
    "TokenRange",
    "Segment",
    "Slot",
    "Send",
    "Recv",
    "Round",
    "Post",
    "Wait",
    "ComputeItem",
    "Compute",
    "Merge",
    "Accumulate",
    "Instr",
    "Program",
    "Unit",
    "positional_builder",
    "new_send",
    "new_recv",
    "new_unit",
    "new_compute_item",
]


class Wire(str, enum.Enum):
    """What a message carries (docs/design.md §4 wire formats)."""

    Q = "q"  # activation dtype, [n, h, d]
    KV = "kv"  # activation dtype, k [n, hkv, d] then v [n, hkv, dv] (two P2P ops, one message)
    O = "o"  # activation dtype, [n, h, dv]: a partial output computed away from its q owner
    LSE = "lse"  # fp32, [n, h]
    DO = "do"  # activation dtype, [n, h, dv]
    DELTA = "delta"  # fp32, [n, h]: rowsum(dO ∘ O)
    DQ = "dq"  # fp32, [n, h, d]: partial gradient returned to the q owner
    DKV = "dkv"  # fp32, dk [n, hkv, d] then dv [n, hkv, dv]


class Phase(enum.StrEnum):
    """The one phase vocabulary (docs/design.md §1): forward and backward.

    A ``StrEnum``, so a member formats, prints, hashes and compares as its value (``f"{Phase.FWD}"``
    is ``"fwd"``, ``Phase.FWD == "fwd"``): CSV labels, plan dumps, fingerprints and dict lookups by
    the string stay byte-identical. ``Phase("fwd")`` converts a user's string; any other value
    raises ``ConfigError`` naming the allowed ones.
    """

    FWD = "fwd"
    BWD = "bwd"

    @classmethod
    def _missing_(cls, value: object) -> Phase:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"phase must be one of {allowed} (or Phase.FWD / Phase.BWD), got {value!r}")


class PhaseWires(NamedTuple):
    """What one phase moves per block (docs/design.md §3): ``q_side`` travels with the q rows
    (from the q owner), ``kv_side`` with the kv rows (from the kv owner), ``results`` go back
    (``DKV`` to the kv owner, the others to the q owner)."""

    q_side: tuple[Wire, ...]
    kv_side: tuple[Wire, ...]
    results: tuple[Wire, ...]

    @property
    def inputs(self) -> tuple[Wire, ...]:
        """Every input wire, q side first (the order a compute item copies them in)."""
        return self.q_side + self.kv_side


# THE phase wire table: codegen (messages, slots), verify (inputs / results of each item) and dump
# read it.
PHASE_WIRES = {
    Phase.FWD: PhaseWires(q_side=(Wire.Q,), kv_side=(Wire.KV,), results=(Wire.O, Wire.LSE)),
    Phase.BWD: PhaseWires(q_side=(Wire.Q, Wire.DO, Wire.LSE, Wire.DELTA), kv_side=(Wire.KV,), results=(Wire.DQ, Wire.DKV)),
}


@dataclass(frozen=True, slots=True, order=True)
class TokenRange:
    """Global token ids ``[start, stop)``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"TokenRange needs 0 <= start <= stop, got {self.start=} {self.stop=}")

    def __len__(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"[{self.start}:{self.stop})"


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of global tokens held by one rank at local rows ``[local_start, ...)``."""

    tokens: TokenRange
    local_start: int


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    """A byte range ``[offset, offset + nbytes)`` of one rank's receive pool."""

    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.nbytes <= 0:
            raise ValueError(f"Slot needs offset >= 0 and nbytes > 0, got {self.offset=} {self.nbytes=}")

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def __str__(self) -> str:
        return f"$pool[{self.offset}:+{self.nbytes}]"


@dataclass(frozen=True, slots=True)
class Send:
    """``create $send-op $X %peer``: send ``wire`` rows ``tokens``; from local tensors when
    ``src`` is None, else from a pool slot (results computed here for ``peer``)."""

    wire: Wire
    tokens: TokenRange
    peer: int
    nbytes: int
    src: Slot | None = None


@dataclass(frozen=True, slots=True)
class Recv:
    """``create $recv-op $X %peer``: receive ``wire`` rows ``tokens`` into pool slot ``dst``."""

    wire: Wire
    tokens: TokenRange
    peer: int
    nbytes: int
    dst: Slot


@dataclass(frozen=True, slots=True)
class Round:
    """One ``batch_isend_irecv`` of one rank. Per peer, sends and recvs keep the plan's order,
    which equals the peer's order of the matching ops (checked by the verifier)."""

    index: int  # global round number: forward rounds first, then backward
    ops: tuple[Send | Recv, ...]


@dataclass(frozen=True, slots=True)
class Post:
    round: Round


@dataclass(frozen=True, slots=True)
class Wait:
    index: int


@dataclass(frozen=True, slots=True)
class ComputeItem:
    """One attention kernel call over a (q rows, kv rows) pair of ONE document.

    ``causal`` means key position <= query position (bottom-right aligned, so the kv range
    ends where the q range ends); otherwise every kv row precedes every q row (dense rectangle).
    ``srcs`` maps each input wire to its pool slot, or None for the rank's local tensors;
    ``dsts`` maps each output wire likewise (None: merge/accumulate into local tensors).
    Forward inputs: q, kv; outputs: o, lse. Backward inputs: q, kv, do, lse, delta; outputs: dq, dkv.
    """

    q: TokenRange
    kv: TokenRange
    causal: bool
    srcs: tuple[tuple[Wire, Slot | None], ...]
    dsts: tuple[tuple[Wire, Slot | None], ...]
    window: int = -1  # the plan's sliding window ``left`` (plan/window.py), -1: none

    def __post_init__(self) -> None:
        if len(self.q) == 0 or len(self.kv) == 0:
            raise ValueError(f"empty ComputeItem q={self.q} kv={self.kv}")
        if self.causal:
            if not (self.kv.start <= self.q.start and self.kv.stop == self.q.stop):
                raise ValueError(f"causal item needs kv.start <= q.start and kv.stop == q.stop: q={self.q} kv={self.kv}")
        elif self.kv.stop > self.q.start:
            raise ValueError(f"rectangle item needs every kv row before every q row: q={self.q} kv={self.kv}")

    @property
    def work(self) -> int:
        """Unmasked (q, k) pairs (causal and inside the window: ``plan/window.py``)."""
        return banded_pairs(self.q.start, self.q.stop, self.kv.start, self.kv.stop, self.window)

    @property
    def kernel_window(self) -> tuple[int, int]:
        """flash-attn ``window_size`` of this call relative to its block; ``(-1, -1)``: plain call."""
        return kernel_window(self.q.start, self.q.stop, self.kv.start, self.kv.stop, self.causal, self.window)

    def src(self, wire: Wire) -> Slot | None:
        """THE lookup of an input wire's slot (``None``: the rank's local tensor); ``KeyError`` if
        the item has no such input."""
        for w, slot in self.srcs:
            if w is wire:
                return slot
        raise KeyError(wire)

    def dst(self, wire: Wire) -> Slot | None:
        """THE lookup of an output wire's slot (``None``: merged / accumulated locally)."""
        for w, slot in self.dsts:
            if w is wire:
                return slot
        raise KeyError(wire)


@dataclass(frozen=True, slots=True)
class Compute:
    """``compute``: run the items (in order) with the tensors in the computing buffers."""

    stage: int
    items: tuple[ComputeItem, ...]


@dataclass(frozen=True, slots=True)
class Merge:
    """``copy-o $comm $local``: merge a received partial (o, lse) for rows ``tokens`` into the
    local forward accumulators (fp32, overflow-safe LSE merge)."""

    tokens: TokenRange
    o: Slot
    lse: Slot


@dataclass(frozen=True, slots=True)
class Accumulate:
    """``copy-dq|dkv $comm $local``: add a received partial gradient into the local fp32 gradients."""

    wire: Wire  # DQ or DKV
    tokens: TokenRange
    src: Slot


Instr = Post | Wait | Compute | Merge | Accumulate


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's instruction list for one phase."""

    rank: int
    phase: Phase
    instrs: tuple[Instr, ...]


@dataclass(frozen=True, slots=True)
class Unit:
    """A placed piece of work: q rows × kv rows of one document, computed on ``rank`` at ``stage``
    (the stage numbering is per phase and identical in forward and backward)."""

    doc: int
    q: TokenRange
    kv: TokenRange
    causal: bool
    q_owner: int
    kv_owner: int
    rank: int
    stage: int = field(default=0)
    window: int = -1  # the plan's sliding window ``left`` (plan/window.py), -1: none
    # ``work`` once computed (-1: not yet): the planner reads it ~4 times per block (cutting,
    # staging, pricing); not part of the unit's identity (equality, hash, repr)
    _work: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def work(self) -> int:
        """Unmasked (q, k) pairs (``plan/window.py``'s ``banded_pairs``)."""
        w = self._work
        if w < 0:
            w = banded_pairs(self.q.start, self.q.stop, self.kv.start, self.kv.stop, self.window)
            object.__setattr__(self, "_work", w)  # a cache of a pure function of frozen fields
        return w

    @property
    def is_local(self) -> bool:
        """Computed where both its q and its kv rows live: no message moves for it."""
        return self.rank == self.q_owner == self.kv_owner

    def program_key(self) -> tuple[int, int, bool, int, int]:
        """Where this block runs in its rank's program (``codegen`` emits blocks in this order):
        by stage; within one, blocks computed for another rank before the rank's own q rows; then
        by q and kv start (``candidates._build`` sorts a staging's blocks by it before
        ``codegen.generate``)."""
        return (self.rank, self.stage, self.rank == self.q_owner, self.q.start, self.kv.start)

    def at_stage(self, stage: int) -> "Unit":
        """This block at ``stage`` (its cached ``work`` carried over). Built through the slots'
        setters: a frozen dataclass' ``__init__`` calls ``object.__setattr__`` per field, ~3x the
        time, and staging re-stages ~10^5 blocks per 1M-token compile (no ``__post_init__`` is
        skipped: Unit has none)."""
        v = _new_unit(Unit)
        _set_doc(v, self.doc)
        _set_q(v, self.q)
        _set_kv(v, self.kv)
        _set_causal(v, self.causal)
        _set_q_owner(v, self.q_owner)
        _set_kv_owner(v, self.kv_owner)
        _set_rank(v, self.rank)
        _set_stage(v, stage)
        _set_window(v, self.window)
        _set_work(v, self._work)
        return v


def positional_builder(cls: type) -> "Callable[..., Any]":
    """A function building ``cls`` (a frozen, slotted dataclass) from every field's value in
    order, through the slots' setters, then its ``__post_init__`` checks if it has them: the
    dataclass ``__init__`` calls ``object.__setattr__`` by name per field, ~2x the time. For the
    planner's hottest constructions (~10^4 blocks, messages and ops per 1M-token compile); equal
    objects either way (tests/plan/test_compile_speed_equal.py). One builder per class, kept on it
    (``_positional_builder``: the constructors below and ``pickle_by_fields`` share it)."""
    assert "__slots__" in cls.__dict__, cls
    if "_positional_builder" in cls.__dict__:
        return cls.__dict__["_positional_builder"]
    names = [f.name for f in fields(cls)]
    env = {"new": object.__new__, "cls": cls, "check": getattr(cls, "__post_init__", None),
           **{f"set_{n}": cls.__dict__[n].__set__ for n in names}}
    body = "".join(f"    set_{n}(v, {n})\n" for n in names) + ("    check(v)\n" if env["check"] else "")
    exec(f"def build({', '.join(names)}):\n    v = new(cls)\n{body}    return v\n", env)  # unrolled: no loop per field
    build = env["build"]
    build.__doc__ = f"``{cls.__name__}(*fields)`` (``ir.positional_builder``)"
    cls._positional_builder = build  # (a plain function in the class dict: read back unbound)
    return build


def pickle_by_fields(cls: type) -> None:
    """Make ``cls`` (a frozen, slotted dataclass) pickle as ``positional_builder(cls)`` and its
    fields' values in order. CPython's ``__setstate__`` for slotted dataclasses calls
    ``dataclasses.fields`` per object; a plan is ~10^4 such objects (16K at 1M tokens over 64 inter
    ranks) and the training process unpickles every plan the plan worker process compiles
    (``megatron/plan_worker.py``): a fineweb 1M-token plan over 64 inter ranks unpickles in 15–17 ms
    instead of 48–56 (this VM, collector off, two runs each). Equal objects either way, a block's
    cached work included (``tests/plan/test_ir.py``)."""
    positional_builder(cls)
    get = operator.attrgetter(*(f.name for f in fields(cls)))
    one = len(fields(cls)) == 1

    def __reduce__(self: Any) -> tuple:
        values = get(self)
        return _rebuilt, (cls, (values,) if one else values)

    cls.__reduce__ = __reduce__


def _rebuilt(cls: type, values: tuple) -> Any:
    """``pickle_by_fields``' reconstructor (a module-level name, so pickles refer to it)."""
    return cls.__dict__["_positional_builder"](*values)


new_send = positional_builder(Send)
new_recv = positional_builder(Recv)
new_unit = positional_builder(Unit)  # every field, ``_work`` last (-1: not computed)
new_compute_item = positional_builder(ComputeItem)  # validated like ``ComputeItem(...)``
_new_unit = object.__new__
(_set_doc, _set_q, _set_kv, _set_causal, _set_q_owner, _set_kv_owner, _set_rank, _set_stage, _set_window,
 _set_work) = (Unit.__dict__[f.name].__set__ for f in fields(Unit))
assert not hasattr(Unit, "__post_init__") and [f.name for f in fields(Unit)] == [
    "doc", "q", "kv", "causal", "q_owner", "kv_owner", "rank", "stage", "window", "_work"], "Unit.at_stage sets every field"
for _cls in (TokenRange, Segment, Slot, Send, Recv, Round, Post, Wait, ComputeItem, Compute, Merge, Accumulate, Program, Unit):
    pickle_by_fields(_cls)
del _cls

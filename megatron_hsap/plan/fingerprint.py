"""The plan's identity on the wire: an integer hash of everything that shapes its programs, and the
inputs it came from as fixed-size integer vectors (docs/design.md §2.1; issue 18).

Ranks that run different plans must find out before any payload moves: gloo accepts a short
message into a larger receive slot (the rest is stale pool memory) and aborts the process on a
size mismatch, so the runtime exchanges a small header first (``megatron_hsap.runtime.handshake``).
This module supplies its contents, pure and integer-exact so every node computes the same bytes:

* :func:`plan_hash` — a 128-bit blake2b digest of the normalised ``cu_seqlens``, every
  ``PlanOptions`` field (``head_chunks`` as ``Plan.head_chunks`` resolved it), the pool capacity,
  the layout's segments and every message of both phases (round, src, dst, wire, token range, bytes). Two plans with the same hash run identical
  programs; the programs are included (not only the inputs) so that two nodes whose planners
  disagree — another package version, a non-deterministic library — are caught too.
* :func:`input_vector` / :func:`differing_inputs` — each input as one int64 (a hash for
  ``cu_seqlens`` and strings), so a second fixed-size exchange can name *which* input differs.
* :func:`pair_round_bytes` — bytes one rank sends to / expects from one peer in each round.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from typing import TYPE_CHECKING

from megatron_hsap.plan.costs import DEFAULT_GRAD_WIRE_DTYPE
from megatron_hsap.plan.ir import Phase, Recv, Send
from megatron_hsap.plan.options import PlanOptions

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = [
    "HASH_VERSION",
    "INPUT_NAMES",
    "plan_hash",
    "input_vector",
    "differing_inputs",
    "pair_round_bytes",
    "split_hash",
    "join_hash",
]

HASH_VERSION = 1  # bump when the hashed fields change: ranks on other versions then disagree loudly
_NONE = -(1 << 62)  # int64 code of an option left at None
_OPTION_NAMES = tuple(f.name for f in fields(PlanOptions))
INPUT_NAMES: tuple[str, ...] = ("cu_seqlens", "T", "entries", *_OPTION_NAMES)
_MASK64 = (1 << 64) - 1


def _h64(data: bytes) -> int:
    """A signed 64-bit digest (fits an int64 tensor element)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _encode(value: object) -> int:
    """One option value as an int64: ints (and bools) as themselves, None and strings coded."""
    if value is None:
        return _NONE
    if isinstance(value, (bool, int)):
        return int(value)
    return _h64(f"{type(value).__name__}:{value}".encode())


def split_hash(value: int) -> tuple[int, int]:
    """A 128-bit hash as two signed int64 (high, low), for an int64 header."""
    hi, lo = (value >> 64) & _MASK64, value & _MASK64
    return tuple(x - (1 << 64) if x >= 1 << 63 else x for x in (hi, lo))  # type: ignore[return-value]


def join_hash(hi: int, lo: int) -> int:
    """Inverse of :func:`split_hash`."""
    return ((hi & _MASK64) << 64) | (lo & _MASK64)


def input_vector(plan: "Plan") -> tuple[int, ...]:
    """The plan's inputs as ``len(INPUT_NAMES)`` int64 values, in ``INPUT_NAMES`` order."""
    cu = plan.batch.cu_seqlens
    head = (_h64(repr(tuple(cu)).encode()), cu[-1], len(cu))
    return head + tuple(_encode(getattr(plan.options, name)) for name in _OPTION_NAMES)


def differing_inputs(plan: "Plan", theirs: tuple[int, ...] | list[int]) -> str:
    """Name every input where ``theirs`` (a peer's :func:`input_vector`) differs from this plan's,
    with both values where they can be decoded (ints), e.g. ``"pool_bytes: 1048576 here, 2097152
    on the peer"``; ``cu_seqlens`` as entries and ``T``."""
    mine = input_vector(plan)
    if len(theirs) != len(mine):
        return f"the peer's input vector has {len(theirs)} entries, {len(mine)} here (another megatron-hsap version?)"
    parts = []
    if mine[0] != theirs[0] or mine[1:3] != tuple(theirs[1:3]):
        parts.append(
            f"cu_seqlens: {mine[2]} entries, T={mine[1]} here; {theirs[2]} entries, T={theirs[1]} on the peer"
            + (" (same length and T, other boundaries)" if mine[1:3] == tuple(theirs[1:3]) else "")
        )
    for pos, name in enumerate(_OPTION_NAMES, start=3):
        if mine[pos] == theirs[pos]:
            continue
        here = getattr(plan.options, name)
        there = theirs[pos]
        if isinstance(here, (str, tuple)) or (here is None and there not in (_NONE,) and abs(there) > 1 << 40):
            parts.append(f"{name}: {here!r} here, another value on the peer")
        else:
            parts.append(f"{name}: {here!r} here, {None if there == _NONE else there!r} on the peer")
    return "; ".join(parts) if parts else "no input differs (the planners disagree: check that every node runs the same megatron-hsap and numpy versions)"


def pair_round_bytes(plan: "Plan", phase: Phase | str, rank: int, peer: int) -> tuple[tuple[int, int, int], ...]:
    """``(round index in the phase, bytes rank sends to peer, bytes rank receives from peer)`` for
    every round of ``phase`` in which the two exchange anything (inter ranks)."""
    phase = Phase(phase)
    base = plan.round_base[phase]
    out = []
    for ins in plan.program(rank, phase).instrs:
        rnd = getattr(ins, "round", None)
        if rnd is None:
            continue
        sent = sum(op.nbytes for op in rnd.ops if isinstance(op, Send) and op.peer == peer)
        recv = sum(op.nbytes for op in rnd.ops if isinstance(op, Recv) and op.peer == peer)
        if sent or recv:
            out.append((rnd.index - base, sent, recv))
    return tuple(out)


def plan_hash(plan: "Plan") -> int:
    """A 128-bit integer identifying ``plan``'s programs on every node (see the module docstring).

    Only integers and strings enter the digest (never floats), in a fixed order. ``Plan.hash``
    caches it.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"hsap-plan-v{HASH_VERSION}\n".encode())
    h.update(repr(tuple(plan.batch.cu_seqlens)).encode())
    for name in _OPTION_NAMES:
        if name == "window_size" and plan.options.window_size is None:
            continue  # plans without a window keep the hashes they had before windows existed
        if name == "grad_wire_dtype" and plan.options.grad_wire_dtype == DEFAULT_GRAD_WIRE_DTYPE:
            continue  # the default is left out: plans whose wires it does not change keep their hashes
        if name == "head_chunks":
            continue  # the resolved count below: None and a forced 2 that run alike hash alike
        if name == "flatten" or (name == "flattened_from" and plan.options.flattened_from is None):
            continue  # a search knob (plan/flatten.py): the plan it kept is hashed, flattened_from when set
        h.update(f"\n{name}={getattr(plan.options, name)!r}".encode())
    if plan.head_chunks != 1:  # one chunk (the default) keeps the hashes from before chunks existed
        h.update(f"\nhead_chunks={plan.head_chunks}".encode())
    h.update(f"\npool={plan.pool_capacity}\nlayout={plan.layout.name}:{plan.layout.chunk_tokens}\n".encode())
    for rank, segs in enumerate(plan.layout.segments):
        h.update(f"{rank}:".encode() + ",".join(f"{s.tokens.start}-{s.tokens.stop}@{s.local_start}" for s in segs).encode())
    for phase in (Phase.FWD, Phase.BWD):
        code = plan.chosen.fwd if phase is Phase.FWD else plan.chosen.bwd
        h.update(f"\n{phase.value}:{code.rounds}\n".encode())
        h.update(
            ";".join(
                f"{m.round},{m.src},{m.dst},{m.wire.value},{m.tokens.start},{m.tokens.stop},{m.nbytes},{m.part}"
                for m in code.messages
            ).encode()
        )
    return int.from_bytes(h.digest(), "big")

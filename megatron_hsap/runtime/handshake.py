"""Plans agree before any payload moves: a fixed-size header exchange per pair of peers (issue 18).

Ranks of one group that compiled different plans (another batch, ``pool_bytes``, layout, dtype
size...) would otherwise post rounds that do not pair up: gloo accepts a short message into a
larger receive slot (the rest is stale pool memory: silently wrong output) or aborts the process
on a size mismatch, NCCL hangs. So before a plan's first round on a group, every rank sends every
other rank of the group one header of ``HEADER_WORDS`` int64 — a message of its own, the same size
whatever the plans, so it always pairs up:

====  ===================================================================================
word  content
====  ===================================================================================
0-1   magic ``HSAP``, header version
2-3   the plan hash (``Plan.hash``, 128 bits as two int64)
4-5   group kind (1 intra, 2 inter), phase (0 fwd, 1 bwd) of the call doing the check
6-8   rounds forward, rounds backward, local tokens
9-10  total bytes this rank sends to / expects from the receiver (both phases)
11    number of rounds in which the two exchange anything
12-   per such round ``(round, bytes sent, bytes expected)``, first ``_PAIR_ROUNDS`` rounds
====  ===================================================================================

Every rank compares each received header with the one it sent that peer; on any difference both
sides know at once (the exchange is symmetric), run a second small exchange of
``fingerprint.input_vector`` (same size everywhere) and raise :class:`RuntimeMismatchError` naming
both plan hashes and the differing inputs (``cu_seqlens``, options). Every message of both
exchanges was matched, so the group stays usable. A peer that sends nothing within the deadline
(``HSAP_P2P_TIMEOUT_S``) gives :class:`CommunicationError` naming it and the likely cause (it
never called, or it raised before the first round — e.g. its own validation error).

A plan that agreed on a group is never checked there again: the cache is keyed by (group, plan
hash), so a new micro-batch (a new plan) costs one exchange of ``HEADER_WORDS · 8`` bytes per
peer, and later layers and the backward of the same plan cost nothing.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_hsap.errors import CommunicationError, RuntimeMismatchError
from megatron_hsap.plan.fingerprint import INPUT_NAMES, differing_inputs, input_vector, join_hash, pair_round_bytes, split_hash
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.lru import LRUCache
from megatron_hsap.runtime.p2p import CONTROL_ROUNDS, P2PChannel, Transfer

if TYPE_CHECKING:
    from megatron_hsap.plan.plan import Plan

__all__ = ["HEADER_WORDS", "agree", "build_header", "forget_agreements", "handshake_count"]

_MAGIC, _VERSION = 0x48534150, 1
_PAIR_ROUNDS = 12
HEADER_WORDS = 12 + 3 * _PAIR_ROUNDS
_KIND = {"intra": 1, "inter": 2}
_PHASE = {Phase.FWD: 0, Phase.BWD: 1}
_CACHE_PER_GROUP = 256

# group -> hashes that agreed on it (most recent last); a destroyed group's entry goes with it
_AGREED: "weakref.WeakKeyDictionary[object, LRUCache[int, bool]]" = weakref.WeakKeyDictionary()
_WORLD_AGREED: "LRUCache[int, bool]" = LRUCache(_CACHE_PER_GROUP)
_COUNT = {"exchanges": 0}


def handshake_count() -> int:
    """Header exchanges this process ran (tests check the cache with it)."""
    return _COUNT["exchanges"]


def forget_agreements() -> None:
    """Drop the cache (tests)."""
    _AGREED.clear()
    _WORLD_AGREED.clear()


def _agreed(group: dist.ProcessGroup | None) -> "LRUCache[int, bool]":
    if group is None:
        return _WORLD_AGREED
    table = _AGREED.get(group)
    if table is None:
        table = _AGREED[group] = LRUCache(_CACHE_PER_GROUP)
    return table


def build_header(plan: "Plan", kind: str, phase: Phase, rank: int, peer: int) -> list[int]:
    """The ``HEADER_WORDS`` int64 rank ``rank`` sends group peer ``peer`` (see the module table)."""
    hi, lo = split_hash(plan.hash)
    rounds = []
    if kind == "inter":
        for ph in (Phase.FWD, Phase.BWD):
            rounds.extend((plan.round_base[ph] + r, s, v) for r, s, v in pair_round_bytes(plan, ph, rank, peer))
    tokens = plan.chunk_tokens if kind == "inter" else plan.local_tokens
    words = [
        _MAGIC, _VERSION, hi, lo, _KIND[kind], _PHASE[phase],
        plan.chosen.fwd.rounds, plan.chosen.bwd.rounds, tokens,
        sum(r[1] for r in rounds), sum(r[2] for r in rounds), len(rounds),
    ]  # fmt: skip
    for r in rounds[:_PAIR_ROUNDS]:
        words.extend(r)
    words.extend([0] * (HEADER_WORDS - len(words)))
    return words


def _describe(mine: list[int], theirs: list[int]) -> str:
    """What differs between the header sent to a peer and the one received from it."""
    if theirs[0] != _MAGIC or theirs[1] != _VERSION:
        return "the peer's header is not an HSAP plan header of this version (another megatron-hsap version?)"
    parts = [f"plan hash {join_hash(mine[2], mine[3]):032x} here vs {join_hash(theirs[2], theirs[3]):032x} on the peer"]
    if mine[6:9] != theirs[6:9]:
        parts.append(
            f"rounds fwd/bwd {mine[6]}/{mine[7]} vs {theirs[6]}/{theirs[7]}, local tokens {mine[8]} vs {theirs[8]}"
        )
    # what I send must be what the peer expects, and the other way round
    if (mine[9], mine[10]) != (theirs[10], theirs[9]):
        parts.append(
            f"bytes to the peer {mine[9]} but it expects {theirs[10]}; bytes from it {theirs[9]} but {mine[10]} "
            "expected here"
        )
    return "; ".join(parts)


def _exchange(chan: P2PChannel, index: int, sends: dict[int, torch.Tensor], what: str,
              size: int, device: torch.device) -> tuple[dict[int, torch.Tensor], dict[int, str]]:  # fmt: skip
    """Send ``sends[peer]`` to each peer and receive one tensor of ``size`` int64 from each;
    returns (received by peer, why-not by peer) — the latter empty when every message arrived."""
    recvs = {p: torch.zeros(size, dtype=torch.int64, device=device) for p in sends}
    transfers = []
    for p in sorted(sends):  # same order on every rank: all recvs, then all sends
        transfers.append(Transfer(False, recvs[p], p, what))
    for p in sorted(sends):
        transfers.append(Transfer(True, sends[p], p, what))
    chan.post(index, transfers, stage=what, control=True)
    missing: dict[int, str] = {}
    for tr, why in chan.wait_each(index):
        if why is not None and tr.peer not in missing:
            missing[tr.peer] = f"{'send to' if tr.send else 'recv from'} it {why}"
    return recvs, missing


def agree(plan: "Plan", group: dist.ProcessGroup | None, kind: str, phase: Phase | str, *,
          timeout_s: float, device: torch.device | str = "cpu") -> bool:  # fmt: skip
    """Check that every rank of ``group`` runs ``plan`` (same hash) before its first message.

    Collective over ``group`` (every rank calls it at the same point, whatever its plan); returns
    True when an exchange ran, False when the plan already agreed on this group (cached) or the
    group has one rank. Raises :class:`RuntimeMismatchError` on every rank of a disagreeing pair
    (message: both hashes, round/byte counts, the differing inputs) and
    :class:`CommunicationError` when a peer's header does not arrive within ``timeout_s``.
    """
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return False
    table = _agreed(group)
    h = plan.hash
    if table.get(h):  # agreed before (now the most recent)
        return False
    phase = Phase(phase)
    device = torch.device(device)
    rank = dist.get_rank(group)
    peers = [p for p in range(size) if p != rank]
    glob = {p: dist.get_global_rank(group, p) if group is not None else p for p in range(size)}
    sent = {p: build_header(plan, kind, phase, rank, p) for p in peers}
    chan = P2PChannel(group, timeout_s=timeout_s, phase=f"{kind} handshake")
    _COUNT["exchanges"] += 1
    got, missing = _exchange(chan, CONTROL_ROUNDS[0], {p: torch.tensor(sent[p], dtype=torch.int64, device=device)
                                                       for p in peers}, "plan header", HEADER_WORDS, device)  # fmt: skip
    where = f"{kind} group rank {rank} (global {glob[rank]}), {phase.value}, before the plan's first message"
    if missing:
        who = "; ".join(f"peer {p} (global {glob[p]}): {why}" for p, why in sorted(missing.items()))
        raise CommunicationError(
            f"plan handshake on {where}: no header from {who}. Likely cause: that peer never called the "
            "attention for this batch, or raised before the first round (look for its error — e.g. a "
            "validation error on the first call), or it is dead; raise HSAP_P2P_TIMEOUT_S if it is only "
            "slow. This process group cannot be reused after this error."
        )
    bad = {}
    for p in peers:
        theirs, expected = got[p].tolist(), build_header(plan, kind, phase, p, rank)  # what p sends if it runs my plan
        if theirs[:5] != expected[:5] or theirs[6:] != expected[6:]:  # word 5 (phase) may differ
            bad[p] = _describe(sent[p], theirs)
    if bad:
        # Second small exchange, only between disagreeing pairs (symmetric: if p's header differs
        # from what I expect, mine differs from what p expects), so it pairs up too.
        vec = torch.tensor(input_vector(plan), dtype=torch.int64, device=device)
        inputs, lost = _exchange(chan, CONTROL_ROUNDS[1], {p: vec for p in bad}, "plan inputs", len(INPUT_NAMES), device)
        lines = []
        for p in sorted(bad):
            diff = "(inputs not received: " + lost[p] + ")" if p in lost else differing_inputs(plan, inputs[p].tolist())
            lines.append(f"peer {p} (global {glob[p]}): {bad[p]}; differing inputs: {diff}")
        raise RuntimeMismatchError(
            f"ranks run different plans ({where}): " + " | ".join(lines) + ". Every rank of a CP group must "
            "compile its plan from the same global cu_seqlens and the same compile_plan options (sizes, heads, "
            "dtype_bytes, pool_bytes, layout, ...); no payload was sent, the group is still usable"
        )
    table.put(h, True)
    return True

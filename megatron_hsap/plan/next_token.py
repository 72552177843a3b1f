"""Where each token's successor inside its document lives, in a plan's layout (multi-token prediction).

Megatron's multi-token prediction (MTP, ``--mtp-num-layers``) shifts token ids, labels, loss masks
and positions one token to the left per prediction depth, inside each document for packed batches
(the last token of a document gets 0). Megatron's own shift under CP assumes the zigzag split; in
HSAP's layout a rank holds runs of consecutive tokens in any order, so a run's last token finds its
successor at the start of a run on some rank (the same one or another). :func:`next_token_map`
says, for one CP rank, which local position reads which: from its own tokens, or from the buffer
every rank fills with the values at its run starts (one all-gather per shift,
``megatron_hsap/megatron/mtp.py``). Pure numpy; every rank computes the same tables from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsap.errors import PlanError

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["NextTokenMap", "next_token_map"]


@dataclass(frozen=True, slots=True)
class NextTokenMap:
    """One CP rank's successor table (int64 arrays of local positions).

    ``out[j] = x[j + 1]`` for ``j`` in ``local_dst`` (the successor is the next local token),
    ``out[j] = gathered[remote_src[k]]`` for ``j = remote_dst[k]``, where ``gathered`` is
    ``[cp_size · send_slots]``: rank ``r``'s values at its run starts ``send`` in slots
    ``r·send_slots …`` (padded to the longest rank's count); every other position is a document's
    last token and gets 0. ``exchange`` is False when no rank needs another rank's value (every
    run starts a document): then no rank calls the all-gather.
    """

    cp_size: int
    num_local: int
    local_dst: np.ndarray
    remote_dst: np.ndarray
    remote_src: np.ndarray
    send: np.ndarray  # [send_slots] local positions of this rank's run starts, padded with 0
    send_slots: int
    exchange: bool


def _run_heads(plan: "Plan", rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(global ids, local positions)`` of rank ``rank``'s run starts: from the layout's segments
    (no token listed: 64 ranks × 16K tokens took 60 ms listed), else from its token ids."""
    layout = getattr(plan, "layout", None)
    if layout is not None:
        return layout.run_heads(rank)
    ids = np.asarray(plan.local_token_indices(rank), dtype=np.int64)
    at = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1] + 1]) if ids.size else np.zeros(0, dtype=np.int64)
    return ids[at], at.astype(np.int64)


def next_token_map(plan: "Plan", cp_rank: int) -> NextTokenMap:
    """The successor table of CP rank ``cp_rank`` under ``plan`` (documents: ``plan.batch.doc_starts``,
    the padding one included). O(T log T) on the host, once per micro-batch and rank."""
    cp = plan.cp_size
    if not 0 <= cp_rank < cp:
        raise PlanError(f"cp_rank={cp_rank} out of range for a plan over {cp} CP ranks")
    runs = [_run_heads(plan, r) for r in range(cp)]
    slots = max((where.size for _, where in runs), default=0)
    doc_starts = np.asarray(plan.batch.doc_starts, dtype=np.int64)

    mine = np.asarray(plan.local_token_indices(cp_rank), dtype=np.int64)
    doc_end = doc_starts[np.searchsorted(doc_starts, mine, side="right")] if mine.size else mine
    has_next = mine + 1 < doc_end
    next_here = np.r_[mine[1:] == mine[:-1] + 1, False] if mine.size else has_next
    local_dst = np.flatnonzero(has_next & next_here)
    remote_dst = np.flatnonzero(has_next & ~next_here)

    # every run start of every rank, by global id, with its slot in the gathered buffer
    heads = np.concatenate([h for h, _ in runs])
    slot = np.concatenate([r * slots + np.arange(where.size) for r, (_, where) in enumerate(runs)])
    order = np.argsort(heads, kind="stable")
    heads, slot = heads[order], slot[order]
    want = mine[remote_dst] + 1
    at = np.minimum(np.searchsorted(heads, want), max(heads.size - 1, 0))
    if want.size and (heads.size == 0 or np.any(heads[at] != want)):
        raise PlanError("the plan's layout does not hold every token exactly once (a successor is no run's "
                        "start); this plan cannot be sharded")
    # a rank needs another's value only where a run starts inside a document (a listed head that
    # continues its predecessor's ids may ask for an exchange nobody needs: every rank agrees anyway)
    exchange = cp > 1 and bool(np.any(~np.isin(heads, doc_starts)))
    send = np.zeros(slots, dtype=np.int64)
    send[: runs[cp_rank][1].size] = runs[cp_rank][1]
    return NextTokenMap(
        cp_size=cp, num_local=int(mine.size),
        local_dst=local_dst.astype(np.int64),
        remote_dst=remote_dst.astype(np.int64), remote_src=slot[at].astype(np.int64) if want.size else np.zeros(0, np.int64),
        send=send, send_slots=slots, exchange=exchange,
    )

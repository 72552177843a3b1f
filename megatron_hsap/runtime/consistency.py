"""Do all ranks hold the same batch? A cheap fingerprint exchange that fails loudly instead of hanging.

Every rank of a CP group compiles its plan from the *global* ``cu_seqlens``; ranks that disagree
compile different plans whose P2P rounds do not pair up, and NCCL then hangs (or, worse, gloo
matches wrong messages). :func:`check_cu_seqlens_consistent` hashes ``cu_seqlens`` on the host and
all-gathers ``(hash, entries, T)`` — three int64 per rank, one small collective — so every rank
sees every fingerprint and raises the same :class:`BatchError` naming the ranks that differ. For an
HSAP topology pass ``(intra_group, inter_group)``: the exchange is nested so that it still reaches
every rank of the CP group.

Call it where the batch is sharded (``megatron_hsap.megatron.batch`` does), once per micro-batch
— never per layer. ``HSAP_DEBUG=1`` additionally makes the attention layer check its plan's
``cu_seqlens`` before every call (slow: one collective per layer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.runtime.env import read_env
from megatron_hsap.runtime.p2p import wait_collective

__all__ = ["check_cu_seqlens_consistent", "cu_seqlens_fingerprint", "fingerprint_mismatch"]

_INVALID = -1  # "entries" of a fingerprint whose cu_seqlens could not be read as integers


def cu_seqlens_fingerprint(cu_seqlens: object) -> tuple[int, int, int]:
    """``(hash, entries, T)`` of ``cu_seqlens`` (list, tuple, numpy array or tensor), on the host.

    Never raises: unreadable input gives ``entries = -1`` so that the exchange still happens on
    every rank and the error is raised everywhere at once.
    """
    try:
        if isinstance(cu_seqlens, torch.Tensor):
            values = cu_seqlens.detach().to("cpu", torch.int64).reshape(-1).numpy()
        else:
            arr = np.asarray(cu_seqlens)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                return (0, _INVALID, 0)
            values = arr.astype(np.int64)
    except (TypeError, ValueError, RuntimeError):
        return (0, _INVALID, 0)
    digest = hashlib.blake2b(values.tobytes(), digest_size=8).digest()
    h = int.from_bytes(digest, "little", signed=True)
    return (h, int(values.size), int(values[-1]) if values.size else 0)


def _exchange_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def fingerprint_mismatch(cu_seqlens: object, group: Any, *, timeout_s: float | None = None) -> str | None:
    """All-gather fingerprints (collective on every rank of the group(s)); the mismatch or None.

    ``group`` is one process group (None: the world), or a pair ``(intra, inter)`` of HSAP groups:
    then the rows gathered over ``intra`` are gathered again over ``inter``, so every rank of the
    whole ``P_intra × P_inter`` CP group sees all fingerprints in CP-rank order (checking the two
    groups one after the other would let ranks outside the differing ones pass, and hang later).
    In the pair, None stands for a side of size 1. Each all-gather has the deadline ``timeout_s``
    (default ``HSAP_P2P_TIMEOUT_S``): ``CommunicationError`` naming it when a peer never joins.
    """
    groups = tuple(group) if isinstance(group, (tuple, list)) else (group,)
    if len(groups) > 1 and all(g is None for g in groups):
        return None  # a 1×1 topology: nothing to compare
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("check_cu_seqlens_consistent needs torch.distributed to be initialised")
    sizes = [1 if g is None and len(groups) > 1 else dist.get_world_size(g) for g in groups]
    if all(n == 1 for n in sizes):
        return None
    device = next(_exchange_device(g) for g, n in zip(groups, sizes) if n > 1)
    if timeout_s is None:
        timeout_s = read_env().p2p_timeout_s
    rows = torch.tensor([[*cu_seqlens_fingerprint(cu_seqlens), dist.get_rank()]], dtype=torch.int64, device=device)
    for g, n in zip(groups, sizes):  # [1, 4] -> [P_intra, 4] -> [P_inter · P_intra, 4]
        if n == 1:
            continue
        parts = [torch.empty_like(rows) for _ in range(n)]
        work = dist.all_gather(parts, rows.contiguous(), group=g, async_op=True)
        wait_collective(work, timeout_s=timeout_s, collective="cu_seqlens fingerprint all_gather",
                        stage="batch consistency check", group=g, cpu=device.type == "cpu")
        rows = torch.cat(parts)
    table = [tuple(int(x) for x in row) for row in rows.cpu().tolist()]
    label = "CP ranks" if len(groups) > 1 else "group ranks"
    return _describe([r[:3] for r in table], [r[3] for r in table], label)


def _describe(prints: Sequence[tuple[int, ...]], global_ranks: Sequence[int], label: str) -> str | None:
    classes: dict[tuple[int, ...], list[int]] = {}
    for pos, fp in enumerate(prints):
        classes.setdefault(tuple(fp), []).append(pos)
    if len(classes) == 1 and next(iter(classes))[1] != _INVALID:
        return None
    parts = []
    for (_, entries, total), members in sorted(classes.items(), key=lambda kv: kv[1][0]):
        who = f"{label} {members} (global {[global_ranks[m] for m in members]})"
        if entries == _INVALID:
            parts.append(f"{who}: cu_seqlens is not a 1-D integer sequence")
        else:
            parts.append(f"{who}: {entries} entries, T={total}")
    return "; ".join(parts)


def check_cu_seqlens_consistent(cu_seqlens: object, group: Any = None, *, timeout_s: float | None = None) -> None:
    """Raise :class:`BatchError` on EVERY rank unless all hold the same ``cu_seqlens``.

    ``group``: the CP group (None: the world), or the pair ``(intra_group, inter_group)`` of an
    HSAP topology (one nested exchange covers the whole CP group). One or two all-gathers of four
    int64 per rank (a gloo/CPU group exchanges on the host; an NCCL group through one tiny device
    tensor). Call it on every rank, where the batch is sharded. The message lists which ranks hold
    which batch (entries and ``T``).
    """
    report = fingerprint_mismatch(cu_seqlens, group, timeout_s=timeout_s)
    if report is not None:
        raise BatchError(
            f"ranks of one context-parallel group hold different cu_seqlens: {report}. Every rank of a "
            "CP group must get the same global packed batch (same data-loader seed and sampler for the "
            "whole CP group); running on would hang in P2P or compute wrong attention"
        )

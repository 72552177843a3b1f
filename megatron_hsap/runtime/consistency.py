"""Do all ranks hold the same batch? A cheap fingerprint exchange that fails loudly instead of hanging.

Every rank of a CP group compiles its plan from the *global* ``cu_seqlens``; ranks that disagree
compile different plans whose P2P rounds do not pair up, and NCCL then hangs (or, worse, gloo
matches wrong messages). :func:`check_cu_seqlens_consistent` hashes ``cu_seqlens`` on the host and
all-gathers ``(hash, entries, T)`` — three int64 per rank, one small collective — so every rank
sees every fingerprint and raises the same :class:`BatchError` naming the ranks that differ.

Call it where the batch is sharded (``megatron_hsap.megatron.batch`` does), once per micro-batch
— never per layer. ``HSAP_DEBUG=1`` additionally makes the attention layer check its plan's
``cu_seqlens`` before every call (slow: one collective per layer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsap.errors import BatchError, ConfigError

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


def fingerprint_mismatch(cu_seqlens: object, group: dist.ProcessGroup | None) -> str | None:
    """All-gather fingerprints over ``group`` (collective); a description of the mismatch or None."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("check_cu_seqlens_consistent needs torch.distributed to be initialised")
    size = dist.get_world_size(group)
    if size == 1:
        return None
    mine = torch.tensor(cu_seqlens_fingerprint(cu_seqlens), dtype=torch.int64, device=_exchange_device(group))
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    prints = [tuple(int(x) for x in t.cpu().tolist()) for t in gathered]
    return _describe(prints, dist.get_process_group_ranks(group) if group is not None else list(range(size)))


def _describe(prints: Sequence[tuple[int, int, int]], global_ranks: Sequence[int]) -> str | None:
    classes: dict[tuple[int, int, int], list[int]] = {}
    for pos, fp in enumerate(prints):
        classes.setdefault(fp, []).append(pos)
    if len(classes) == 1 and next(iter(classes))[1] != _INVALID:
        return None
    parts = []
    for (_, entries, total), members in sorted(classes.items(), key=lambda kv: kv[1][0]):
        who = f"group ranks {members} (global {[global_ranks[m] for m in members]})"
        if entries == _INVALID:
            parts.append(f"{who}: cu_seqlens is not a 1-D integer sequence")
        else:
            parts.append(f"{who}: {entries} entries, T={total}")
    return "; ".join(parts)


def check_cu_seqlens_consistent(cu_seqlens: object, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`BatchError` on EVERY rank of ``group`` unless all hold the same ``cu_seqlens``.

    One all-gather of three int64 per rank over ``group`` (a gloo/CPU group exchanges on the host;
    an NCCL group through one tiny device tensor). Call it on every rank of the group, where the
    batch is sharded. The message lists which ranks hold which batch (entries and ``T``).
    """
    report = fingerprint_mismatch(cu_seqlens, group)
    if report is not None:
        raise BatchError(
            f"ranks of one context-parallel group hold different cu_seqlens: {report}. Every rank of a "
            "CP group must get the same global packed batch (same data-loader seed and sampler for the "
            "whole CP group); running on would hang in P2P or compute wrong attention"
        )

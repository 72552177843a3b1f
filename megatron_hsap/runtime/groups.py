"""The two process groups HSAP runs on, their rank layout, and this process's registry of them
(docs/design.md §1).

Torch only (no Megatron import), so the runtime and its tests can hold groups built by
``megatron_hsap.megatron.parallel_state`` or by hand. The registry (:func:`register_groups`,
:func:`registered_groups`, :func:`clear_groups`) is the one piece of global mutable state HSAP
keeps: ``initialize_hsap`` fills it, ``destroy_hsap`` clears it, and the runtime reads it here —
the runtime never looks up the Megatron sub-package (an upward arrow).

Layout: CP rank ``r = i·P_intra + j`` (``i`` inter index = node, ``j`` intra index = GPU in the
node). Intra groups are contiguous blocks of the CP rank list, inter groups are strided — exactly
Megatron's ``--hierarchical-context-parallel-sizes P_intra P_inter`` levels 0 and 1.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hsap.errors import ConfigError, RuntimeMismatchError
from megatron_hsap.plan.checks import positive_int
from megatron_hsap.plan.flatten import flattened_what

__all__ = ["HSAPGroups", "hierarchical_rank_lists", "validate_hsap_sizes", "job_timeout",
           "check_plan_groups", "register_groups", "registered_groups", "clear_groups"]


def job_timeout() -> datetime.timedelta | None:
    """The timeout HSAP's process groups are created with: the job's.

    Megatron's ``--distributed-timeout-minutes`` when Megatron's arguments are parsed, else the
    default group's own timeout (what ``init_process_group(timeout=...)`` got), else None
    (torch's default). ``new_group`` does not inherit the default group's timeout by itself: without
    this, HSAP's groups waited torch's 30 minutes whatever the job set.
    """
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    minutes = getattr(args, "distributed_timeout_minutes", None)
    if isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes > 0:
        return datetime.timedelta(minutes=minutes)
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d as c10d

        pg = c10d._get_default_group()
        device = torch.device("cpu") if "gloo" in str(dist.get_backend()).lower() else torch.device("cuda")
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # private API: fall back to torch's default
        return None


def validate_hsap_sizes(intra_size: object, inter_size: object, cp_size: int | None = None) -> None:
    """Raise :class:`ConfigError` unless both sizes are positive ints whose product is ``cp_size``."""
    intra_size = positive_int("intra_size (P_intra)", intra_size)
    inter_size = positive_int("inter_size (P_inter)", inter_size)
    if cp_size is not None and intra_size * inter_size != cp_size:
        raise ConfigError(
            f"intra_size × inter_size = {intra_size} × {inter_size} = {intra_size * inter_size} "
            f"but the context-parallel group has {cp_size} ranks; change intra_size/inter_size "
            f"(--hierarchical-context-parallel-sizes P_intra P_inter) so their product is {cp_size}, "
            f"or --context-parallel-size to {intra_size * inter_size}"
        )


def hierarchical_rank_lists(
    cp_ranks: Sequence[int], intra_size: int, inter_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Split one CP group's global ranks (in CP-rank order) into intra and inter rank lists.

    Returns ``(intra, inter)``: ``intra[i]`` = ``cp_ranks[i·P_intra : (i+1)·P_intra]`` (node ``i``),
    ``inter[j]`` = ``cp_ranks[j::P_intra]`` (GPU ``j`` of every node), in that creation order.
    """
    validate_hsap_sizes(intra_size, inter_size, len(cp_ranks))
    ranks = [int(r) for r in cp_ranks]
    intra = [ranks[i * intra_size : (i + 1) * intra_size] for i in range(inter_size)]
    inter = [ranks[j::intra_size] for j in range(intra_size)]
    return intra, inter


@dataclass(frozen=True, slots=True)
class HSAPGroups:
    """This rank's intra (all-to-all, NVLink) and inter (SAP P2P, InfiniBand) process groups.

    ``cp_link`` is the link the CP group really has (hostnames), which the planner prices in
    place of the GPUs-per-node rule of docs/design.md §4 when known. ``cp_rank = inter_rank · intra_size + intra_rank``; the group rank of this process in ``intra``
    is ``intra_rank`` and in ``inter`` is ``inter_rank``. ``cp_ranks`` (optional) lists the CP
    group's global ranks in CP-rank order, for mapping plan ranks to ``torch.distributed`` peers.
    """

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    intra_size: int
    inter_size: int
    cp_rank: int
    intra_rank: int
    inter_rank: int
    cp_ranks: tuple[int, ...] = ()
    # "nvlink" when every rank of the CP group runs on one host, "ib" when it spans hosts, from the
    # hostnames initialize_hsap exchanged; None when nobody looked (node_check off, hand-built groups).
    cp_link: str | None = None
    # the whole CP group (group rank = CP rank), on which a flattened 1 x P plan runs
    # (plan/flatten.py); None: not built (hand-made groups), and such plans are refused by name
    cp: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        validate_hsap_sizes(self.intra_size, self.inter_size)
        if self.cp_link not in (None, "nvlink", "ib"):
            raise ConfigError(f"cp_link={self.cp_link!r}; use 'nvlink', 'ib' or None")
        if not (0 <= self.intra_rank < self.intra_size and 0 <= self.inter_rank < self.inter_size):
            raise ConfigError(
                f"{self.intra_rank=} / {self.inter_rank=} out of range for "
                f"{self.intra_size=} × {self.inter_size=}"
            )
        if self.cp_rank != self.inter_rank * self.intra_size + self.intra_rank:
            raise ConfigError(
                f"{self.cp_rank=} != {self.inter_rank=} · {self.intra_size=} + {self.intra_rank=}"
            )
        if self.cp_ranks and len(self.cp_ranks) != self.cp_size:
            raise ConfigError(f"len(cp_ranks)={len(self.cp_ranks)} != {self.cp_size=}")

    @property
    def cp_size(self) -> int:
        return self.intra_size * self.inter_size

    @property
    def topology(self) -> str:
        """``"intra×inter"`` as the paper's Table 4 writes it, e.g. ``"2x4"``."""
        return f"{self.intra_size}x{self.inter_size}"

    def levels_for(self, plan: object, *, cp_rank: int | None = None) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """``(intra, inter)``: the groups ``plan`` runs on with these groups, after
        :func:`check_plan_groups` (no collective). A plan of their topology runs on theirs; a
        flattened one (``plan/flatten.py``) on the CP group as its one level: ``(None, cp)`` at
        ``1 × P`` (SAP alone), ``(cp, None)`` at ``P × 1`` (one all-to-all)."""
        check_plan_groups(plan, self, cp_rank=cp_rank)
        if plan.options.flattened_from is None:  # type: ignore[attr-defined]
            return self.intra, self.inter
        return (None, self.cp) if plan.intra_size == 1 else (self.cp, None)  # type: ignore[attr-defined]

    def intra_global_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's intra group, in intra-rank order (needs ``cp_ranks``)."""
        self._need_cp_ranks()
        start = self.inter_rank * self.intra_size
        return self.cp_ranks[start : start + self.intra_size]

    def inter_global_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's inter group, in inter-rank order (needs ``cp_ranks``)."""
        self._need_cp_ranks()
        return self.cp_ranks[self.intra_rank :: self.intra_size]

    def _need_cp_ranks(self) -> None:
        if not self.cp_ranks:
            raise ConfigError("HSAPGroups was built without cp_ranks; pass the CP group's global ranks")


def check_plan_groups(plan: object, groups: "HSAPGroups", *, cp_rank: int | None = None) -> None:
    """The one rule for running ``plan`` on ``groups``: the same topology (a flattened ``1 × P`` or
    ``P × 1`` plan: the groups it was flattened from, and their CP group built), and — when the caller
    knows which CP rank a batch was sharded for — this rank. Host-only, no collective.

    Raises :class:`ConfigError` for a topology mismatch (compile with the initialised sizes) and
    :class:`RuntimeMismatchError` for a batch sharded for another CP rank.
    """
    p_intra, p_inter = plan.intra_size, plan.inter_size  # type: ignore[attr-defined]
    flat = plan.options.flattened_from  # type: ignore[attr-defined]
    if (groups.intra_size, groups.inter_size) != (flat or (p_intra, p_inter)):
        what = f"flattened from {flat[0]}x{flat[1]}" if flat else f"{p_intra}x{p_inter} (intra×inter)"
        raise ConfigError(
            f"the plan is {what} but the HSAP groups are {groups.topology}; "
            f"compile the plan with intra_size={groups.intra_size}, inter_size={groups.inter_size}"
        )
    if flat and groups.cp is None:
        raise ConfigError(
            f"{flattened_what(plan)} but these HSAP groups carry no CP group (HSAPGroups.cp); build them with "
            "initialize_hsap, or compile with flatten='never'"
        )
    if cp_rank is not None and groups.cp_rank != cp_rank:
        raise RuntimeMismatchError(f"the batch was sharded for CP rank {cp_rank} but this is CP rank {groups.cp_rank}")


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class _Registration:
    groups: HSAPGroups
    owned: tuple[dist.ProcessGroup, ...]  # groups the registrant created, handed back by clear_groups


_REGISTERED: _Registration | None = None
_REGISTRY_LOCK = threading.Lock()  # initialize/destroy may race a prefetch thread reading the groups


def register_groups(groups: HSAPGroups, *, owned: Sequence[dist.ProcessGroup] = ()) -> None:
    """Make ``groups`` this process's HSAP groups (what ``hsap_attn_func`` uses without explicit
    groups). ``owned`` lists the process groups the caller created, so that :func:`clear_groups`
    hands them back for destruction. Host-only, no collective.

    Raises :class:`ConfigError` when groups are registered already: clear them first
    (``destroy_hsap()``), so that a second ``initialize_hsap`` never silently replaces the first.
    """
    global _REGISTERED
    if not isinstance(groups, HSAPGroups):
        raise ConfigError(f"register_groups takes an HSAPGroups, got {type(groups).__name__}")
    with _REGISTRY_LOCK:
        if _REGISTERED is not None:
            raise ConfigError(
                f"HSAP groups are already initialised ({_REGISTERED.groups.topology}); call destroy_hsap() first"
            )
        _REGISTERED = _Registration(groups=groups, owned=tuple(owned))


def registered_groups() -> HSAPGroups | None:
    """This process's registered :class:`HSAPGroups`, or None before :func:`register_groups`."""
    reg = _REGISTERED
    return None if reg is None else reg.groups


def clear_groups() -> tuple[dist.ProcessGroup, ...]:
    """Forget the registered groups; return the process groups their registrant owned (empty when
    nothing was registered). Idempotent."""
    global _REGISTERED
    with _REGISTRY_LOCK:
        reg, _REGISTERED = _REGISTERED, None
    return () if reg is None else reg.owned

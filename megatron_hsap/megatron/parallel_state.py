"""HSAP's extension of Megatron's ``parallel_state``: the intra and inter groups (docs/design.md §1, §2.3).

``initialize_hsap(intra_size, inter_size)`` after ``parallel_state.initialize_model_parallel``
reads the CP group and tensor-parallel size from Megatron, reuses Megatron's hierarchical CP groups
when ``--hierarchical-context-parallel-sizes`` matches, builds the groups otherwise, and checks
that every intra group sits on one host. It also works with Megatron absent or not initialised
(pass ``cp_group`` / ``cp_ranks``, or the whole world is the CP group) — megatron-core is only
looked up in ``sys.modules``, never imported here.

Order of operations, so that a misconfiguration can never hang:
1. local validation (sizes, CP ranks, TP × P_intra vs GPUs per node) — raises before any collective;
2. one ``all_gather_object`` over the world of (CP ranks, hostname) — every rank then holds the same
   facts, so the CP-group consistency and node checks raise on every rank alike;
3. ``new_group`` for every intra then every inter group of every CP group of the world, in the same
   order on every rank (``new_group`` is collective over the world).

The groups go into the runtime's registry (``runtime/groups.register_groups``), which the runtime
reads; ``get_hsap_groups`` / ``is_hsap_initialized`` / ``destroy_hsap`` are this sub-package's
names for reading and clearing it.
"""

from __future__ import annotations

import enum
import socket
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch.distributed as dist

from megatron_hsap.errors import ConfigError, RuntimeMismatchError
from megatron_hsap.plan.checks import divisors, positive_int
from megatron_hsap.runtime.groups import (HSAPGroups, clear_groups, hierarchical_rank_lists, job_timeout, register_groups,
                                          registered_groups, validate_hsap_sizes)  # fmt: skip

__all__ = [
    "NodeCheck",
    "initialize_hsap",
    "get_hsap_groups",
    "is_hsap_initialized",
    "destroy_hsap",
]

_MEGATRON_PS = "megatron.core.parallel_state"


class NodeCheck(enum.Enum):
    """What to do when an intra group spans hosts: raise, warn, or skip the hostname exchange."""

    ERROR = "error"
    WARN = "warn"
    OFF = "off"


# --------------------------------------------------------------------------- public API


def initialize_hsap(
    intra_size: int,
    inter_size: int,
    *,
    cp_group: dist.ProcessGroup | None = None,
    cp_ranks: Sequence[int] | None = None,
    tp_size: int | None = None,
    gpus_per_node: int | None = None,
    node_check: NodeCheck | str = NodeCheck.ERROR,
    hostname_fn: Callable[[], str] | None = None,
) -> HSAPGroups:
    """Build (or reuse Megatron's) intra and inter groups for topology ``intra_size × inter_size``.

    Call on every rank of the world with the same sizes. CP ranks come from ``cp_ranks`` (this
    rank's CP group, global ranks in CP-rank order), else ``cp_group``, else Megatron's CP group
    when Megatron is initialised, else the whole world. ``tp_size`` defaults to Megatron's
    tensor-parallel size (1 without Megatron). ``gpus_per_node``, when given, is checked
    arithmetically: TP × P_intra must divide it. ``node_check`` decides what an intra group spanning
    hosts does (``hostname_fn`` replaces ``socket.gethostname`` for tests).

    Raises :class:`ConfigError` naming the setting to change; returns this rank's :class:`HSAPGroups`.
    """
    current = registered_groups()
    if current is not None:
        raise ConfigError(f"HSAP groups are already initialised ({current.topology}); call destroy_hsap() first")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group "
            "(or Megatron's initialize_model_parallel) before initialize_hsap"
        )
    mode = _node_check_mode(node_check)
    validate_hsap_sizes(intra_size, inter_size)
    mpu = _megatron_parallel_state()
    meg_cp_group = mpu.get_context_parallel_group(check_initialized=False) if mpu else None

    # 1. Local validation: nothing below may raise on some ranks only once a collective started.
    rank, world = dist.get_rank(), dist.get_world_size()
    if cp_ranks is not None:
        ranks = [int(r) for r in cp_ranks]
        if cp_group is not None and ranks != dist.get_process_group_ranks(cp_group):
            raise ConfigError(
                f"cp_ranks={ranks} disagree with cp_group's ranks "
                f"{dist.get_process_group_ranks(cp_group)}; pass one of them"
            )
    elif cp_group is not None:
        ranks = list(dist.get_process_group_ranks(cp_group))
    elif meg_cp_group is not None:
        cp_group = meg_cp_group
        ranks = list(mpu.get_context_parallel_global_ranks())
    else:
        ranks = list(range(world))
    _check_cp_ranks(ranks, rank, world)
    validate_hsap_sizes(intra_size, inter_size, len(ranks))
    tp = _resolve_tp_size(tp_size, mpu)
    _check_gpus_per_node(tp, intra_size, len(ranks), gpus_per_node)
    reused = _megatron_hierarchical_groups(mpu, ranks, cp_group, meg_cp_group, intra_size, inter_size)

    # 2. One object all-gather: every rank learns every CP group and every hostname.
    host = "" if mode is NodeCheck.OFF else str((hostname_fn or socket.gethostname)())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (tuple(ranks), host))
    all_cp = _all_cp_groups([tuple(g[0]) for g in gathered])
    cp_link = None
    if mode is not NodeCheck.OFF:
        _node_check([g[1] for g in gathered], all_cp, intra_size, inter_size, rank, mode)
        cp_link = "nvlink" if len({gathered[r][1] for r in ranks}) == 1 else "ib"

    # 3. Groups: Megatron's when its hierarchical CP groups have our sizes, ours otherwise.
    cp_rank = ranks.index(rank)
    inter_rank, intra_rank = divmod(cp_rank, intra_size)
    if reused is not None:
        intra, inter = reused
        owned: tuple[dist.ProcessGroup, ...] = ()
    else:
        intra, inter, owned = _create_groups(all_cp, intra_size, inter_size, rank)
        # gloo connects a new group's pairs eagerly and each rank returns once its own side is up:
        # without this barrier a rank that destroys its groups at once (a re-initialisation, a
        # test) can close a pair a slower peer is still connecting ("connection closed by peer").
        dist.barrier()
    if dist.get_rank(intra) != intra_rank or dist.get_rank(inter) != inter_rank:
        raise RuntimeMismatchError(
            f"rank {rank}: group ranks (intra {dist.get_rank(intra)}, inter {dist.get_rank(inter)}) "
            f"differ from the layout's ({intra_rank}, {inter_rank})"
        )
    cp, made = _cp_group(cp_group, ranks, world, all_cp, rank)
    owned += made
    groups = HSAPGroups(
        intra=intra,
        inter=inter,
        intra_size=intra_size,
        inter_size=inter_size,
        cp_rank=cp_rank,
        intra_rank=intra_rank,
        inter_rank=inter_rank,
        cp_ranks=tuple(ranks),
        cp_link=cp_link,
        cp=cp,
    )
    register_groups(groups, owned=owned)  # the runtime reads them there (runtime/groups.py)
    return groups


def get_hsap_groups() -> HSAPGroups:
    """This rank's :class:`HSAPGroups`; raises :class:`ConfigError` before :func:`initialize_hsap`."""
    groups = registered_groups()
    if groups is None:
        raise ConfigError(
            "HSAP groups are not initialised; call megatron_hsap.megatron.initialize_hsap("
            "intra_size=..., inter_size=...) after parallel_state.initialize_model_parallel"
        )
    return groups


def is_hsap_initialized() -> bool:
    return registered_groups() is not None


def destroy_hsap() -> None:
    """Forget the HSAP groups (destroying those HSAP created) so :func:`initialize_hsap` can run again.

    Also clears Megatron's hierarchical CP groups global when megatron-core is loaded: Megatron's
    ``destroy_model_parallel`` leaves it set, and a stale value would be reused by the next run.
    Idempotent; call it on every rank.
    """
    owned = clear_groups()
    if owned and dist.is_available() and dist.is_initialized():
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already gone with the default group: nothing to free
                pass
    mpu = _megatron_parallel_state()
    if mpu is not None and hasattr(mpu, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"):
        mpu._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None


# --------------------------------------------------------------------------- helpers


def _megatron_parallel_state() -> ModuleType | None:
    """Megatron's parallel_state if something already imported it (never imports it here)."""
    return sys.modules.get(_MEGATRON_PS)


def _node_check_mode(node_check: NodeCheck | str) -> NodeCheck:
    try:
        return NodeCheck(node_check)
    except ValueError:
        raise ConfigError(
            f"node_check={node_check!r}; use one of {[m.value for m in NodeCheck]}"
        ) from None


def _check_cp_ranks(ranks: list[int], rank: int, world: int) -> None:
    if any(r < 0 or r >= world for r in ranks):
        raise ConfigError(f"CP ranks {ranks} must be global ranks in [0, {world})")
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        # Group ranks follow global order, so CP-rank order must too for r = i·P_intra + j to hold.
        raise ConfigError(f"CP ranks {ranks} must be distinct and ascending (CP-rank order)")
    if rank not in ranks:
        raise ConfigError(f"rank {rank} is not in its own CP group {ranks}; pass this rank's cp_ranks")


def _resolve_tp_size(tp_size: int | None, mpu: ModuleType | None) -> int:
    meg_tp = None
    if mpu is not None and mpu.get_tensor_model_parallel_group(check_initialized=False) is not None:
        meg_tp = mpu.get_tensor_model_parallel_world_size()
    if tp_size is None:
        return 1 if meg_tp is None else int(meg_tp)
    tp_size = positive_int("tp_size", tp_size)
    if meg_tp is not None and tp_size != meg_tp:
        raise ConfigError(
            f"tp_size={tp_size} but Megatron's --tensor-model-parallel-size is {meg_tp}; "
            "drop tp_size to use Megatron's"
        )
    return tp_size


def _check_gpus_per_node(tp: int, intra_size: int, cp_size: int, gpus_per_node: int | None) -> None:
    """CP ranks are spaced by TP, so an intra group covers TP × P_intra consecutive GPUs."""
    if gpus_per_node is None:
        return
    positive_int("gpus_per_node", gpus_per_node)
    if gpus_per_node % (tp * intra_size):
        valid = [p for p in divisors(cp_size) if gpus_per_node % (tp * p) == 0]
        raise ConfigError(
            f"tensor-parallel size × intra_size = {tp} × {intra_size} = {tp * intra_size} does not "
            f"divide gpus_per_node={gpus_per_node}, so an intra (all-to-all) group would span nodes; "
            f"change intra_size (P_intra, first of --hierarchical-context-parallel-sizes) to one of "
            f"{valid}, adjusting inter_size so the product stays {cp_size}, or "
            "--tensor-model-parallel-size"
        )


def _all_cp_groups(reported: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Every CP group of the world, ordered by first rank; each member must report the same group."""
    groups = sorted(set(reported), key=lambda g: g[0])
    bad = [
        f"rank {m} reports {reported[m]} but rank {g[0]} reports {g}"
        for g in groups
        for m in g
        if reported[m] != g
    ]
    if bad:
        raise ConfigError(
            "ranks disagree about their CP groups (pass the same cp_ranks on all members): "
            + "; ".join(bad[:8])
        )
    return groups


def _node_check(
    hosts: list[str],
    all_cp: list[tuple[int, ...]],
    intra_size: int,
    inter_size: int,
    rank: int,
    mode: NodeCheck,
) -> None:
    """Raise (or warn on the affected ranks) when any intra group's ranks sit on several hosts."""
    problems: list[str] = []
    affected: set[int] = set()
    for cp in all_cp:
        for block in hierarchical_rank_lists(cp, intra_size, inter_size)[0]:
            if len({hosts[r] for r in block}) > 1:
                per_host: dict[str, list[int]] = {}
                for r in block:
                    per_host.setdefault(hosts[r], []).append(r)
                problems.append(f"intra group ranks {block} span hosts {per_host}")
                affected.update(block)
    if not problems:
        return
    message = (
        f"{len(problems)} intra (all-to-all) group(s) span hosts: " + "; ".join(problems[:8])
        + f". Lower intra_size (P_intra = {intra_size}, first of --hierarchical-context-parallel-sizes) "
        "so tensor-parallel size × P_intra divides the GPUs per node, or place ranks node-major; "
        "node_check='warn' (--hsap-node-check warn) runs anyway, with all-to-alls over the network"
    )
    if mode is NodeCheck.ERROR:
        raise ConfigError(message)
    if rank in affected:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _megatron_hierarchical_groups(
    mpu: ModuleType | None,
    ranks: list[int],
    cp_group: dist.ProcessGroup | None,
    meg_cp_group: dist.ProcessGroup | None,
    intra_size: int,
    inter_size: int,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """Megatron's (level 0, level 1) hierarchical CP groups when they are ours; None otherwise."""
    if mpu is None or meg_cp_group is None or cp_group not in (None, meg_cp_group):
        return None
    if ranks != list(mpu.get_context_parallel_global_ranks()):
        return None
    levels = mpu.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not levels:
        return None
    sizes = [dist.get_world_size(g) for g in levels]
    if sizes != [intra_size, inter_size]:
        warnings.warn(
            f"Megatron's --hierarchical-context-parallel-sizes {sizes} differ from HSAP's "
            f"{intra_size} {inter_size}; HSAP builds its own groups",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    intra_lists, inter_lists = hierarchical_rank_lists(ranks, intra_size, inter_size)
    rank = dist.get_rank()
    want = ([b for b in intra_lists if rank in b][0], [b for b in inter_lists if rank in b][0])
    got = (dist.get_process_group_ranks(levels[0]), dist.get_process_group_ranks(levels[1]))
    if [list(g) for g in got] != [list(w) for w in want]:
        raise RuntimeMismatchError(
            f"rank {rank}: Megatron's hierarchical CP groups {got} differ from the HSAP layout {want}"
        )
    return levels[0], levels[1]


def _cp_group(cp_group: dist.ProcessGroup | None, ranks: list[int], world: int, all_cp: list[tuple[int, ...]],
              rank: int) -> tuple[dist.ProcessGroup | None, tuple[dist.ProcessGroup, ...]]:
    """The whole CP group a flattened ``1 × P`` plan runs on (``HSAPGroups.cp``, plan/flatten.py) and
    the groups created for it: the given (or Megatron's) CP group, the world when it is the CP
    group, else one ``new_group`` per CP group (collective: the same branch and order on every
    rank). None when its group ranks are not the CP ranks (a CP rank list out of global order):
    flattened plans are then refused by name (``check_plan_groups``)."""
    made: tuple[dist.ProcessGroup, ...] = ()
    if cp_group is None and ranks == list(range(world)):
        cp_group = dist.group.WORLD
    if cp_group is None:
        timeout = job_timeout()
        for members in all_cp:
            group = dist.new_group(list(members), timeout=timeout, group_desc="HSAP_CP")
            if rank in members:
                cp_group, made = group, (group,)
        dist.barrier()  # as after _create_groups: gloo pairs up before any rank may destroy them
    assert cp_group is not None  # rank is in its own CP group (checked)
    return (cp_group if dist.get_rank(cp_group) == ranks.index(rank) else None), made


def _create_groups(
    all_cp: list[tuple[int, ...]], intra_size: int, inter_size: int, rank: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, tuple[dist.ProcessGroup, ...]]:
    """``new_group`` for every CP group's intra blocks then inter strides, same order on all ranks."""
    intra = inter = None
    timeout = job_timeout()  # Megatron's --distributed-timeout-minutes, else the job's (torch's 30 min otherwise)
    for cp in all_cp:
        intra_lists, inter_lists = hierarchical_rank_lists(cp, intra_size, inter_size)
        for ranks in intra_lists:
            group = dist.new_group(ranks, timeout=timeout, group_desc="HSAP_INTRA")
            if rank in ranks:
                intra = group
        for ranks in inter_lists:
            group = dist.new_group(ranks, timeout=timeout, group_desc="HSAP_INTER")
            if rank in ranks:
                inter = group
    assert intra is not None and inter is not None  # rank is in its own CP group (checked)
    return intra, inter, (intra, inter)

"""What every CP rank of a micro-batch agrees on before batch sharding (``megatron/batch.py``).

* :func:`check_consistent` — the ``cu_seqlens`` fingerprint exchange over the CP group (host-side
  fingerprint, ``runtime/consistency.py``); raises the same ``BatchError`` on every rank.
* :func:`agree_before_sharding` — the plan handshake (``runtime/handshake.py``, issue 18) on HSAP's
  inter and intra groups, run in the batch function (issue 16 item 3): the attention's first round
  then finds the plan agreed (cached by hash) and waits on no exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from megatron_hsap.errors import BatchError, ConfigError

if TYPE_CHECKING:
    from megatron_hsap.plan import Plan

__all__ = ["check_consistent", "agree_before_sharding"]


def check_consistent(cu: np.ndarray, check_group: Any, groups: Any, cp_size: int) -> None:
    """Fingerprint exchange of ``cu_seqlens`` over the CP ranks (host side); raises on every rank."""
    if cp_size == 1 or check_group is False:
        return
    from megatron_hsap.runtime import check_cu_seqlens_consistent

    if check_group is not None:
        check_cu_seqlens_consistent(cu, check_group)
    elif (meg := _megatron_cp_group()) is not None:
        check_cu_seqlens_consistent(cu, meg)
    elif groups is not None:
        _check_over_intra_and_inter(cu, groups)
    elif dist.is_initialized() and dist.get_world_size() == cp_size:
        check_cu_seqlens_consistent(cu, None)  # the default group is the CP group
    else:
        raise ConfigError(
            "cannot tell which ranks share this batch: pass check_group=<CP group>, call "
            "initialize_hsap(...), or check_group=False to skip the consistency check"
        )


def _check_over_intra_and_inter(cu: np.ndarray, groups: Any) -> None:
    """The CP group is not available as one group: compare within every intra and every inter
    group, then spread the verdict over intra then inter. (i, j) and (i', j') are linked through
    (i, j') by one intra and one inter hop, so two rounds reach every CP rank and all of them raise
    together — a rank whose own groups agree must not run on into a P2P round alone."""
    from megatron_hsap.runtime.consistency import fingerprint_mismatch

    reports = [fingerprint_mismatch(cu, g) for g in (groups.intra, groups.inter)]
    bad = any(r is not None for r in reports)
    for g in (groups.intra, groups.inter):
        # Verdicts that differ inside g mean some member saw a mismatch: then all of g has one.
        # (The exchange runs on every rank: never short-circuit a collective.)
        spread = fingerprint_mismatch(np.asarray([int(bad)]), g) is not None
        bad = bad or spread
    if bad:
        detail = "; ".join(r for r in reports if r) or "another rank of this CP group holds a different batch"
        raise BatchError(
            f"ranks of one context-parallel group hold different cu_seqlens: {detail}. Every rank of a CP "
            "group must get the same global packed batch (same data-loader seed and sampler)"
        )


def agree_before_sharding(plan: "Plan", groups: Any, check_group: Any) -> None:
    """The plan handshake (``runtime/handshake.py``) here, in the batch function, on HSAP's inter
    then intra group (a flattened plan, plan/flatten.py: on the CP group it runs on): the
    attention's first round finds the plan agreed (cached by hash and group) and waits
    on no exchange. Skipped with ``check_group=False`` or without HSAP groups (the executor then
    runs it before its first round)."""
    if groups is None or check_group is False or plan.cp_size == 1:
        return
    from megatron_hsap.plan.ir import Phase
    from megatron_hsap.runtime.consistency import _exchange_device as exchange_device
    from megatron_hsap.runtime.env import read_env
    from megatron_hsap.runtime.handshake import agree

    timeout_s = read_env().p2p_timeout_s
    intra, inter = groups.levels_for(plan)  # a flattened plan (plan/flatten.py): the CP group, its one level
    for kind, group, size in (("inter", inter, plan.inter_size), ("intra", intra, plan.intra_size)):
        if size > 1:
            agree(plan, group, kind, Phase.FWD, timeout_s=timeout_s, device=exchange_device(group))


def _megatron_cp_group() -> Any:
    import sys

    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    group = mpu.get_context_parallel_group(check_initialized=False)
    return group if group is not None and group.size() > 1 else None

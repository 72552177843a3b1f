"""The worker side of the gloo test pool (``tests/distributed.py``): the body each spawned rank
runs (``_worker_main``: init gloo over the loopback file store, then run pickled cases until told
to stop), the per-case cleanup that keeps cases from leaking into each other, and
:func:`cached_group`, the one kind of process group that outlives a case. The parent side —
spawning, dispatch, timeouts, stack dumps — and the contract of a case are in
``tests/distributed.py``, which re-exports the public names."""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

__all__ = ["PoolError", "cached_group"]

# Collectives never time out by themselves: the parent's per-case timeout is the one clock.
_GLOO_TIMEOUT = datetime.timedelta(hours=2)


class PoolError(RuntimeError):
    """The pool itself failed: a rank died, could not start, or a value could not be pickled."""


_GROUPS: dict[tuple[int, ...], Any] = {}


def cached_group(ranks: tuple[int, ...]) -> Any:
    """Return a gloo ``ProcessGroup`` over ``ranks``, created once per worker and reused.

    Call it INSIDE a case, on every rank of the pool, in the same order on all ranks
    (``dist.new_group`` is collective over the default group, as in Megatron). Non-members get
    ``GroupMember.NON_GROUP_MEMBER``, exactly like ``dist.new_group``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise PoolError("cached_group() is meant to be called inside a GlooPool case")
    key = tuple(sorted(int(r) for r in ranks))
    world = dist.get_world_size()
    if not key or len(set(key)) != len(key) or key[0] < 0 or key[-1] >= world:
        raise ValueError(f"cached_group({ranks=}): need distinct ranks in [0, {world})")
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(list(key), backend="gloo", timeout=_GLOO_TIMEOUT)
        _GROUPS[key] = group
    return group


def _live_groups() -> set[Any]:
    """Every process group this rank belongs to (torch's registry; the default group included)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _cleanup_after_case(case_id: int, default_dtype: Any, grad_enabled: bool, groups_before: set[Any]) -> None:
    """Undo global state a case may leave behind, so cases cannot leak into each other.

    Megatron's ``destroy_model_parallel`` forgets its groups without destroying them; each
    ``initialize_model_parallel`` at world 4 would leak ~100 sockets per rank, so groups a case
    created (other than ``cached_group``'s) are destroyed here — once every rank has finished the
    case: gloo connects a new group eagerly, and a rank destroying it while a slower peer is still
    in ``new_group`` makes that peer fail ("connection closed by peer").
    """
    import torch
    import torch.distributed as dist

    torch.set_default_dtype(default_dtype)
    torch.set_grad_enabled(grad_enabled)
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    keep = groups_before | set(_GROUPS.values())
    doomed = _live_groups() - keep
    # every rank waits, even one holding none of the groups (a group of a subset of the ranks)
    _store_barrier(f"hsap_pool_cleanup/{case_id}")
    for group in doomed:
        dist.destroy_process_group(group)


def _store_barrier(key: str, timeout_s: float = 120.0) -> None:
    """Wait until every rank has reached ``key``, through the rendezvous store rather than gloo
    (a case may leave its groups unusable). A peer stuck past ``timeout_s`` is the parent's to
    diagnose (it times the case out and respawns the pool), so this gives up quietly."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.002)


def _worker_main(
    rank: int, world_size: int, store_path: str, conn: Any, sys_path: list[str], dump_path: str
) -> None:
    """Body of one rank: init gloo, then run cases received on ``conn`` until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    dump = open(dump_path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the rank
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        from megatron_hsap.runtime.rendezvous import init_local_process_group

        init_local_process_group(rank, world_size, store_path, timeout_s=_GLOO_TIMEOUT.total_seconds())
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send_bytes(pickle.dumps(("init-error", rank, traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", rank, os.getpid())))

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # parent is gone
            break
        if message == b"stop":
            break
        case_id, payload = pickle.loads(message)[1:]
        default_dtype, grad_enabled = torch.get_default_dtype(), torch.is_grad_enabled()
        groups_before = _live_groups()
        reply: tuple[Any, ...]
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - report SystemExit & co. too
            reply = ("raised", rank, case_id, _pickle_exception(exc), traceback.format_exc())
        else:
            try:
                reply = ("ok", rank, case_id, pickle.dumps(result))
            except Exception as exc:  # noqa: BLE001
                reply = (
                    "raised", rank, case_id, None,
                    f"PoolError: the return value on rank {rank} could not be pickled "
                    f"(return plain data or detached tensors): {type(exc).__name__}: {exc}\n",
                )
        try:
            _cleanup_after_case(case_id, default_dtype, grad_enabled, groups_before)
        except Exception:  # noqa: BLE001 - a broken cleanup must not kill the rank silently
            reply = ("raised", rank, case_id, None, "cleanup after the case failed:\n" + traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))

    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _pickle_exception(exc: BaseException) -> bytes | None:
    """Pickle ``exc`` if it round-trips (custom ``__init__`` signatures often do not)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001
        return None
    return data

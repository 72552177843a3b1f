"""The shared gloo pool: collectives, error propagation, hang recovery, cached groups."""

from __future__ import annotations

import os
import time

import pytest

from tests.distributed import PoolError, PoolTimeoutError, RemoteTraceback, cached_group


class CaseError(ValueError):
    """A distinct type, so the test knows the original exception came back (not a wrapper)."""


def _all_reduce_rank_ids() -> tuple[int, float, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.getpid()


def _raise_on(rank: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise CaseError(f"boom from rank {rank}")
    return dist.get_rank()


def _raise_everywhere() -> None:
    import torch.distributed as dist

    raise CaseError(f"every rank fails, this is {dist.get_rank()}")


def _hang_on_rank0() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3600)  # stands in for a collective that the other ranks never join
    dist.barrier()


def _group_sums(ranks: tuple[int, ...]) -> tuple[float | None, bool]:
    import torch
    import torch.distributed as dist

    group = cached_group(ranks)
    same = cached_group(tuple(reversed(ranks))) is group  # cached, and order-insensitive
    if dist.get_rank() not in ranks:
        return None, same
    t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item(), same


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _leave_state_behind() -> float:
    """Creates an uncached group and changes torch globals; the pool must undo all of it."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1], backend="gloo")
    t = torch.ones(1, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return t.item() + cached_group((0, 1)).size()


def _torch_globals() -> tuple[str, bool]:
    import torch

    return str(torch.get_default_dtype()), torch.is_grad_enabled()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce(gloo_pool, world_size):
    results = gloo_pool(world_size).run(_all_reduce_rank_ids)
    expected_sum = world_size * (world_size + 1) / 2  # integers in float64: exact
    assert [r[0] for r in results] == list(range(world_size))
    assert [r[1] for r in results] == [expected_sum] * world_size
    # A second case reuses the same processes (the whole point of the pool).
    again = gloo_pool(world_size).run(_all_reduce_rank_ids)
    assert [r[2] for r in again] == [r[2] for r in results]


def test_exception_names_rank_and_keeps_type(gloo_pool):
    pool = gloo_pool(2)
    with pytest.raises(CaseError, match="boom from rank 1") as info:
        pool.run(_raise_on, 1)
    assert any("rank 1 of world 2" in note for note in info.value.__notes__)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "_raise_on" in info.value.__cause__.tb  # the worker-side frame is shown
    # Only rank 1 failed, so the pool was respawned; it must work afterwards.
    assert [r[1] for r in pool.run(_all_reduce_rank_ids)] == [3.0, 3.0]


def test_symmetric_failure_keeps_pool(gloo_pool):
    pool = gloo_pool(2)
    pids = [r[2] for r in pool.run(_all_reduce_rank_ids)]
    with pytest.raises(CaseError, match="this is 0"):
        pool.run(_raise_everywhere)
    assert [r[2] for r in pool.run(_all_reduce_rank_ids)] == pids


def test_timeout_restarts_pool(gloo_pool):
    pool = gloo_pool(2)
    restarts = pool.restarts
    with pytest.raises(PoolTimeoutError, match=r"did not finish within 2 s on ranks \[0, 1\]") as info:
        pool.run(_hang_on_rank0, timeout=2.0)
    assert "_hang_on_rank0" in str(info.value)  # the stuck ranks' stacks are in the message
    assert pool.restarts == restarts + 1
    assert [r[1] for r in pool.run(_all_reduce_rank_ids)] == [3.0, 3.0]


@pytest.mark.parametrize("ranks", [(0, 2), (1, 2, 3)])
def test_cached_group(gloo_pool, ranks):
    results = gloo_pool(4).run(_group_sums, ranks)
    for rank, (value, same) in enumerate(results):
        assert same
        assert value == (float(sum(ranks)) if rank in ranks else None)


def test_rejects_closures(gloo_pool):
    with pytest.raises(PoolError, match="module-level"):
        gloo_pool(2).run(lambda: 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_cases_do_not_leak_groups_or_globals(gloo_pool):
    pool = gloo_pool(2)
    assert pool.run(_leave_state_behind) == [4.0, 4.0]  # warm-up: creates the cached group once
    before = pool.run(_open_fds)
    for _ in range(3):
        assert pool.run(_leave_state_behind) == [4.0, 4.0]
    assert pool.run(_open_fds) == before  # each uncached group's sockets were closed
    assert pool.run(_torch_globals) == [("torch.float32", True)] * 2


_DESTROY_SAW: list[bool] = []  # per worker process: what rank 0's cleanup saw when it destroyed


def _fresh_group_slow_last_rank(delay_s: float) -> None:
    """Every rank makes a group the pool will destroy; the last rank finishes ``delay_s`` late.
    Rank 0 records, at the moment the pool destroys that group, whether the last rank was done."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = "pool_test_last_rank_done"
    dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(delay_s)
        store.set(key, "1")
    if dist.get_rank() == 0:
        real = dist.destroy_process_group

        def recording(group=None):
            _DESTROY_SAW.append(store.check([key]))
            dist.destroy_process_group = real
            return real(group)

        dist.destroy_process_group = recording


def _destroy_saw() -> list[bool]:
    import torch.distributed as dist

    seen = list(_DESTROY_SAW)
    _DESTROY_SAW.clear()
    dist.barrier()
    if dist.get_rank() == 0:
        dist.distributed_c10d._get_default_store().delete_key("pool_test_last_rank_done")
    return seen


def test_cleanup_destroys_a_cases_groups_only_after_every_rank_finished(gloo_pool):
    # a rank destroying a fresh gloo group while a slower peer is still connecting it makes the
    # peer's new_group fail ("connection closed by peer"): the cleanup waits for every rank first
    pool = gloo_pool(2)
    pool.run(_fresh_group_slow_last_rank, 0.3)
    assert pool.run(_destroy_saw)[0] == [True]

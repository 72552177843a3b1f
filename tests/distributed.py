"""A long-lived pool of gloo ranks for multi-rank tests.

Importing torch and Megatron in a fresh rank costs 5-15 s, so ranks are spawned once per world
size for the whole pytest session and reused by every case::

    def _allreduce(x):                     # module level: pickled by reference
        t = torch.tensor([x * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def test_sum(gloo_pool):
        assert gloo_pool(4).run(_allreduce, 1.0) == [10.0] * 4

Contract of a case ``fn``:
- a module-level function of an importable module (a test module, ``tests/cases/*.py``); its
  args/kwargs and return value are pickled (tensors are copied, detach those requiring grad);
- it runs on every rank at once, after ``dist.init_process_group("gloo")`` and
  ``torch.set_num_threads(1)``; the rendezvous is a file store in a private temporary directory and
  gloo is pinned to the loopback interface (``megatron_hsap.runtime.rendezvous``): nothing listens
  beyond 127.0.0.1 (a TCPStore master binds every interface);
- it must leave the default group usable: issue the same collectives on every rank. A case that
  hangs past ``timeout`` gets its ranks' Python stacks dumped into the error, and the pool is
  killed and respawned. A case that raises on *some* ranks only also respawns the pool (the
  others may be stuck in a collective, or hold unmatched P2P messages);
- each case starts from the same state: after it, Megatron's ``parallel_state`` is destroyed if
  it was left initialised, and every process group the case created is destroyed (only
  :func:`cached_group` groups outlive a case), as are changes to torch's default dtype and grad mode.

Everything here runs on CPU; nothing imports torch at module import time, so spawning a worker
only pays for what the cases import. This module is the parent side; what each rank runs
(``_worker_main``, the per-case cleanup, :func:`cached_group`) is ``tests/distributed_worker.py``.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
from typing import Any, Callable

from tests.distributed_worker import PoolError, _worker_main, cached_group  # noqa: F401 - re-exported

__all__ = [
    "GlooPool",
    "PoolError",
    "PoolTimeoutError",
    "RemoteTraceback",
    "cached_group",
    "get_pool",
    "shutdown_all",
]

_MAX_WORLD = 8
# Importing torch + Megatron on 2 shared cores can take long; this is not charged to a case.
_STARTUP_TIMEOUT_S = float(os.environ.get("HSAP_TEST_POOL_STARTUP_S", "300"))
# After one rank raises, how long the others may take to finish before the pool is respawned.
_ERROR_GRACE_S = 10.0
# Idle ranks cost ~0.3-0.5 GB each; keep at most this many alive (least recently used go first).
_MAX_WORKERS = int(os.environ.get("HSAP_TEST_POOL_MAX_WORKERS", "16"))
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PoolTimeoutError(PoolError, TimeoutError):
    """A case did not finish on every rank within its timeout (the pool was respawned)."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n" + self.tb


class GlooPool:
    """``world_size`` spawned ranks sharing one gloo default group, reused across cases."""

    def __init__(self, world_size: int) -> None:
        if not 1 <= world_size <= _MAX_WORLD:
            raise ValueError(f"GlooPool({world_size=}): supported world sizes are 1..{_MAX_WORLD}")
        self.world_size = world_size
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._ready = False
        self._dump_paths: list[str] = []
        self._case_counter = 0
        self.restarts = 0
        self._start()

    # -- lifecycle ------------------------------------------------------------------------

    def _start(self) -> None:
        """Spawn the ranks without waiting for them (they import torch while tests go on)."""
        from megatron_hsap.runtime.rendezvous import new_local_store

        # A fresh file store per spawn: pools of engineers sharing a machine cannot collide, and
        # no port is opened for the rendezvous.
        self._store = new_local_store(prefix=f"hsap-pool-w{self.world_size}-")
        sys_path = [_REPO_ROOT, *sys.path]
        self._procs, self._conns, self._dump_paths = [], [], []
        for rank in range(self.world_size):
            fd, dump_path = tempfile.mkstemp(prefix=f"hsap-pool-w{self.world_size}-r{rank}-", suffix=".stacks")
            os.close(fd)
            self._dump_paths.append(dump_path)
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self._store, child_conn, sys_path, dump_path),
                name=f"hsap-gloo-w{self.world_size}-r{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._ready = False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        pending = set(range(self.world_size))
        while pending:
            replies, dead = self._wait_any(pending, deadline)
            for rank, reply in replies.items():
                kind, _, info = reply
                if kind == "init-error":
                    self._kill()
                    raise PoolError(f"gloo pool (world {self.world_size}): rank {rank} failed to start:\n{info}")
                pending.discard(rank)
            if dead:
                self._kill()
                raise PoolError(f"gloo pool (world {self.world_size}): ranks {dead} died while starting")
            if pending and time.monotonic() >= deadline:
                self._kill()
                raise PoolError(
                    f"gloo pool (world {self.world_size}): ranks {sorted(pending)} not ready after "
                    f"{_STARTUP_TIMEOUT_S:.0f} s (raise HSAP_TEST_POOL_STARTUP_S on a slow machine)"
                )
        self._ready = True

    def _kill(self) -> None:
        """Kill every rank now (no graceful shutdown: some may be stuck in a collective)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        for path in self._dump_paths:
            _remove_quietly(path)
        if self._store is not None:
            from megatron_hsap.runtime.rendezvous import remove_local_store

            remove_local_store(self._store)
        self._procs, self._conns, self._dump_paths = [], [], []
        self._store = None
        self._ready = False

    def restart(self) -> None:
        """Kill the ranks and spawn fresh ones (e.g. after a case broke the default group)."""
        self._kill()
        self.restarts += 1
        self._start()

    def shutdown(self) -> None:
        """Stop the ranks: ask politely, then kill what is left."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running a case -------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        An exception on any rank is re-raised here (the lowest failing rank's, with its remote
        traceback as ``__cause__`` and a note naming the rank); a hang past ``timeout`` seconds
        raises :class:`PoolTimeoutError` with the stuck ranks' stacks and respawns the pool.
        """
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        if "<" in name:  # <lambda>, <locals>: not importable in the ranks
            raise PoolError(f"{name}: a pool case must be a module-level function (it is pickled by reference)")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # noqa: BLE001
            raise PoolError(f"cannot pickle the case {name} or its arguments: {exc}") from exc
        if not self.alive:
            if self._procs:
                self._kill()
            self._start()
        try:
            if not self._ready:
                self._wait_ready()
            results, error = self._run_case(name, payload, timeout)
        except PoolError:
            raise
        except BaseException:
            # Interrupted mid-case (pytest-timeout, Ctrl-C, an internal error): the ranks may
            # still be busy, so respawn them rather than feed the next case to a stuck pool.
            self.restart()
            raise
        if error is not None:
            raise error[0] from error[1]
        return results

    def _run_case(
        self, name: str, payload: bytes, timeout: float
    ) -> tuple[list[Any], tuple[BaseException, RemoteTraceback] | None]:
        """Send one case to every rank and collect (results in rank order, error to raise)."""
        self._case_counter += 1
        case_id = self._case_counter
        message = pickle.dumps(("case", case_id, payload))
        for conn in self._conns:
            conn.send_bytes(message)
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[bytes | None, str]] = {}
        pending = set(range(self.world_size))
        first_failure_at: float | None = None
        while pending:
            wait_until = deadline if first_failure_at is None else min(deadline, first_failure_at + _ERROR_GRACE_S)
            replies, dead = self._wait_any(pending, wait_until)
            for rank, reply in replies.items():
                kind, _, reply_id, *rest = reply
                assert reply_id == case_id, f"rank {rank} answered case {reply_id}, expected {case_id}"
                if kind == "ok":
                    results[rank] = rest[0]
                else:
                    failures[rank] = (rest[0], rest[1])
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()
                pending.discard(rank)
            if dead:
                codes = {r: self._procs[r].exitcode for r in dead}
                self.restart()
                raise PoolError(
                    f"gloo pool (world {self.world_size}): {name} killed rank(s) {codes} "
                    f"(rank: exit code; negative = signal); pool respawned"
                )
            if pending and time.monotonic() >= wait_until:
                if failures:
                    break  # the failing ranks' error is what matters; the rest may be stuck
                stacks = self._dump_stacks(sorted(pending))
                self.restart()
                raise PoolTimeoutError(
                    f"gloo pool (world {self.world_size}): {name} did not finish within {timeout:g} s on "
                    f"ranks {sorted(pending)} (finished: {sorted(results)}). A collective or P2P "
                    f"round probably does not match across ranks. Pool respawned.\n{stacks}"
                )
        if failures:
            return [], self._failure(name, failures, pending)
        try:
            return [pickle.loads(results[r]) for r in range(self.world_size)], None
        except Exception as exc:  # noqa: BLE001 - the ranks are fine; only this process cannot load it
            raise PoolError(f"{name}: a result could not be unpickled in the test process: {exc!r}") from exc

    def _failure(
        self, name: str, failures: dict[int, tuple[bytes | None, str]], stuck: set[int]
    ) -> tuple[BaseException, RemoteTraceback]:
        """The exception to re-raise for failed ranks (the lowest rank's), with its cause."""
        rank = min(failures)
        exc_bytes, tb = failures[rank]
        summary = (
            f"[gloo pool] {name} raised on rank {rank} of world {self.world_size}; "
            f"failing ranks: {sorted(failures)}"
        )
        if len(failures) < self.world_size:
            # Some ranks succeeded or are stuck: the group may hold unmatched messages.
            summary += f"; stuck ranks: {sorted(stuck)}" if stuck else ""
            summary += " (pool respawned: not every rank failed)"
            self.restart()
        exc: BaseException | None = None
        if exc_bytes is not None:
            try:
                exc = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001
                exc = None
        if not isinstance(exc, Exception):  # unpicklable, or SystemExit & co.: never re-raise those
            exc = PoolError(f"{summary}\n{tb}")
        exc.add_note(summary)
        return exc, RemoteTraceback(f"rank {rank}: {tb}")

    def _wait_any(self, pending: set[int], deadline: float) -> tuple[dict[int, Any], list[int]]:
        """Wait until a pending rank replies or dies, or ``deadline``; return (replies, dead ranks)."""
        conns = {self._conns[r]: r for r in pending}
        sentinels = {self._procs[r].sentinel: r for r in pending}
        timeout = max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([*conns, *sentinels], timeout=timeout)
        replies: dict[int, Any] = {}
        for obj in ready:
            if obj in conns:
                rank = conns[obj]
                try:
                    replies[rank] = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    pass  # the rank died; its sentinel reports it
        dead = sorted(
            r for obj, r in sentinels.items()
            if obj in ready and r not in replies and not self._procs[r].is_alive()
        )
        return replies, dead

    def _dump_stacks(self, ranks: list[int]) -> str:
        """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1) and return them."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        sizes = {}
        for r in ranks:
            if self._procs[r].is_alive():
                sizes[r] = os.path.getsize(self._dump_paths[r])
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        # faulthandler writes from a signal handler; on a loaded machine that can take a moment.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
            os.path.getsize(self._dump_paths[r]) == size for r, size in sizes.items()
        ):
            time.sleep(0.05)
        time.sleep(0.1)  # let a dump that has started finish
        parts = []
        for r, size in sizes.items():
            with open(self._dump_paths[r], encoding="utf-8", errors="replace") as f:
                f.seek(size)
                text = f.read().strip()
            parts.append(f"--- rank {r} stacks ---\n{text or '(no dump)'}")
        return "\n".join(parts)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# One pool per world size, for the whole process
# --------------------------------------------------------------------------------------------

_POOLS: collections.OrderedDict[int, GlooPool] = collections.OrderedDict()


def get_pool(world_size: int) -> GlooPool:
    """The process-wide pool for ``world_size`` (created on first use, shut down at exit).

    At most ``HSAP_TEST_POOL_MAX_WORKERS`` ranks (default 16) stay alive: creating a pool
    shuts down the least recently used ones first.
    """
    pool = _POOLS.get(world_size)
    if pool is not None:
        _POOLS.move_to_end(world_size)
        return pool
    while _POOLS and sum(_POOLS) + world_size > _MAX_WORKERS:
        _, old = _POOLS.popitem(last=False)
        old.shutdown()
    pool = GlooPool(world_size)
    _POOLS[world_size] = pool
    return pool


def shutdown_all() -> None:
    """Stop every pool (registered with ``atexit``)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_all)

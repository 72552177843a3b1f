"""The deadline of rounds waited on the device: one host thread, off the hot path (issue 16 item 3).

On CUDA a round is waited by ``work.wait()``: for NCCL that only makes the current stream wait for
the transfer (``cudaStreamWaitEvent``) and returns at once, so the host runs ahead and queues the
next kernels. Nothing on the host then notices a round that never completes — the stream would
just stall. :class:`Watchdog` keeps the deadline instead: :meth:`Watchdog.watch` files the round's
works with its deadline in a heap (O(log n), no query of the works), and one daemon thread sleeps
on a condition variable until the earliest deadline (it never polls: no ``sleep(1e-4)``, no wake-up
while nothing is due). At a deadline it asks each work of that round ``is_completed()`` once (a
host query of the CUDA event); a round still incomplete *fires*:

* its :class:`~megatron_hsap.errors.CommunicationError` (built by the channel: round, stage, peer,
  tensor) is stored; the next :meth:`Watchdog.check` — every ``P2PChannel.post`` / ``wait`` /
  ``close`` calls it, one attribute read — raises it on the training thread;
* ``on_fire`` runs on the watchdog thread (default: print the error to stderr and abort the
  round's process group, so that a stream stuck behind the transfer errors out instead of
  blocking the host's next synchronisation for the job's whole NCCL timeout).

The deadline counts from the host's ``wait`` call; the host runs at most a launch queue ahead of
the device, far less than ``HSAP_P2P_TIMEOUT_S``, so a slow device is not mistaken for a lost peer.
Works that completed before their deadline are dropped at that deadline (or earlier when more than
``_PRUNE_AT`` rounds are filed: :meth:`watch` then drops completed ones, amortised O(1) per round).
Gloo/CPU rounds never come here: they keep the bounded host wait of ``runtime/p2p.py``.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_hsap.errors import CommunicationError

__all__ = ["Watchdog", "WATCHDOG", "abort_group"]

_PRUNE_AT = 4096  # filed rounds before watch() drops the completed ones


def abort_group(group: object) -> None:
    """Best-effort abort of ``group``'s communicators (unblocks streams waiting on its transfers)."""
    import torch.distributed as dist

    try:
        if group is None:
            group = dist.group.WORLD
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()
            return
        from torch.distributed import distributed_c10d as c10d

        c10d._abort_process_group(group)  # type: ignore[attr-defined]  # torch >= 2.5
    except Exception as exc:  # noqa: BLE001 - the error that matters is the deadline's, reported already
        print(f"megatron-hsap watchdog: could not abort the process group ({exc})", file=sys.stderr)


def _default_on_fire(error: CommunicationError, group: object) -> None:
    print(f"megatron-hsap watchdog: {error}", file=sys.stderr, flush=True)
    abort_group(group)


@dataclass(order=True)
class _Entry:
    deadline: float
    seq: int
    works: Sequence[object] = field(compare=False)
    error: Callable[[], CommunicationError] = field(compare=False)
    group: object = field(compare=False)


class Watchdog:
    """Deadlines of device-waited rounds (see the module docstring). Thread-safe.

    ``on_fire(error, group)`` runs on the watchdog thread when a round misses its deadline.
    ``clock``: the seconds deadlines are in (``time.perf_counter``; ``P2PChannel`` reads
    :attr:`clock` for its device-waited deadlines). ``thread=False`` starts no thread: the owner
    drives it with :meth:`fire_due` (tests do, with a fake clock, so no assertion races the
    machine's load).
    """

    def __init__(self, on_fire: Callable[[CommunicationError, object], None] = _default_on_fire, *,
                 clock: Callable[[], float] = time.perf_counter, thread: bool = True) -> None:  # fmt: skip
        self._on_fire = on_fire
        self.clock = clock
        self._threaded = thread
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._fired: CommunicationError | None = None
        self.rounds_filed = 0
        self.wakeups = 0  # times the thread woke (tests: it sleeps until deadlines, never polls)

    # ---------------------------------------------------------------- training thread
    def watch(self, works: Sequence[object], deadline: float, error: Callable[[], CommunicationError],
              group: object = None) -> None:  # fmt: skip
        """File one round: ``works`` must all complete by ``deadline`` (in :attr:`clock` seconds),
        else ``error()`` (called on the watchdog thread) is raised by the next :meth:`check`."""
        entry = _Entry(float(deadline), next(self._seq), tuple(works), error, group)
        with self._cond:
            if len(self._heap) >= _PRUNE_AT:
                self._heap = [e for e in self._heap if not _all_done(e.works)]
                heapq.heapify(self._heap)
            earliest = self._heap[0].deadline if self._heap else None
            heapq.heappush(self._heap, entry)
            self.rounds_filed += 1
            if not self._threaded:
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_run, args=(weakref.ref(self),), name="hsap-watchdog", daemon=True)
                self._thread.start()
            elif earliest is None or entry.deadline < earliest:
                self._cond.notify()  # the thread sleeps until a later deadline: wake it to re-arm

    def check(self) -> None:
        """Raise the error of a round that missed its deadline (once; cheap when none did)."""
        if self._fired is not None:
            with self._cond:
                err, self._fired = self._fired, None
            if err is not None:
                raise err

    def wait_fired(self, timeout_s: float) -> CommunicationError | None:
        """Block until a round fires or ``timeout_s`` passes; the error (not cleared) or None."""
        end = time.perf_counter() + timeout_s  # a real wait, whatever clock the deadlines use
        with self._cond:
            while self._fired is None:
                left = end - time.perf_counter()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._fired

    @property
    def pending(self) -> int:
        """Rounds filed and not yet checked at their deadline."""
        with self._cond:
            return len(self._heap)

    # ---------------------------------------------------------------- watchdog thread
    def _step(self) -> bool:
        """Sleep until the earliest deadline, check the rounds that are due; False to stop."""
        with self._cond:
            if not self._heap:
                self._cond.wait(timeout=60.0)  # idle: nothing filed (the thread exits when unused)
                self.wakeups += 1
                if not self._heap:
                    self._thread = None  # decided under the lock: the next watch() starts a new one
                    return False
                return True
            left = self._heap[0].deadline - self.clock()
            if left > 0:
                self._cond.wait(timeout=left)
                self.wakeups += 1
        self.fire_due()
        return True

    def fire_due(self) -> int:
        """Check every round whose deadline has passed on :attr:`clock`: each work is asked
        ``is_completed()`` once; a round still incomplete fires. The number of rounds checked."""
        due: list[_Entry] = []
        with self._cond:
            now = self.clock()
            while self._heap and self._heap[0].deadline <= now:
                due.append(heapq.heappop(self._heap))
        for entry in due:
            if _all_done(entry.works):
                continue
            try:
                err = entry.error()
            except Exception as exc:  # noqa: BLE001 - never lose the deadline because a message failed
                err = CommunicationError(f"P2P round missed its deadline (describing it failed: {exc})")
            with self._cond:
                if self._fired is None:
                    self._fired = err
                self._cond.notify_all()
            self._on_fire(err, entry.group)
        return len(due)


def _all_done(works: Sequence[object]) -> bool:
    try:
        return all(w.is_completed() for w in works)  # type: ignore[attr-defined]
    except RuntimeError:
        return False  # the transport failed: that round fires too


def _run(ref: "weakref.ref[Watchdog]") -> None:
    while True:
        dog = ref()
        if dog is None or not dog._step():
            return
        del dog


WATCHDOG = Watchdog()  # the process's watchdog: every P2PChannel files its device-waited rounds here

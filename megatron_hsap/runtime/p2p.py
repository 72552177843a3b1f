"""The one P2P helper: post a round of point-to-point transfers, then wait for it, with a deadline.

A *round* is one ``torch.distributed.batch_isend_irecv`` of this rank's sends and receives (the
plan's ``Post``); :meth:`P2PChannel.wait` (the plan's ``Wait``) blocks until every operation of
the round completed or the deadline passed, and then raises :class:`CommunicationError` naming the
round, its stage, the peer and the tensor still outstanding. At most one round is in flight per
channel; posting a second one, waiting for a round that was not posted, or handing tensors that
gloo/NCCL cannot send (non-contiguous, on another device) raise :class:`RuntimeMismatchError`
instead of corrupting data or hanging.

Tags: gloo matches messages by (peer, tag); each operation gets ``round · 2¹² + its index among
this pair's operations in this direction``, so a round that was abandoned (timed out) can never
be matched by a later one. NCCL ignores tags and matches by order, which the plan keeps identical
on both sides (its verifier checks it).

Waiting with a deadline (issue 16 item 3): gloo's send/recv works only report completion from
``wait`` (their ``is_completed`` stays False until then), so on CPU tensors each work is waited on
the host with the time left. Rounds of CUDA tensors are waited *on the device*: ``work.wait()`` on
NCCL makes the current stream wait for the transfer and returns at once (the host runs ahead,
queueing the next kernels), and the round's deadline goes to the watchdog
(``runtime/watchdog.py``: one host thread sleeping until the earliest deadline, no polling); a
round that misses it raises its :class:`CommunicationError` (round, stage, peer, tensor) at the
channel's next ``post`` / ``wait`` / ``close``, and its group is aborted so the stream cannot stall
for the job's whole timeout. Collectives whose result the host reads (:func:`wait_collective`: the
handshake, warm-up, fingerprint, once per plan or group) still poll ``is_completed``.

NCCL also needs the first batched P2P call on a group to involve every rank of the group:
:func:`warm_up` runs one tiny all-reduce per group, once per process, with the same deadline
(:func:`wait_collective`: a collective that does not finish in time raises ``CommunicationError``
naming it, its stage, the group's ranks and the likely cause instead of blocking for torch's
30-minute default). The last round indices are reserved for control messages (the plan
handshake, ``runtime/handshake.py``): ``CONTROL_ROUNDS``.
"""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hsap.errors import CommunicationError, RuntimeMismatchError
from megatron_hsap.runtime.env import MAX_TIMEOUT_S
from megatron_hsap.runtime.watchdog import WATCHDOG, Watchdog

__all__ = ["Transfer", "P2PChannel", "warm_up", "wait_work", "wait_collective", "group_ranks", "CONTROL_ROUNDS"]

_TAG_STRIDE = 1 << 12  # operations per (pair, direction, round); tag = round · stride + index
_ROUND_LIMIT = (1 << 31) // _TAG_STRIDE  # tags are int32
CONTROL_ROUNDS = (_ROUND_LIMIT - 2, _ROUND_LIMIT - 1)  # handshake header, handshake inputs; never plan rounds
_POLL_S = 1e-4  # NCCL polling interval of host-read collectives (once per plan/group, never per round)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point operation: send ``tensor`` to, or receive it from, group rank ``peer``.

    ``what`` names the datum for error messages, e.g. ``"kv[30:32) k rows"``.
    """

    send: bool
    tensor: Tensor
    peer: int
    what: str


# Groups that already ran the warm-up collective. ProcessGroup supports weak references, so a
# destroyed group's entry disappears with it (an ``id()`` could be reused by a new group).
_WARM: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order (for messages)."""
    try:
        return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] if group is not None \
            else list(range(dist.get_world_size()))
    except (RuntimeError, ValueError):
        return []


def wait_work(work: object, deadline: float, cpu: bool) -> bool:
    """Wait for one ``torch.distributed`` work until ``deadline`` (``time.perf_counter``); False on
    timeout. Gloo (CPU) works take the time left in ``wait``; NCCL works are polled with
    ``is_completed`` (a host query of the CUDA event), then ``wait``-ed to order the stream."""
    if cpu:
        left = max(deadline - time.perf_counter(), 1e-3)
        try:
            work.wait(datetime.timedelta(seconds=left))  # type: ignore[attr-defined]
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                return False
            raise
        return True
    while not work.is_completed():  # type: ignore[attr-defined]
        if time.perf_counter() >= deadline:
            return False
        time.sleep(_POLL_S)
    work.wait()  # type: ignore[attr-defined]
    return True


def wait_collective(work: object, *, timeout_s: float, collective: str, stage: str,
                    group: dist.ProcessGroup | None, cpu: bool) -> None:  # fmt: skip
    """Wait for an ``async_op=True`` collective with a deadline; :class:`CommunicationError` naming
    ``collective``, ``stage``, the group's global ranks and the likely cause on expiry or failure."""
    deadline = time.perf_counter() + timeout_s
    try:
        ok = wait_work(work, deadline, cpu)
        why = f"did not complete within {timeout_s:g} s"
    except RuntimeError as exc:  # the transport failed: a peer died or closed its sockets
        ok, why = False, f"failed ({str(exc).splitlines()[0][:200]})"
    if ok:
        return
    me = dist.get_rank() if dist.is_initialized() else 0
    raise CommunicationError(
        f"{collective} ({stage}) on global rank {me}, group of global ranks {group_ranks(group)}, {why}. "
        "Likely cause: a peer never called it (it raised before this point — look for its error, e.g. a "
        "validation error on the first call — or it is dead), or the peers issue collectives in a different "
        "order. Raise HSAP_P2P_TIMEOUT_S if it is just slow. This process group cannot be reused after this error."
    )


def warm_up(group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None) -> None:
    """Run one 1-element all-reduce on ``group`` the first time this process uses it for P2P.

    Every rank of the group must call this at the same point (the executor does it at its first
    use of a group, before any round, on every rank, whether or not that rank has rounds). With
    ``timeout_s`` the all-reduce has that deadline (:func:`wait_collective`).
    """
    group = group if group is not None else dist.group.WORLD
    if group in _WARM:
        return
    if timeout_s is None:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    else:
        work = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
        wait_collective(work, timeout_s=timeout_s, collective="P2P warm-up all_reduce",
                        stage="before the first round on this group", group=group, cpu=device.type == "cpu")
    _WARM.add(group)


class P2PChannel:
    """Posts and waits rounds of P2P transfers on one process group, counting bytes and time.

    ``bytes_sent``/``bytes_recv`` accumulate the sizes of the tensors actually handed to
    ``isend``/``irecv``; ``comm_s`` the host seconds spent posting and waiting (the part of
    communication not hidden behind compute; ~0 for device-waited rounds).

    ``device_wait``: wait rounds on the device with the deadline on ``watchdog`` (default: rounds
    of CUDA tensors do, CPU rounds wait on the host). ``True`` on CPU tensors is the test mode of
    the watchdog: the host does not wait at all (there is no stream to order) and only the
    watchdog keeps the deadline. ``device_waits`` counts the rounds waited that way.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float, phase: str = "",
                 device_wait: bool | None = None, watchdog: Watchdog | None = None) -> None:  # fmt: skip
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise RuntimeMismatchError(f"P2P timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
        self.group = group
        self.device_wait = device_wait
        self.watchdog = WATCHDOG if watchdog is None else watchdog
        self.device_waits = 0
        self.timeout_s = float(timeout_s)
        self.phase = phase
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.comm_s = 0.0
        self._round: int | None = None
        self._stage = ""
        self._works: list[object] = []
        self._transfers: list[Transfer] = []
        self._per_op = True  # one work per transfer (gloo) or one for the batch (NCCL)
        self._cpu = True

    @property
    def in_flight(self) -> int | None:
        """Index of the round posted and not yet waited, or None."""
        return self._round

    def post(self, index: int, transfers: Sequence[Transfer], *, stage: str = "", control: bool = False) -> None:
        """Launch round ``index``: one ``batch_isend_irecv`` of ``transfers`` (in order).
        ``control``: ``index`` is one of ``CONTROL_ROUNDS`` (the handshake), not a plan round."""
        self.watchdog.check()  # a device-waited round that missed its deadline raises here
        if self._round is not None:
            raise RuntimeMismatchError(
                f"P2P misuse: round {index} posted while round {self._round} is still in flight; "
                "wait for it first (one round at a time per channel)"
            )
        if not (index in CONTROL_ROUNDS if control else 0 <= index < CONTROL_ROUNDS[0]):
            raise RuntimeMismatchError(f"P2P round index {index} out of range for tags (plan rounds < {CONTROL_ROUNDS[0]})")
        t0 = time.perf_counter()
        ops, counters = [], {}
        for tr in transfers:
            t = tr.tensor
            if not t.is_contiguous():
                raise RuntimeMismatchError(f"P2P misuse: round {index} {tr.what} is not contiguous")
            if transfers and t.device != transfers[0].tensor.device:
                raise RuntimeMismatchError(
                    f"P2P misuse: round {index} mixes devices ({t.device} for {tr.what}, "
                    f"{transfers[0].tensor.device} for {transfers[0].what})"
                )
            key = (tr.send, tr.peer)
            seq = counters.get(key, 0)
            counters[key] = seq + 1
            if seq >= _TAG_STRIDE:
                raise RuntimeMismatchError(f"P2P round {index} has more than {_TAG_STRIDE} ops with peer {tr.peer}")
            op = dist.isend if tr.send else dist.irecv
            ops.append(dist.P2POp(op, t, group=self.group, group_peer=tr.peer, tag=index * _TAG_STRIDE + seq))
            nbytes = t.numel() * t.element_size()
            if tr.send:
                self.bytes_sent += nbytes
            else:
                self.bytes_recv += nbytes
        works = dist.batch_isend_irecv(ops) if ops else []
        # Gloo returns one work per op; NCCL one for the coalesced batch (then errors name every op).
        self._works, self._transfers = list(works), list(transfers)
        self._per_op = len(works) == len(transfers)
        self._cpu = not transfers or transfers[0].tensor.device.type == "cpu"
        self._round, self._stage = index, stage
        self.comm_s += time.perf_counter() - t0

    def wait(self, index: int) -> None:
        """Round ``index`` done: on the host, block until it completed (CPU rounds) and raise
        :class:`CommunicationError` after the timeout; on the device (CUDA rounds, or
        ``device_wait``), order the stream after it and hand the deadline to the watchdog."""
        if self._round != index:
            raise RuntimeMismatchError(
                f"P2P misuse: wait for round {index} but "
                + ("no round is in flight" if self._round is None else f"round {self._round} is in flight")
            )
        self.watchdog.check()
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        if (not self._cpu) if self.device_wait is None else self.device_wait:
            self._wait_on_device(self.watchdog.clock() + self.timeout_s)
            self.comm_s += time.perf_counter() - t0
            return
        try:
            for pos, work in enumerate(self._works):
                try:
                    ok = self._wait_one(work, deadline)
                except RuntimeError as exc:  # the transport failed (peer died, socket closed)
                    raise self._error(pos, f"failed: {exc}") from exc
                if not ok:
                    raise self._error(pos, f"did not complete within {self.timeout_s:g} s")
        finally:
            self._round, self._works, self._transfers = None, [], []
            self.comm_s += time.perf_counter() - t0

    def _wait_on_device(self, deadline: float) -> None:
        """Order the current stream after the round (NCCL ``wait`` does not block the host) and
        hand the deadline to the watchdog with what it needs to name the round if it fires."""
        works, transfers = self._works, self._transfers
        round_, stage, per_op = self._round, self._stage, self._per_op
        try:
            if not self._cpu:
                for work in works:
                    work.wait()  # type: ignore[attr-defined]  # cudaStreamWaitEvent: returns at once
        except RuntimeError as exc:  # the transport failed already
            raise self._error(0, f"failed: {exc}") from exc
        finally:
            self._round, self._works, self._transfers = None, [], []
        self.device_waits += 1
        if not works:
            return

        def error() -> CommunicationError:  # runs on the watchdog thread at the deadline
            pos = next((i for i, w in enumerate(works) if not _done(w)), 0) if per_op else 0
            return _round_error(self.group, self.phase, round_, stage, transfers, per_op, pos,
                                f"did not complete within {self.timeout_s:g} s (device-waited; watchdog)")

        self.watchdog.watch(works, deadline, error, self.group)

    def _wait_one(self, work: object, deadline: float) -> bool:
        """True when ``work`` completed before ``deadline``; False on timeout."""
        return wait_work(work, deadline, self._cpu)

    def wait_each(self, index: int) -> list[tuple[Transfer, str | None]]:
        """Like :meth:`wait` but never raises for a late or failed transfer: every transfer with
        ``None`` (done) or why it is not (the handshake reports every missing peer at once).
        Receives are waited before sends (a send to a peer that never posts may never finish)."""
        if self._round != index:
            raise RuntimeMismatchError(f"P2P misuse: wait_each for round {index}, in flight: {self._round}")
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        status: list[str | None] = [None] * len(self._transfers)
        try:
            if not self._per_op:  # NCCL: one work for the batch
                try:
                    ok = all(wait_work(w, deadline, self._cpu) for w in self._works)
                    why = None if ok else f"did not complete within {self.timeout_s:g} s"
                except RuntimeError as exc:
                    why = f"failed: {str(exc).splitlines()[0][:200]}"
                return [(t, why) for t in self._transfers]
            order = sorted(range(len(self._transfers)), key=lambda i: self._transfers[i].send)
            for pos in order:
                try:
                    if not wait_work(self._works[pos], deadline, self._cpu):
                        status[pos] = f"did not complete within {self.timeout_s:g} s"
                except RuntimeError as exc:
                    status[pos] = f"failed: {str(exc).splitlines()[0][:200]}"
                if status[pos] is not None and not self._transfers[pos].send:
                    deadline = min(deadline, time.perf_counter() + 0.5)  # the rest only gets a grace period
            return list(zip(self._transfers, status))
        finally:
            self._round, self._works, self._transfers = None, [], []
            self.comm_s += time.perf_counter() - t0

    def _error(self, pos: int, why: str) -> CommunicationError:
        return _round_error(self.group, self.phase, self._round, self._stage, self._transfers, self._per_op, pos, why)

    def close(self) -> None:
        """Check that no round is left in flight (end of a phase)."""
        self.watchdog.check()
        if self._round is not None:
            raise RuntimeMismatchError(f"P2P misuse: round {self._round} was posted but never waited")


def _done(work: object) -> bool:
    try:
        return bool(work.is_completed())  # type: ignore[attr-defined]
    except RuntimeError:
        return False


def _round_error(group: dist.ProcessGroup | None, phase: str, round_: int | None, stage: str,
                 transfers: Sequence[Transfer], per_op: bool, pos: int, why: str) -> CommunicationError:  # fmt: skip
    """The error of round ``round_`` whose ``pos``-th work (per-op works) did not complete."""
    pending = list(transfers[pos:] if per_op else transfers)
    first = pending[0] if pending else None
    try:
        me = dist.get_rank(group) if dist.is_initialized() else 0
    except (RuntimeError, ValueError):  # the group was destroyed meanwhile (watchdog thread)
        me = -1
    where = f"{phase} " if phase else ""
    head = f"P2P round {round_} ({where}{stage}) on group rank {me}"
    if first is None:
        return CommunicationError(f"{head} {why}")
    direction = "send to" if first.send else "recv from"
    also = ""
    if len(pending) > 1:
        also = "; still outstanding: " + ", ".join(
            f"{'send to' if t.send else 'recv from'} peer {t.peer} {t.what}" for t in pending[1:6]
        ) + (" ..." if len(pending) > 6 else "")
    return CommunicationError(
        f"{head}: {direction} peer {first.peer} (group rank), tensor {first.what}, {why}{also}. "
        f"The peer is probably stuck, dead or running a different plan (check that every rank "
        f"compiled its plan from the same cu_seqlens; raise HSAP_P2P_TIMEOUT_S if it is just slow). "
        f"This process group cannot be reused after this error."
    )

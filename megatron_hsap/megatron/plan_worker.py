"""Compile plans in a child process, off the training process's GIL (the plan worker).

The plan prefetcher (``megatron/prefetch.py``) compiles the next micro-batch's plan while this one
trains. On a thread, that compile shares the training process's GIL: every torch op the training
thread dispatches releases the GIL and must win it back from the compile, which CPython grants
only at its switch interval (5 ms). So while a plan compiles, the training thread launches about
one op per 5 ms: measured on this repo's 2-core VM (``python -m megatron_hsap.bench.plan_worker``,
``results/plan_worker.md``), a loop of small torch ops beside a compiling thread is slowed by about
the whole compile time — the compile is serialised with the launches, not overlapped. Where the
GPU queue is short (the first micro-batch after the optimizer step, or after Megatron's
``--batch-p2p-sync`` device sync between pipeline stages) the GPU then waits.

:class:`PlanWorker` runs ``compile_plan`` in a child Python process (``python -c ...serve()``,
which imports the planner — pure Python + numpy — and neither torch nor Megatron): a
:class:`PlanRequest` (``cu_seqlens``, the resolved ``compile_plan`` keyword arguments, the model's
sliding windows) goes down a pipe, the pickled plan and its window plans come back. The training
process holds the GIL only to unpickle the plan (≈ 2 ms at 64K tokens, 15–23 ms at 1M over 64
ranks: the IR records pickle by their fields, ``plan/ir.py pickle_by_fields``). Every rank's worker runs the same code on the same inputs, so the
plans — and their ``hash``, which the runtime's handshake compares — are the plans the rank would
compile itself (tested).

Faults: a compile error (``ConfigError``, ``BatchError``, ``PoolSizeError``, ...) is raised from
``compile`` as itself; a worker that cannot start or dies (killed by the OOM killer, say) is
reported once on stderr and the plan is compiled in-process from then on — the run goes on, on
the thread. The child ignores SIGINT (the parent decides) and exits on ``close``'s stop message or
when its stdin closes, so it never outlives the training process. (The stop message matters where
a process forked after the worker started — a DataLoader worker — holds a copy of the pipe's write
end: the child would see no end of stream until that process exits.)
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from megatron_hsap.errors import HSAPError
from megatron_hsap.plan.shared_layout import adopt

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["Compiled", "PlanRequest", "PlanWorker", "compile_request"]

_HEADER = struct.Struct("<Q")  # every message: its pickle's length, then the pickle; length 0: stop
_STOP_WAIT_S = 5.0  # close(): how long the child may take to exit after its stdin closes
_CHILD = "from megatron_hsap.megatron.plan_worker import serve; serve()"  # the child's program (python -c)


@dataclass(frozen=True)
class PlanRequest:
    """One micro-batch's plan, as ``compile_request`` compiles it: global ``cu_seqlens`` (ints),
    ``compile_plan``'s keyword arguments with the topology resolved (``inter_size``, ``intra_size``,
    heads, ...), and the model's distinct sliding windows (``None``: full attention), whose plans
    are compiled on the same layout (``shared_layout.compile_on_layout``)."""

    cu_seqlens: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    windows: tuple[Any, ...] = ()


class Compiled(NamedTuple):
    """``PlanWorker.compile``'s result: the plan, the compile's wall seconds where it ran, and
    whether that was the worker process (else this process, on the caller's thread)."""

    plan: "Plan"
    seconds: float
    in_worker: bool


def compile_request(req: PlanRequest) -> tuple["Plan", tuple["Plan", ...]]:
    """The plan of ``req`` and its plans for ``req.windows`` (in that order), each with its ``hash``
    computed (the handshake's identity: computed here, off the step)."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.shared_layout import compile_on_layout

    plan = compile_plan(req.cu_seqlens, **req.kwargs)
    _ = plan.hash
    windowed = tuple(compile_on_layout(plan, w) for w in req.windows)
    for p in windowed:
        _ = p.hash
    return plan, windowed


def _write(out: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)))
    out.write(data)
    out.flush()


def _read(inp: BinaryIO) -> bytes | None:
    """One message's pickle (empty: the stop message), or None at end of stream (the other side
    closed or died)."""
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = inp.read(n)
    return data if len(data) == n else None


def _loads(data: bytes) -> Any:
    """Unpickle a reply with the cyclic collector off, as ``compile_plan`` compiles: a plan is ~10^4
    small objects, and collections triggered while they are built would scan them again and again
    (at 1M / P 64 the training thread beside the worker lost 103–124 ms per batch with it on, 45–90
    ms with it off: ``bench/plan_worker.py``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return pickle.loads(data)
    finally:
        if enabled:
            gc.enable()


def _error_reply(exc: BaseException) -> tuple:
    """``("error", exc)`` when ``exc`` survives a pickle round trip (a custom ``__init__`` may not),
    else ``("error-text", its type's name, its message)``."""
    try:
        reply = ("error", exc)
        pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        return reply
    except Exception:  # noqa: BLE001 - any failure to round-trip: send the text
        return ("error-text", f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))


def serve(inp: BinaryIO | None = None, out: BinaryIO | None = None) -> None:
    """The child's loop: read a pickled ``PlanRequest``, reply ``("ok", plan, window plans, seconds)``
    or an error, until the stop message (an empty one) or the end of stdin. Writes nothing else to
    the reply stream: stdout is pointed at stderr first, so a stray print cannot corrupt a reply."""
    if inp is None or out is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
        inp = os.fdopen(os.dup(0), "rb")
        out = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    while True:
        data = _read(inp)
        if not data:  # end of stream, or the stop message
            return
        try:
            req = pickle.loads(data)
            start = time.perf_counter()
            plan, windowed = compile_request(req)
            reply: tuple = ("ok", plan, windowed, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - every compile error goes back to the caller
            reply = _error_reply(exc)
        try:
            _write(out, reply)
        except BrokenPipeError:
            return


class PlanWorkerError(HSAPError):
    """Internal: the worker process could not be started, or died; ``PlanWorker`` compiles in-process then."""


class PlanWorker:
    """A child process compiling :class:`PlanRequest` s one at a time (``compile`` is thread-safe:
    callers are served in turn). Started on the first ``compile``; ``close`` (or garbage collection,
    or interpreter exit) stops it. ``enabled=False`` compiles in-process, like a worker that died."""

    def __init__(self, *, enabled: bool = True) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self.in_process = not enabled  # set for good when the worker fails
        self.failure: str | None = None  # why it did, as reported on stderr

    @property
    def pid(self) -> int | None:
        """The worker process's id while it runs (None before the first compile, or in-process)."""
        return None if self._proc is None or self.in_process else self._proc.pid

    def compile(self, req: PlanRequest) -> Compiled:
        """``req``'s plan (its window plans put in the plan cache, where every layer's core attention
        looks them up), compiled in the worker process, or here when it is disabled or has failed."""
        with self._lock:
            if not self.in_process:
                try:
                    plan, windowed, seconds = self._remote(req)
                except PlanWorkerError as err:
                    self._fail(str(err))
                else:
                    adopt(plan, windowed)  # where every layer's core attention looks them up
                    return Compiled(plan, seconds, True)
        start = time.perf_counter()
        plan, _ = compile_request(req)
        return Compiled(plan, time.perf_counter() - start, False)

    def _remote(self, req: PlanRequest) -> tuple["Plan", tuple["Plan", ...], float]:
        proc = self._proc or self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write(proc.stdin, req)
        except (BrokenPipeError, OSError) as err:
            raise PlanWorkerError(self._died(f"sending the batch failed ({err})")) from None
        data = _read(proc.stdout)
        if data is None:
            raise PlanWorkerError(self._died("it closed its pipe before replying"))
        reply = _loads(data)
        if reply[0] == "ok":
            return reply[1], reply[2], reply[3]
        if reply[0] == "error":
            err = reply[1]
            err.add_note("(raised while compiling the plan in the plan worker process)")
            raise err
        raise HSAPError(f"{reply[1]}: {reply[2]} (raised while compiling the plan in the plan worker process)")

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # the parent's import path, whatever put it there (PYTHONPATH, a script's sys.path.insert)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as err:
            raise PlanWorkerError(f"starting it failed ({err})") from None
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop, proc)
        return proc

    def _died(self, what: str) -> str:
        proc = self._proc
        code = None if proc is None else proc.poll()
        if proc is not None and code is None:
            try:
                code = proc.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                _stop(proc)
                code = proc.poll()
        return f"{what}; exit status {code}"

    def _fail(self, why: str) -> None:
        self.in_process, self.failure = True, why
        if self._finalizer is not None:
            self._finalizer()
        print(f"[megatron-hsap] plan worker process: {why}; compiling plans in the training process from "
              "now on (--no-hsap-plan-process does so from the start)", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the worker: it is sent the stop message and its stdin closes, it exits (killed after
        ``_STOP_WAIT_S``). A later ``compile`` starts a new one."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._proc = self._finalizer = None

    def __enter__(self) -> "PlanWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Send the child the stop message and close its stdin (it exits at either), reap it; kill it
    if it lingers."""
    try:
        if proc.stdin is not None:
            proc.stdin.write(_HEADER.pack(0))
            proc.stdin.flush()
    except (OSError, ValueError):  # it is gone, or its pipe was closed already
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=_STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":  # pragma: no cover - ``PlanWorker`` starts it with ``-c`` (no package ``__main__`` run)
    serve()

"""Compile the next micro-batch's plan while this one trains (plan prefetch).

Compiling a plan is pure CPU work (tens of ms at 64K tokens, a few hundred at 1M over 64 ranks;
about twice that with ``layout="balanced"``, which compiles both layouts). Done inside
``get_batch`` it sits on the critical path of every micro-batch. :class:`PlanPrefetcher` reads one
micro-batch ahead and compiles its plan on one background thread, so the compile overlaps the
current micro-batch's forward and backward. A compile *on* that thread holds the GIL against every
op the training thread dispatches (it gets the GIL back only at CPython's 5 ms switch interval), so
the Megatron backend and ``train-tiny`` hand the compile to a plan worker process and the thread
only waits on its pipe (``megatron/plan_worker.py``, ``--hsap-plan-process``).

``read`` runs on the caller's thread — it may issue collectives (Megatron's tensor-parallel
broadcast of the host batch) and must be called in the same order on every rank; ``compile`` runs
on the worker thread and must not issue collectives (``compile_plan`` is pure). Imports neither
torch nor Megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["PlanPrefetcher"]

B = TypeVar("B")
P = TypeVar("P")


class PlanPrefetcher(Generic[B, P]):
    """Iterator of ``(batch, plan)``: ``batch`` from ``read()`` (``None`` ends the stream), ``plan``
    from ``compile(batch)`` computed one batch ahead on a background thread.

    With ``enabled=False`` it compiles on the caller's thread when the batch is taken (same results,
    no lookahead read). A compile error is raised from the ``next()`` that would return its batch.
    """

    def __init__(self, read: Callable[[], B | None], compile: Callable[[B], P], *, enabled: bool = True) -> None:
        self._read = read
        self._compile = compile
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsap-plan") if enabled else None
        self._ahead: tuple[B, Future[P]] | None = None
        self._done = False
        # Whether the plan just returned was compiled before it was asked for (None: no lookahead).
        self.last_ready: bool | None = None

    def __iter__(self) -> Iterator[tuple[B, P]]:
        return self

    def __next__(self) -> tuple[B, P]:
        if self._pool is None:
            batch = self._read_one()
            self.last_ready = None
            return batch, self._compile(batch)
        current = self._ahead or self._submit(self._read_one())
        self._ahead = None
        try:
            self._ahead = self._submit(self._read_one())  # the next one compiles while this trains
        except StopIteration:
            pass
        batch, plan = current
        self.last_ready = plan.done()
        return batch, plan.result()

    def _read_one(self) -> B:
        if self._done:
            raise StopIteration
        batch = self._read()
        if batch is None:
            self._done = True
            raise StopIteration
        return batch

    def _submit(self, batch: B) -> tuple[B, Future[P]]:
        assert self._pool is not None
        return batch, self._pool.submit(self._compile, batch)

    def close(self) -> None:
        """Stop the worker (a compile in flight finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "PlanPrefetcher[B, P]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


"""Plan prefetch: one micro-batch read ahead, its plan compiled on a background thread."""

from __future__ import annotations

import threading

import pytest

from megatron_hsap.megatron.prefetch import PlanPrefetcher


class Source:
    """Batches 0..n-1 then the end (None); records which thread read and how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads, self.threads = n, 0, set()

    def __call__(self) -> int | None:
        self.threads.add(threading.current_thread().name)
        if self.reads >= self.n:
            return None
        self.reads += 1
        return self.reads - 1


def test_pairs_each_batch_with_its_own_plan_in_order() -> None:
    compiled_on = set()

    def compile_(b: int) -> str:
        compiled_on.add(threading.current_thread().name)
        return f"plan-{b}"

    src = Source(5)
    with PlanPrefetcher(src, compile_) as pf:
        got = list(pf)
    assert got == [(i, f"plan-{i}") for i in range(5)]
    assert src.threads == {threading.current_thread().name}  # reads (collectives) stay on the caller
    assert all(name.startswith("hsap-plan") for name in compiled_on)


def test_reads_exactly_one_batch_ahead() -> None:
    src = Source(3)
    with PlanPrefetcher(src, str) as pf:
        next(pf)
        assert src.reads == 2
        next(pf)
        assert src.reads == 3
    off = Source(3)
    next(PlanPrefetcher(off, str, enabled=False))
    assert off.reads == 1  # disabled: no lookahead, compiled on the caller's thread


def test_compile_overlaps_training() -> None:
    # Ordering, not timing: while batch k trains (the loop body, which waits here), the worker thread
    # starts compiling batch k+1. Without the lookahead this test would fail at the first wait.
    started = [threading.Event() for _ in range(5)]

    def compile_(b: int) -> int:
        started[b].set()
        return b

    with PlanPrefetcher(Source(5), compile_) as pf:
        for batch, plan in pf:
            assert plan == batch
            if batch + 1 < 5:
                assert started[batch + 1].wait(timeout=30), f"batch {batch + 1} did not compile during step {batch}"
    taken: list[int] = []
    with PlanPrefetcher(Source(3), lambda b: taken.append(b) or b, enabled=False) as pf:
        for batch, _ in pf:
            assert taken == list(range(batch + 1))  # disabled: compiled when taken, never ahead


def test_compile_error_surfaces_with_its_batch() -> None:
    def compile_(b: int) -> int:
        if b == 2:
            raise ValueError("bad batch 2")
        return b

    with PlanPrefetcher(Source(4), compile_) as pf:
        assert [next(pf), next(pf)] == [(0, 0), (1, 1)]
        with pytest.raises(ValueError, match="bad batch 2"):
            next(pf)

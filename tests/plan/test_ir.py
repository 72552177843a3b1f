"""plan/ir.py: the IR's invariants hold at construction — an invalid TokenRange, Slot or
ComputeItem raises before it can exist — and ``ComputeItem.work`` / ``Unit.work`` equal the
brute-force count of unmasked (q, k) pairs, with and without a sliding window (docs/design.md §2.1
plan IR).

Reference: the pairs counted one by one here (key k <= row q, and q − k <= window)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.ir import ComputeItem, Slot, TokenRange, Unit


def brute(q: TokenRange, kv: TokenRange, window: int) -> int:
    return sum(1 for a in range(q.start, q.stop) for k in range(kv.start, kv.stop)
               if k <= a and (window < 0 or a - k <= window))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 40), st.integers(1, 30), st.integers(0, 40), st.booleans(), st.integers(-1, 12))
def test_work_is_the_brute_force_pair_count(qs: int, nq: int, back: int, causal: bool, window: int) -> None:
    q = TokenRange(qs, qs + nq)
    if causal:
        kv = TokenRange(max(0, qs - back), q.stop)
    else:
        if qs == 0:
            return
        ks = max(0, qs - 1 - back)
        kv = TokenRange(ks, min(qs, ks + 1 + back))
    item = ComputeItem(q=q, kv=kv, causal=causal, srcs=(), dsts=(), window=window)
    unit = Unit(0, q, kv, causal, 0, 0, 0, window=window)
    assert item.work == unit.work == brute(q, kv, window)


def test_invalid_values_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="start <= stop"):
        TokenRange(5, 4)
    with pytest.raises(ValueError, match="start <= stop"):
        TokenRange(-1, 4)
    with pytest.raises(ValueError, match="nbytes > 0"):
        Slot(0, 0)
    with pytest.raises(ValueError, match="offset >= 0"):
        Slot(-256, 10)
    with pytest.raises(ValueError, match="empty"):
        ComputeItem(q=TokenRange(4, 4), kv=TokenRange(0, 4), causal=False, srcs=(), dsts=())
    with pytest.raises(ValueError, match="kv.stop == q.stop"):  # causal items are bottom-right aligned
        ComputeItem(q=TokenRange(4, 8), kv=TokenRange(0, 7), causal=True, srcs=(), dsts=())
    with pytest.raises(ValueError, match="before every q row"):  # rectangles lie wholly before their rows
        ComputeItem(q=TokenRange(4, 8), kv=TokenRange(0, 5), causal=False, srcs=(), dsts=())


def test_ir_records_are_frozen() -> None:
    r = TokenRange(0, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.start = 1  # type: ignore[misc]
    assert len(r) == 4 and str(r) == "[0:4)" and Slot(256, 10).end == 266

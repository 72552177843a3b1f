"""plan/ir.py: the IR's invariants hold at construction — an invalid TokenRange, Slot or
ComputeItem raises before it can exist — and ``ComputeItem.work`` / ``Unit.work`` equal the
brute-force count of unmasked (q, k) pairs, with and without a sliding window (docs/design.md §2.1
plan IR).

Reference: the pairs counted one by one here (key k <= row q, and q − k <= window)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.ir import ComputeItem, Slot, TokenRange, Unit, Wire


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


def test_plans_pickle_by_fields_equal_and_without_dataclasses_fields(monkeypatch) -> None:
    """The plan worker process sends plans pickled (megatron/plan_worker.py): every IR record comes
    back equal — cached ``_work`` included — without CPython's per-object ``dataclasses.fields``
    call (``ir.pickle_by_fields``), and the plan keeps its hash."""
    import pickle

    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.codegen import Message
    from megatron_hsap.plan.units import Piece, WorkUnit

    plan = compile_plan([0, 300, 700, 1500, 1536, 4096], 4, intra_size=2, num_heads=8, num_kv_heads=2, head_dim=16,
                        flatten="never")
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    calls = []
    real = dataclasses.fields
    monkeypatch.setattr(dataclasses, "fields", lambda x: calls.append(type(x).__name__) or real(x))
    back = pickle.loads(data)
    monkeypatch.undo()
    records = {"TokenRange", "Segment", "Slot", "Send", "Recv", "Round", "Post", "Wait", "ComputeItem", "Compute",
               "Merge", "Accumulate", "Program", "Unit", "Piece", "WorkUnit", "Message"}
    assert not set(calls) & records, calls  # the plan's few other dataclasses: once each, not per block
    assert len(calls) < 20
    assert back.hash == plan.hash and back.units() == plan.units()
    assert [u._work for u in back.units()] == [u._work for u in plan.units()]
    for phase in ("fwd", "bwd"):
        assert [back.program(r, phase) for r in range(plan.inter_size)] == [plan.program(r, phase) for r in range(plan.inter_size)]
    # the records a plan holds, each once: equal, same class, same hash
    unit = plan.units()[0]
    work = WorkUnit(0, TokenRange(0, 8), TokenRange(0, 8), True, 0, 0, "A1")
    _ = work.work
    for x in (unit, unit.q, Slot(256, 10), Piece(0, TokenRange(0, 4), 1, 2), work,
              Message(1, 0, 1, Wire.KV, TokenRange(0, 4), 64, part=2)):
        y = pickle.loads(pickle.dumps(x))
        assert type(y) is type(x) and y == x and hash(y) == hash(x)
    assert pickle.loads(pickle.dumps(work))._work == work._work > 0

"""plan/calls.py: the grouping of compute items into kernel calls (docs/design.md §2.2).

Properties, on compiled plans of several packings, layouts, windows and rank counts:

* every compute item of a stage is in exactly one call, in the items' order, and a call never
  crosses a stage (so the program's Post/Wait dependencies hold for calls as for items);
* a call is one item that touches a pool slot, or a run of local items on the same causality and
  kernel window whose rows are consecutive — checked against an independent reference: the local
  row of a token is its index in the rank's ``Layout.local_token_indices`` (numpy) — or a gathered
  call: the items with remote kv, local q rows and every pair visible that share one q range;
* the grouping is maximal: two neighbouring calls of a stage could not have been one, and no two
  calls hold gatherable items of one q range;
* ``call_counts`` is the per-rank number of calls (counted from the staged blocks when the plan
  has no window: equal to the walk over the programs on random plans).

The count against what the executor launches is in tests/runtime/test_executor.py (kernel
invocations counted on CPU runs), and against what the simulator prices in tests/sim/test_hsap_calls.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import RuntimeMismatchError
from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.calls import KernelCall, LocalRows, call_counts, all_local, program_calls, stage_calls
from megatron_hsap.plan.ir import Compute, ComputeItem, Phase, Segment, Slot, TokenRange, Wire

PLANS = [  # (cu_seqlens, inter, intra, options)
    ([*range(41), 45, 45, 60, 64], 1, 1, {}),  # 1×1: every item local
    ([0, 3, 9, 10, 30, 31, 32], 1, 1, {"window_size": (4, 0)}),
    ([0, 17, 60, 61, 128], 4, 1, {"pool_bytes": 4096}),
    ([0, 100, 120, 128], 4, 1, {"layout": "balanced", "layout_fallback": False}),
    ([0, 900, 1000, 3100, 3200, 4096], 4, 2, {"num_kv_heads": 2}),
    ([0, 300, 301, 700, 1024], 2, 1, {"window_size": (64, 0)}),
]


def _plan(cu, inter, intra, options):
    opts = {"num_heads": 4, "head_dim": 8, "dtype_bytes": 4, **options}
    return compile_plan(cu, inter, intra, **opts)


def _local_rows(plan, rank: int) -> dict[int, int]:
    """Independent reference: global token -> local row (its index in the rank's local order)."""
    p = plan.intra_size  # the inter rank's local order: its intra ranks' slices, in order
    ids = np.concatenate([plan.layout.local_token_indices(rank * p + j) for j in range(p)])
    return {int(t): i for i, t in enumerate(ids)}


def _rows_of(ranges: list[TokenRange], where: dict[int, int]) -> list[int]:
    return [where[t] for r in ranges for t in range(r.start, r.stop)]


def _local(item: ComputeItem) -> bool:  # the reference's own reading of the item
    return all(s is None for _, s in item.srcs + item.dsts)


def _gathers(item: ComputeItem) -> bool:  # the reference's reading of a gatherable item
    ins = dict(item.srcs)
    outs = dict(item.dsts)
    return (not item.causal and item.work == len(item.q) * len(item.kv) and ins.pop(Wire.KV) is not None
            and all(s is None for s in ins.values()) and outs.pop(Wire.DKV, Slot(0, 1)) is not None
            and all(s is None for s in outs.values()))  # fmt: skip


@pytest.mark.parametrize("case", range(len(PLANS)), ids=lambda i: f"plan{i}")
def test_calls_partition_the_items_and_read_their_rows(case: int) -> None:
    plan = _plan(*PLANS[case])
    seen_fused = seen_gathered = False
    for phase in (Phase.FWD, Phase.BWD):
        counts = call_counts(plan, phase)
        assert len(counts) == plan.inter_size
        for rank in range(plan.inter_size):
            prog = plan.program(rank, phase)
            where = _local_rows(plan, rank)
            computes = [ins for ins in prog.instrs if isinstance(ins, Compute)]
            per_stage = program_calls(prog, plan.layout.segments[rank])
            assert len(per_stage) == len(computes)
            assert sum(len(c) for c in per_stage) == counts[rank]
            for ins, calls in zip(computes, per_stage):
                # every item in exactly one call; each call's items and the calls (by their first
                # item) in program order; no call crosses the stage
                pos = {id(it): i for i, it in enumerate(ins.items)}
                assert sorted(pos[id(it)] for c in calls for it in c.items) == list(range(len(ins.items)))
                firsts = [pos[id(c.items[0])] for c in calls]
                assert firsts == sorted(firsts)
                assert all([pos[id(it)] for it in c.items] == sorted(pos[id(it)] for it in c.items) for c in calls)
                assert all(c.stage == ins.stage for c in calls)
                for c in calls:
                    if c.gathered:  # one q range, every part gatherable, kv from slots, one sequence
                        seen_gathered = True
                        assert len(c.items) > 1 and all(_gathers(it) for it in c.items)
                        assert len({it.q for it in c.items}) == 1
                        assert list(range(c.q_rows.start, c.q_rows.stop)) == _rows_of([c.items[0].q], where)
                        assert c.kv_rows is None and c.q_lengths == (len(c.items[0].q),)
                        assert c.kv_lengths == (sum(len(it.kv) for it in c.items),)
                        assert c.kv_parts == tuple(len(it.kv) for it in c.items)
                        assert c.work == len(c.items[0].q) * c.kv_lengths[0]
                        continue
                    if len(c.items) > 1:
                        seen_fused = True
                        assert all(_local(it) for it in c.items)
                        assert len({(it.causal, it.kernel_window) for it in c.items}) == 1
                    if c.q_rows is not None:  # the call's contiguous q rows are its items' rows
                        assert list(range(c.q_rows.start, c.q_rows.stop)) == _rows_of([it.q for it in c.items], where)
                    else:
                        assert len(c.items) == 1 and c.items[0].src(Wire.Q) is not None
                    if c.kv_rows is not None:
                        assert list(range(c.kv_rows.start, c.kv_rows.stop)) == _rows_of([it.kv for it in c.items], where)
                    else:
                        assert len(c.items) == 1 and c.items[0].src(Wire.KV) is not None
                    assert c.q_lengths == tuple(len(it.q) for it in c.items)
                    assert c.work == sum(it.work for it in c.items)
                # maximal: gatherable items of one q range share a call; neighbours could not have been fused
                by_q: dict = {}
                for i, c in enumerate(calls):
                    for it in c.items:
                        if _gathers(it):
                            by_q.setdefault(it.q, set()).add(i)
                assert all(len(v) == 1 for v in by_q.values()), by_q
                for a, b in zip(calls, calls[1:]):
                    x, y = a.items[-1], b.items[0]
                    adjacent = pos[id(y)] == pos[id(x)] + 1  # a gathered member's place breaks a run
                    joinable = (adjacent and _local(x) and _local(y) and x.causal == y.causal
                                and x.kernel_window == y.kernel_window
                                and where[y.q.start] == where[x.q.stop - 1] + 1
                                and where[y.kv.start] == where[x.kv.stop - 1] + 1)  # fmt: skip
                    assert not joinable, (a, b)
    if case in (0, 2):
        assert seen_fused  # the property is not vacuous: these packings do fuse local blocks
    if case in (2, 4):
        assert seen_gathered  # ... and these gather remote kv for one q range


def test_one_rank_plan_is_one_call_per_stage() -> None:
    plan = _plan(*PLANS[0])
    for phase in (Phase.FWD, Phase.BWD):
        stages = sum(1 for ins in plan.program(0, phase).instrs if isinstance(ins, Compute))
        items = sum(len(ins.items) for ins in plan.program(0, phase).instrs if isinstance(ins, Compute))
        assert items > 40 and call_counts(plan, phase) == (stages,)


def _item(q: tuple[int, int], kv: tuple[int, int], *, slot: bool = False, causal: bool = True) -> ComputeItem:
    src = Slot(0, 64) if slot else None
    return ComputeItem(TokenRange(*q), TokenRange(*kv), causal, ((Wire.Q, None), (Wire.KV, src)),
                       ((Wire.O, None), (Wire.LSE, None)))  # fmt: skip


def test_rule_by_hand() -> None:
    rows = LocalRows((Segment(TokenRange(0, 40), 0),))
    a, b = _item((0, 10), (0, 10)), _item((10, 20), (10, 20))
    gap = _item((25, 30), (25, 30))  # rows 20..25 skipped: not adjacent to b
    remote = _item((30, 35), (20, 25), slot=True, causal=False)  # kv from a slot: a call of its own
    c = _item((35, 40), (35, 40))
    calls = stage_calls(Compute(3, (a, b, gap, remote, c)), rows)
    assert [cl.items for cl in calls] == [(a, b), (gap,), (remote,), (c,)]
    assert calls[0] == KernelCall(3, (a, b), slice(0, 20), slice(0, 20))
    assert calls[2].q_rows == slice(30, 35) and calls[2].kv_rows is None and not calls[2].causal
    assert all_local(a) and not all_local(remote)


def test_gathered_by_hand() -> None:
    """Rectangles with remote kv for one local q range form one gathered call at the first one's
    place; a causal block, another q range, a window-cut rectangle and a lone one do not."""
    rows = LocalRows((Segment(TokenRange(0, 100), 0),))
    r1 = _item((60, 70), (0, 10), slot=True, causal=False)
    loc = _item((60, 70), (60, 70))
    r2 = _item((60, 70), (20, 30), slot=True, causal=False)
    other = _item((80, 90), (0, 10), slot=True, causal=False)  # alone in its q range
    cut = ComputeItem(TokenRange(60, 70), TokenRange(50, 60), False, r1.srcs, r1.dsts, window=12)  # banded
    r3 = _item((60, 70), (30, 35), slot=True, causal=False)
    assert cut.kernel_window != (-1, -1)
    calls = stage_calls(Compute(0, (r1, loc, r2, other, cut, r3)), rows)
    assert [cl.items for cl in calls] == [(r1, r2, r3), (loc,), (other,), (cut,)]
    g = calls[0]
    assert g.gathered and g.q_rows == slice(60, 70) and g.kv_rows is None
    assert (g.q_lengths, g.kv_lengths, g.kv_parts, g.work) == ((10,), (25,), (10, 10, 5), 250)
    assert not any(c.gathered for c in calls[1:])
    # a q slot (work for another rank) never gathers, nor does a local kv
    away = ComputeItem(TokenRange(60, 70), TokenRange(0, 10), False, ((Wire.Q, Slot(0, 64)), (Wire.KV, Slot(64, 64))),
                       ((Wire.O, None), (Wire.LSE, None)))  # fmt: skip
    assert [len(c.items) for c in stage_calls(Compute(0, (away, away)), rows)] == [1, 1]


def test_local_rows_follow_segments() -> None:
    rows = LocalRows((Segment(TokenRange(10, 20), 0), Segment(TokenRange(40, 45), 10), Segment(TokenRange(45, 50), 15)))
    assert rows(TokenRange(43, 48)) == slice(13, 18)  # adjacent segments: still contiguous rows
    with pytest.raises(RuntimeMismatchError, match="not contiguous"):
        rows(TokenRange(18, 42))
    with pytest.raises(RuntimeMismatchError, match="not held"):
        rows(TokenRange(0, 5))


def _walked(plan, phase) -> tuple[int, ...]:
    """The reference count: walk every rank's program (``program_calls``)."""
    return tuple(sum(len(c) for c in program_calls(plan.program(r, phase), plan.layout.segments[r]))
                 for r in range(plan.inter_size))  # fmt: skip


@settings(deadline=None, max_examples=12)
@given(workload=st.sampled_from(["fineweb", "sharegpt", "ultrachat", "full"]), inter=st.sampled_from([2, 4, 8, 16]),
       intra=st.sampled_from([1, 2]), seed=st.integers(0, 5), layout=st.sampled_from(["balanced", "contiguous"]),
       pool=st.sampled_from([None, 1 << 19]))
def test_counts_from_blocks_equal_the_program_walk(workload, inter, intra, seed, layout, pool) -> None:
    """``call_counts`` of plans without a window (counted from the staged blocks) equals the
    walk over the programs, in both phases, on random packings, layouts and pool sizes (a small
    pool cuts blocks into more stages)."""
    from megatron_hsap.plan.workloads import pack_batches

    cu = [0, 16384] if workload == "full" else pack_batches(workload, 16384, seed + 1, 11)[seed]
    opts = {"layout": layout, "layout_fallback": False} | ({"pool_bytes": pool} if pool else {})
    plan = compile_plan(cu, inter, intra, num_heads=8, num_kv_heads=2, head_dim=16, **opts)
    for phase in (Phase.FWD, Phase.BWD):
        assert call_counts(plan, phase) == _walked(plan, phase)
    assert sum(_walked(plan, Phase.FWD)) >= len({(u.rank, u.stage) for u in plan.units()})  # at least a call per stage

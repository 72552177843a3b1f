"""The verifier can fail, and the plans it passes are right.

* Brute force: for small T the union of ``compute_units()`` (and of the backward items) equals the
  document-causal mask, built here independently as a dense numpy boolean matrix, with no pair
  twice and none missing.
* Mutations: a valid plan with one recv dropped, two sends swapped, a live slot reused, a merge
  dropped, a compute item duplicated, ... must make ``verify()`` raise ``PlanError``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import PlanError
from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Phase, Post, Recv, Round, Send, Slot, TokenRange, Wait
from megatron_hsap.plan.verify import check_coverage


def dense_mask(cu: list[int], padded: int) -> np.ndarray:
    """bool [T', T']: query i may attend key j (same document, j <= i); padding is one document."""
    bounds = sorted(set(cu) | {padded})
    doc = np.searchsorted(np.asarray(bounds), np.arange(padded), side="right")
    i = np.arange(padded)[:, None]
    j = np.arange(padded)[None, :]
    return (doc[:, None] == doc[None, :]) & (j <= i)


def count_items(items, padded: int) -> np.ndarray:
    """int [T', T']: how many items cover each (q, k) pair."""
    count = np.zeros((padded, padded), dtype=np.int64)
    for q, kv, causal in items:
        block = np.ones((len(q), len(kv)), dtype=np.int64)
        if causal:  # bottom-right aligned: row q.start + a sees keys up to q.start + a
            rows = np.arange(q.start, q.stop)[:, None]
            cols = np.arange(kv.start, kv.stop)[None, :]
            block = (cols <= rows).astype(np.int64)
        count[q.start : q.stop, kv.start : kv.stop] += block
    return count


def bwd_items(plan):
    return [(it.q, it.kv, it.causal) for p in plan.bwd_programs for ins in p.instrs if isinstance(ins, Compute) for it in ins.items]


@st.composite
def small_batches(draw):
    T = draw(st.integers(1, 160))
    n = draw(st.integers(0, 12))
    cuts = sorted(draw(st.lists(st.integers(0, T), min_size=n, max_size=n)))
    P = draw(st.integers(1, 6))
    intra = draw(st.sampled_from([1, 1, 2]))
    placement = draw(st.sampled_from(["auto", "auto", "owner-computes", "min-traffic"]))
    heads = draw(st.sampled_from([dict(num_heads=4, num_kv_heads=2, head_dim=8), dict(num_heads=32, head_dim=128)]))
    return [0, *cuts, T], P, intra, placement, heads


@settings(max_examples=150, deadline=None)
@given(small_batches())
def test_compute_units_equal_the_document_causal_mask(case) -> None:
    cu, P, intra, placement, heads = case
    plan = compile_plan(cu, P, intra, placement=placement, **heads)
    padded = plan.padded_tokens
    want = dense_mask(cu, padded)
    fwd = count_items([(q, kv, c) for _, _, q, kv, c in plan.compute_units()], padded)
    bwd = count_items(bwd_items(plan), padded)
    for got in (fwd, bwd):
        assert got.max() <= 1, "a pair computed twice"
        np.testing.assert_array_equal(got.astype(bool), want)
    plan.verify()


# --------------------------------------------------------------------------- mutations


@pytest.fixture(scope="module")
def plan():
    # one document over 4 ranks with big heads, contiguous layout: blocks move both ways (q to kv
    # owners, kv fetched); the default may keep the balanced layout, where only q moves
    p = compile_plan([0, 1 << 14], 4, num_heads=32, head_dim=128, layout="contiguous")
    p.verify()
    names = {m[3] for m in p.messages()}
    assert {"q", "kv", "o", "dq", "dkv"} <= names
    return p


def with_program(plan, phase: Phase, rank: int, instrs):
    """A copy of ``plan`` whose ``phase`` program of ``rank`` is ``instrs``."""
    code = plan.chosen.fwd if phase is Phase.FWD else plan.chosen.bwd
    progs = list(code.programs)
    progs[rank] = dataclasses.replace(progs[rank], instrs=tuple(instrs))
    code = dataclasses.replace(code, programs=tuple(progs))
    chosen = dataclasses.replace(plan.chosen, **({"fwd": code} if phase is Phase.FWD else {"bwd": code}))
    return dataclasses.replace(plan, chosen=chosen)


def find(plan, phase: Phase, pred):
    """First (rank, index, instr) of ``phase`` programs with ``pred(instr)``."""
    progs = plan.fwd_programs if phase is Phase.FWD else plan.bwd_programs
    for prog in progs:
        for idx, ins in enumerate(prog.instrs):
            if pred(ins):
                return prog.rank, idx, ins
    raise AssertionError("no such instruction")


def replace_round(plan, phase, rank, idx, ops):
    instrs = list(plan.program(rank, phase).instrs)
    instrs[idx] = Post(Round(instrs[idx].round.index, tuple(ops)))
    return with_program(plan, phase, rank, instrs)


@pytest.mark.parametrize("phase", [Phase.FWD, Phase.BWD])
def test_drop_a_recv(plan, phase) -> None:
    rank, idx, ins = find(plan, phase, lambda i: isinstance(i, Post) and any(isinstance(o, Recv) for o in i.round.ops))
    ops = list(ins.round.ops)
    ops.remove(next(o for o in ops if isinstance(o, Recv)))
    with pytest.raises(PlanError, match="unmatched batch"):
        replace_round(plan, phase, rank, idx, ops).verify()


def test_swap_two_sends_to_one_peer(plan) -> None:
    def two_sends(i) -> bool:
        if not isinstance(i, Post):
            return False
        peers = [o.peer for o in i.round.ops if isinstance(o, Send)]
        return any(peers.count(p) >= 2 for p in peers)

    rank, idx, ins = find(plan, Phase.BWD, two_sends)
    ops = list(ins.round.ops)
    sends = [k for k, o in enumerate(ops) if isinstance(o, Send)]
    a, b = next((x, y) for x in sends for y in sends if x < y and ops[x].peer == ops[y].peer)
    ops[a], ops[b] = ops[b], ops[a]
    with pytest.raises(PlanError, match="unmatched batch"):
        replace_round(plan, Phase.BWD, rank, idx, ops).verify()


def test_reuse_a_live_slot(plan) -> None:
    rank, idx, ins = find(plan, Phase.FWD, lambda i: isinstance(i, Post) and sum(isinstance(o, Recv) for o in i.round.ops) >= 2)
    ops = list(ins.round.ops)
    recvs = [k for k, o in enumerate(ops) if isinstance(o, Recv)]
    first, second = ops[recvs[0]], ops[recvs[1]]
    ops[recvs[1]] = dataclasses.replace(second, dst=Slot(first.dst.offset, second.nbytes))  # overlaps a pending receive
    with pytest.raises(PlanError, match="reused while live"):
        replace_round(plan, Phase.FWD, rank, idx, ops).verify()


def test_result_written_over_a_pending_receive(plan) -> None:
    def stage_with_recv_and_result(i) -> bool:
        return isinstance(i, Compute) and any(s is not None for it in i.items for _, s in it.dsts)

    rank, idx, comp = find(plan, Phase.FWD, stage_with_recv_and_result)
    instrs = list(plan.program(rank, Phase.FWD).instrs)
    post = next(i for i in reversed(instrs[:idx]) if isinstance(i, Post))
    recv = next((o for o in post.round.ops if isinstance(o, Recv)), None)
    if recv is None:
        pytest.skip("no receive in flight during this stage")
    items = list(comp.items)
    k = next(n for n, it in enumerate(items) if any(s is not None for _, s in it.dsts))
    it = items[k]
    dsts = tuple((w, Slot(recv.dst.offset, s.nbytes) if s is not None else None) for w, s in it.dsts)
    items[k] = dataclasses.replace(it, dsts=dsts)
    instrs[idx] = Compute(comp.stage, tuple(items))
    with pytest.raises(PlanError):
        with_program(plan, Phase.FWD, rank, instrs).verify()


def test_drop_a_merge(plan) -> None:
    rank, idx, _ = find(plan, Phase.FWD, lambda i: isinstance(i, Merge))
    instrs = list(plan.program(rank, Phase.FWD).instrs)
    del instrs[idx]
    with pytest.raises(PlanError, match="delivered 0 times"):
        with_program(plan, Phase.FWD, rank, instrs).verify()


def test_drop_an_accumulate(plan) -> None:
    rank, idx, _ = find(plan, Phase.BWD, lambda i: isinstance(i, Accumulate))
    instrs = list(plan.program(rank, Phase.BWD).instrs)
    del instrs[idx]
    with pytest.raises(PlanError, match="delivered 0 times"):
        with_program(plan, Phase.BWD, rank, instrs).verify()


@pytest.mark.parametrize("phase", [Phase.FWD, Phase.BWD])
def test_duplicate_a_compute_item(plan, phase) -> None:
    rank, idx, comp = find(plan, phase, lambda i: isinstance(i, Compute))
    instrs = list(plan.program(rank, phase).instrs)
    instrs[idx] = Compute(comp.stage, comp.items + comp.items[:1])
    with pytest.raises(PlanError):
        with_program(plan, phase, rank, instrs).verify()


def test_drop_a_compute_item(plan) -> None:
    rank, idx, comp = find(plan, Phase.FWD, lambda i: isinstance(i, Compute))
    instrs = list(plan.program(rank, Phase.FWD).instrs)
    if len(comp.items) >= 2:
        instrs[idx] = Compute(comp.stage, comp.items[1:])
    else:
        del instrs[idx]
    with pytest.raises(PlanError):
        with_program(plan, Phase.FWD, rank, instrs).verify()


def test_drop_a_wait(plan) -> None:
    rank, idx, _ = find(plan, Phase.FWD, lambda i: isinstance(i, Wait))
    instrs = list(plan.program(rank, Phase.FWD).instrs)
    del instrs[idx]
    with pytest.raises(PlanError, match="not waited|never waited"):
        with_program(plan, Phase.FWD, rank, instrs).verify()


def test_compute_before_its_inputs_arrive(plan) -> None:
    # move a stage that reads the pool in front of the wait of the round that fed it
    def reads_pool(i) -> bool:
        return isinstance(i, Compute) and any(s is not None for it in i.items for _, s in it.srcs)

    rank, idx, comp = find(plan, Phase.FWD, reads_pool)
    instrs = list(plan.program(rank, Phase.FWD).instrs)
    del instrs[idx]
    wait = max(k for k, i in enumerate(instrs[:idx]) if isinstance(i, Wait))
    instrs.insert(wait, comp)
    with pytest.raises(PlanError):
        with_program(plan, Phase.FWD, rank, instrs).verify()


def test_wrong_byte_count(plan) -> None:
    rank, idx, ins = find(plan, Phase.FWD, lambda i: isinstance(i, Post) and any(isinstance(o, Send) for o in i.round.ops))
    ops = list(ins.round.ops)
    k = next(n for n, o in enumerate(ops) if isinstance(o, Send))
    ops[k] = dataclasses.replace(ops[k], nbytes=ops[k].nbytes + 2)
    with pytest.raises(PlanError, match="bytes"):
        replace_round(plan, Phase.FWD, rank, idx, ops).verify()


def test_send_rows_not_owned(plan) -> None:
    rank, idx, ins = find(plan, Phase.FWD, lambda i: isinstance(i, Post) and any(isinstance(o, Send) and o.src is None for o in i.round.ops))
    ops = list(ins.round.ops)
    k = next(n for n, o in enumerate(ops) if isinstance(o, Send) and o.src is None)
    shift = plan.chunk_tokens if ops[k].tokens.stop + plan.chunk_tokens <= plan.padded_tokens else -plan.chunk_tokens
    tokens = TokenRange(ops[k].tokens.start + shift, ops[k].tokens.stop + shift)
    ops[k] = dataclasses.replace(ops[k], tokens=tokens)
    with pytest.raises(PlanError):
        replace_round(plan, Phase.FWD, rank, idx, ops).verify()


def test_coverage_checker_finds_overlap_and_gap(plan) -> None:
    items = [it for p in plan.fwd_programs for ins in p.instrs if isinstance(ins, Compute) for it in ins.items]
    check_coverage(plan, items)  # the real items pass
    rect = next(it for it in items if not it.causal and len(it.kv) >= 2)
    shrunk = dataclasses.replace(rect, kv=TokenRange(rect.kv.start, rect.kv.stop - 1))
    grown = dataclasses.replace(rect, kv=TokenRange(rect.kv.start, rect.kv.stop - 1))
    with pytest.raises(PlanError):  # one key column never computed
        check_coverage(plan, [shrunk if it is rect else it for it in items])
    extra = dataclasses.replace(grown, kv=TokenRange(rect.kv.start, rect.kv.start + 1))
    with pytest.raises(PlanError):  # one column computed twice (the pair count is off as well)
        check_coverage(plan, items + [extra])

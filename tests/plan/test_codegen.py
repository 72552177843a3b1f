"""plan/codegen.py: every message's bytes equal rows × the wire format's bytes per row
(re-derived here from docs/design.md §4, not from ``HeadShape``), every Send has exactly one
matching Recv on its peer in the same round, every received slot is read by a later compute item,
merge or accumulate of that rank, and slots are 256-byte aligned (docs/design.md §2.1 step 4).

Plans use a tiny pool so that remote blocks, results and many rounds appear."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings, strategies as st

from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.codegen import ALIGN
from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Phase, Post, Recv, Send, Wire

H, HKV, D, DV, B = 4, 2, 16, 8, 2  # small heads; d_v != d_qk so q/kv/o byte sizes all differ
ROW_BYTES = {  # bytes per token row of each wire, from the wire formats of docs/design.md §4
    # (partial gradients in the activation dtype: the default grad_wire_dtype)
    Wire.Q: H * D * B, Wire.KV: HKV * (D + DV) * B, Wire.O: H * DV * B, Wire.LSE: H * 4,
    Wire.DO: H * DV * B, Wire.DELTA: H * 4, Wire.DQ: H * D * B, Wire.DKV: HKV * (D + DV) * B,
}


def plan_for(lengths: list[int], inter: int, layout: str, pool: int):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return compile_plan(cu, inter, num_heads=H, num_kv_heads=HKV, head_dim=D, head_dim_v=DV,
                        dtype_bytes=B, layout=layout, pool_bytes=pool)


def check_code(plan) -> int:
    n_msgs = 0
    for phase in (Phase.FWD, Phase.BWD):
        sends, recvs = Counter(), Counter()
        for rank in range(plan.inter_size):
            prog = plan.program(rank, phase)
            read = set()
            for ins in prog.instrs:
                if isinstance(ins, Compute):
                    read |= {s for it in ins.items for _, s in it.srcs if s is not None}
                elif isinstance(ins, Merge):
                    read |= {ins.o, ins.lse}
                elif isinstance(ins, Accumulate):
                    read.add(ins.src)
            for ins in prog.instrs:
                if not isinstance(ins, Post):
                    continue
                for op in ins.round.ops:
                    assert op.nbytes == len(op.tokens) * ROW_BYTES[op.wire], op
                    if isinstance(op, Send):
                        sends[(ins.round.index, rank, op.peer, op.wire, op.tokens)] += 1
                    else:
                        assert isinstance(op, Recv)
                        assert op.dst.offset % ALIGN == 0 and op.dst.nbytes == op.nbytes
                        assert op.dst.end <= plan.pool_capacity
                        assert op.dst in read, f"rank {rank} {phase.value}: {op} is never used"
                        recvs[(ins.round.index, op.peer, rank, op.wire, op.tokens)] += 1
        assert sends == recvs  # every send has its receive on the peer, in the same round
        msgs = plan.raw_messages(phase)
        assert sum(sends.values()) == len(msgs)
        for m in msgs:
            assert m.nbytes == len(m.tokens) * ROW_BYTES[m.wire] and m.src != m.dst
        n_msgs += len(msgs)
    return n_msgs


def test_hand_made_batch_has_results_of_every_wire() -> None:
    plan = plan_for([50, 80, 1, 119, 6], 4, "contiguous", 4096)
    assert check_code(plan) > 0
    wires = {m.wire for ph in Phase for m in plan.raw_messages(ph)}
    assert wires == set(Wire)  # every wire travels, so the byte rule is checked on each format
    plan.verify()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4),
       st.sampled_from(["contiguous", "balanced"]), st.sampled_from([4096, 16384, None]))
def test_random_packings_bytes_and_matching(lengths, inter, layout, pool) -> None:
    check_code(plan_for(lengths, inter, layout, pool))


def _live_from_messages(code, size: int, results: set) -> list[int]:
    """Each rank's most bytes live at one event step, from the emitted messages alone: an input
    received in round r lives [2r, 2r + 3] on its receiver, a result received in round r
    [2r, 2r + 1]; a result sent in round r was computed at stage r − 1 into a slot of its sender
    living [2r − 2, 2r + 1] (docs/design.md §2.1 step 4)."""
    steps = 2 * code.rounds + 4
    live = [[0] * steps for _ in range(size)]
    for m in code.messages:
        r = m.round  # (within the phase)
        spans = [(m.dst, 2 * r, 2 * r + (1 if m.wire in results else 3))]
        if m.wire in results:
            spans.append((m.src, 2 * r - 2, 2 * r + 1))
        for rank, a, b in spans:
            for t in range(a, b + 1):
                live[rank][t] += m.nbytes
    return [max(row) for row in live]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4),
       st.sampled_from(["contiguous", "balanced"]), st.sampled_from([4096, 16384]))
def test_live_peak_bound_is_the_live_bytes_of_the_messages(lengths, inter, layout, pool) -> None:
    """``codegen._live_peak`` (computed from the staged blocks before any message exists, to
    refuse a staging that must overflow) equals the live bytes of the messages ``generate``
    emitted, and never exceeds the slot peak first fit reached (so it refuses no staging that fits)."""
    from megatron_hsap.plan.codegen import _live_peak
    from megatron_hsap.plan.ir import PHASE_WIRES, Unit

    plan = plan_for(lengths, inter, layout, pool)
    units = sorted(plan.chosen.units, key=Unit.program_key)
    for phase, code in ((Phase.FWD, plan.chosen.fwd), (Phase.BWD, plan.chosen.bwd)):
        bound = _live_peak(units, phase, inter, plan.shape, code.rounds - 1)
        if code.messages:
            assert bound == _live_from_messages(code, inter, set(PHASE_WIRES[phase].results))
        else:
            assert bound == [0] * inter
        assert all(b <= p <= plan.pool_capacity for b, p in zip(bound, code.pool_peak))

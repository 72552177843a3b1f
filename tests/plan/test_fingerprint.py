"""plan/fingerprint.py: equal inputs hash equal (also after the plan cache is cleared, i.e. a
fresh compile), any single changed input — one ``cu_seqlens`` boundary or one ``PlanOptions``
field — changes ``plan_hash`` and is named by ``differing_inputs``; ``split_hash``/``join_hash``
round-trip; ``pair_round_bytes`` equals the bytes re-summed from the programs' Send/Recv ops
(docs/design.md §2.1 plan identity).

Reference: the plans' own programs, read op by op here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan import clear_plan_cache
from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.fingerprint import (INPUT_NAMES, differing_inputs, input_vector, join_hash,
                                            pair_round_bytes, plan_hash, split_hash)
from megatron_hsap.plan.ir import Phase, Post, Recv, Send

CU = [0, 50, 130, 131, 250, 256]
BASE = dict(num_heads=4, num_kv_heads=2, head_dim=16, layout="contiguous", pool_bytes=8192)
CHANGES = [  # one input changed at a time (each yields a different plan or different options)
    ("cu_seqlens", dict(cu=[0, 50, 129, 131, 250, 256])),
    ("pool_bytes", dict(pool_bytes=16384)),
    ("num_heads", dict(num_heads=8)),
    ("num_kv_heads", dict(num_kv_heads=4)),
    ("head_dim", dict(head_dim=32)),
    ("dtype_bytes", dict(dtype_bytes=4)),
    ("layout", dict(layout="balanced")),
    ("placement", dict(placement="owner-computes")),
    ("hardware", dict(hardware="h100")),
    ("link", dict(link="nvlink")),
    ("allow_helpers", dict(allow_helpers=False)),
]


def make(cu=CU, inter=4, **over):
    return compile_plan(cu, inter, **{**BASE, **over})


def test_equal_inputs_hash_equal_across_fresh_compiles() -> None:
    a = make()
    clear_plan_cache()
    b = make()
    assert a is not b and plan_hash(a) == plan_hash(b) == a.hash
    assert input_vector(a) == input_vector(b) and len(input_vector(a)) == len(INPUT_NAMES)
    assert "no input differs" in differing_inputs(a, input_vector(b))


@pytest.mark.parametrize("name,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_any_single_changed_input_changes_the_hash(name, change) -> None:
    base = make()
    cu = change.get("cu", CU)
    other = make(cu, **{k: v for k, v in change.items() if k != "cu"})
    assert plan_hash(other) != plan_hash(base)
    assert differing_inputs(base, input_vector(other)).startswith(name)


def test_inter_size_changes_the_hash() -> None:
    assert plan_hash(make(inter=2)) != plan_hash(make(inter=4))
    assert "inter_size" in differing_inputs(make(inter=4), input_vector(make(inter=2)))


@given(st.integers(0, (1 << 128) - 1))
@settings(max_examples=50, deadline=None)
def test_split_join_round_trip(value: int) -> None:
    hi, lo = split_hash(value)
    assert -(1 << 63) <= hi < 1 << 63 and -(1 << 63) <= lo < 1 << 63  # fits int64 tensor elements
    assert join_hash(hi, lo) == value


def test_pair_round_bytes_match_the_programs() -> None:
    plan = make()
    assert plan.stats().messages_fwd > 0 and plan.stats().messages_bwd > 0  # not a vacuous check
    for phase in Phase:
        base = plan.round_base[phase]
        for rank in range(4):
            for peer in range(4):
                want = []
                for ins in plan.program(rank, phase).instrs:
                    if isinstance(ins, Post):
                        s = sum(op.nbytes for op in ins.round.ops if isinstance(op, Send) and op.peer == peer)
                        r = sum(op.nbytes for op in ins.round.ops if isinstance(op, Recv) and op.peer == peer)
                        if s or r:
                            want.append((ins.round.index - base, s, r))
                assert pair_round_bytes(plan, phase, rank, peer) == tuple(want)
                # what rank sends to peer is what peer expects from rank, round by round
                theirs = {k: (r, s) for k, s, r in pair_round_bytes(plan, phase, peer, rank)}
                assert {k: (s, r) for k, s, r in want} == theirs

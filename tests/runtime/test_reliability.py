"""Failures are loud and uniform: mismatched batches, stuck P2P rounds and wrong inputs raise
``HSAPError`` subclasses on every rank, naming what to change — never a hang.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.ir import Post, Recv
from megatron_hsap.runtime.consistency import cu_seqlens_fingerprint
from tests.runtime import cases, reliability_cases


def test_fingerprint_tells_batches_apart():
    a = cu_seqlens_fingerprint([0, 5, 9, 16])
    assert a == cu_seqlens_fingerprint(np.array([0, 5, 9, 16], dtype=np.int32))  # dtype does not matter
    assert a[1:] == (4, 16)
    assert a != cu_seqlens_fingerprint([0, 5, 10, 16])  # same length and T, other boundaries
    assert cu_seqlens_fingerprint([0.0, 3.5])[1] == -1  # unreadable: still exchanged, flagged


def test_mismatched_cu_seqlens_raise_on_every_rank(gloo_pool):
    pool = gloo_pool(4)
    same = [0, 7, 7, 30, 64]
    assert pool.run(reliability_cases.case_consistency, [same] * 4) == ["ok | after: 4"] * 4
    other = [same, same, [0, 8, 30, 64], same]
    for message in pool.run(reliability_cases.case_consistency, other):
        assert message.startswith("BatchError: ranks of one context-parallel group hold different cu_seqlens")
        assert "group ranks [0, 1, 3] (global [0, 1, 3]): 5 entries, T=64" in message
        assert "group ranks [2] (global [2]): 4 entries, T=64" in message
        assert message.endswith("| after: 4")  # every rank got past the check: nobody hangs
    broken = [same, [0.0, 64.0], same, same]
    for message in pool.run(reliability_cases.case_consistency, broken):
        assert "group ranks [1] (global [1]): cu_seqlens is not a 1-D integer sequence" in message


def test_debug_mode_checks_the_batch_inside_the_layer(gloo_pool):
    cu = [[0, 10, 64]] * 3 + [[0, 11, 64]]
    for message in gloo_pool(4).run(reliability_cases.case_debug_layer, cu, 2, 2):
        assert message.startswith("BatchError: HSAP_DEBUG"), message
        assert message.endswith("data calls: []")  # raised before any all-to-all or P2P


def _first_round_with(plan, rank: int) -> int:
    for ins in plan.program(rank, "fwd").instrs:
        if isinstance(ins, Post):
            return ins.round.index
    raise AssertionError(f"rank {rank} has no forward round")


def test_p2p_timeout_names_round_peer_and_tensor(gloo_pool):
    world, cu = 4, [0, 128]  # one document over every chunk: every rank exchanges KV or Q
    plan = compile_plan(cu, world, 1, num_heads=8, num_kv_heads=8, head_dim=8, dtype_bytes=4)
    skip_rank = 0
    rnd = _first_round_with(plan, skip_rank)
    # ranks that expect something from (or send something to) rank 0 in that round
    waiting = {}
    for r in range(1, world):
        for ins in plan.program(r, "fwd").instrs:
            if isinstance(ins, Post) and ins.round.index == rnd:
                ops = [op for op in ins.round.ops if op.peer == skip_rank]
                if ops:
                    waiting[r] = ops[0]
    assert waiting, "the plan must make some rank depend on rank 0 in its first round"
    results = gloo_pool(world).run(reliability_cases.case_timeout, cu, skip_rank, rnd, 2.0, timeout=120)
    for r, op in waiting.items():
        msg = results[r]
        assert msg.startswith(f"CommunicationError: P2P round {rnd} (fwd stage {rnd})"), msg
        direction = "recv from" if isinstance(op, Recv) else "send to"
        assert re.search(rf"{direction} peer {skip_rank} \(group rank\), tensor {op.wire.value}\[", msg), msg
        assert "did not complete within 2 s" in msg


@pytest.mark.parametrize(
    ("kind", "error", "says"),
    [
        ("t_local", "RuntimeMismatchError", "q has shape (15, 8, 8) but the plan expects [16, 8, 8]"),
        ("heads", "RuntimeMismatchError", "num_heads=8"),
        ("kv_heads", "RuntimeMismatchError", "k has shape (16, 8, 8) but the plan expects [16, 2, 8]"),
        ("head_dim_v", "RuntimeMismatchError", "v has shape (16, 2, 4)"),
        ("dtype", "RuntimeMismatchError", "compile it with dtype_bytes=2"),
        ("mixed_dtype", "RuntimeMismatchError", "dtypes differ"),
        ("device", "RuntimeMismatchError", "different devices"),
        ("world_size", "ConfigError", "the inter group has 4 ranks but the plan was compiled for inter_size=2"),
        ("missing_group", "ConfigError", "intra_group is None but the plan has intra_size=2"),
    ],
)
def test_wrong_inputs_raise_before_any_collective(gloo_pool, kind, error, says):
    for message in gloo_pool(4).run(reliability_cases.case_bad_input, kind):
        assert message.startswith(f"{error}: "), message
        assert says in message, message
        assert message.endswith("| collectives: 0"), message


def test_p2p_channel_refuses_misuse(gloo_pool):
    for rank, out in enumerate(gloo_pool(2).run(reliability_cases.case_p2p_misuse)):
        assert out[0].startswith("P2P misuse: round 1 posted while round 0 is still in flight")
        assert out[1] == "P2P misuse: wait for round 1 but round 0 is in flight"
        assert out[2] == "P2P misuse: round 0 was posted but never waited"
        assert "is not contiguous" in out[3]
        assert out[4] == f"received {[float(1 - rank)] * 3} bytes 12/12"


def test_large_logits_merge_without_overflow(gloo_pool):
    # logits ≈ 1e4 (exact fp32 integers): exp() of them overflows even float64 without the max shift
    specs = [cases.build_spec([0, 40, 96, 128], inter=4, large_logits=True, seed=s, heads=8, kv_heads=kv, dim=8)
             for s, kv in ((1, 8), (2, 1))]  # fmt: skip
    results = gloo_pool(4).run(cases.run_cases, specs)
    for i, spec in enumerate(specs):
        cases.check_against_reference(spec, [r[i] for r in results])

"""The executor on its own: row mapping, batching, the receive pool, byte and time accounting.

Multi-rank numerics live in test_sap_exactness / test_hsap_exactness; here every check is about
*how* the executor runs a plan: it allocates the pool once, sends exactly the plan's bytes, batches
local blocks into one kernel call without changing a bit, and accounts compute vs communication.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hsap.errors import RuntimeMismatchError
from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.ir import Compute, Phase, Segment, TokenRange
from megatron_hsap.runtime import hsap_attn_func
from megatron_hsap.plan.calls import LocalRows, call_counts
from megatron_hsap.runtime.executor import Executor, _out_for_delta
from megatron_hsap.runtime.hsap import runner_for
from tests.reference import reference_packed
from tests.runtime import cases, reliability_cases


def test_rows_follow_segments():
    rows = LocalRows((Segment(TokenRange(10, 20), 0), Segment(TokenRange(40, 45), 10), Segment(TokenRange(45, 50), 15)))
    assert rows(TokenRange(12, 20)) == slice(2, 10)
    assert rows(TokenRange(41, 44)) == slice(11, 14)
    assert rows(TokenRange(43, 48)) == slice(13, 18)  # adjacent segments: still contiguous rows
    with pytest.raises(RuntimeMismatchError, match="not contiguous"):
        rows(TokenRange(18, 42))
    with pytest.raises(RuntimeMismatchError, match="not held"):
        rows(TokenRange(0, 5))


def test_out_for_delta_reproduces_delta():
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(5, 3, 4, generator=gen)
    do[2, 1] = 0.0  # a row with no upstream gradient has delta 0
    delta = torch.randn(5, 3, generator=gen)
    delta[2, 1] = 0.0
    out = _out_for_delta(do, delta, "torch_cuda")
    torch.testing.assert_close((do * out).sum(-1), delta, rtol=1e-5, atol=1e-6)  # fp32 rounding only
    assert _out_for_delta(do, delta, "cpu") is do  # the CPU kernel reads delta itself


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_single_rank_plan_matches_reference_and_batches_local_blocks(kv_heads):
    # 1×1: no torch.distributed at all. 40 one-token documents and a few longer ones: every block
    # is local, so consecutive ones must run as ONE varlen call per stage.
    cu = [*range(41), 45, 45, 60, 64]
    plan = compile_plan(cu, 1, 1, num_heads=4, num_kv_heads=kv_heads, head_dim=8, head_dim_v=6, dtype_bytes=4)
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(64, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(64, kv_heads, 8, generator=gen, requires_grad=True)
    v = torch.randn(64, kv_heads, 6, generator=gen, requires_grad=True)
    out = hsap_attn_func(q, k, v, plan)
    do = torch.randn_like(out)
    out.backward(do)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref, _ = reference_packed(*leaves, cu, 8**-0.5)
    ref.backward(do.double())
    # fp32 kernels over <= 19 keys: 1e-5 of max(1, |ref|) covers the rounding
    for got, want in ((out.detach(), ref.detach()), (q.grad, leaves[0].grad), (k.grad, leaves[1].grad),
                      (v.grad, leaves[2].grad)):  # fmt: skip
        assert float((got.double() - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    ex = runner_for(plan).executor
    items = sum(len(ins.items) for ins in plan.program(0, "fwd").instrs if isinstance(ins, Compute))
    stages = sum(1 for ins in plan.program(0, "fwd").instrs if isinstance(ins, Compute))
    assert items > 40 and ex.stats["fwd"].kernel_calls == stages  # one call per stage
    assert ex.stats["fwd"].bytes_sent == 0 and ex.stats["fwd"].compute_s > 0


def test_batching_changes_no_bit():
    # Local blocks batched into one varlen call give the bits of one call per document.
    cu = [0, 3, 9, 10, 30, 31, 32]
    plan = compile_plan(cu, 1, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(32, 2, 4, generator=gen) for _ in range(3))
    batched = Executor(plan, None, "cpu")
    out_b, lse_b = batched.forward(q, k, v, 0.5)
    assert batched.stats["fwd"].kernel_calls < len(cu) - 1
    # one call per item, by hand, through the kernels: the batched call is per sequence anyway
    from megatron_hsap.runtime.kernels import attn_forward

    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            one = torch.tensor([0, b - a], dtype=torch.int32)
            o, lse = attn_forward(q[a:b], k[a:b], v[a:b], cu_seqlens_q=one, cu_seqlens_k=one, max_seqlen_q=b - a,
                                  max_seqlen_k=b - a, causal=True, softmax_scale=0.5)  # fmt: skip
            assert torch.equal(out_b[a:b], o) and torch.equal(lse_b[a:b], lse)


def test_pool_allocated_once_and_reused(gloo_pool):
    small = cases.build_spec([0, 20, 64], inter=2, seed=1, pool_bytes=8192)
    default = cases.build_spec([0, 5, 40, 64], inter=2, seed=2)  # 4 × chunk × heads × (d + dv) × 4 B
    bigger = cases.build_spec([0, 64], inter=2, seed=3, pool_bytes=1 << 20)
    seen = gloo_pool(2).run(reliability_cases.case_pool_reuse, [default, small, default, bigger, small], 3)
    cap_default = cases.compile_for(default).pool_capacity
    for per_rank in seen:
        first = per_rank[:9]  # default ×3, small ×3, default ×3: one allocation, never resized
        assert len(set(first)) == 1 and first[0][1] == cap_default
        assert all(numel == 1 << 20 for _, numel in per_rank[9:])  # grown once, for the bigger plan
        assert len(set(per_rank[9:])) == 1


def test_bytes_and_time_split_are_accounted(gloo_pool):
    specs = [cases.build_spec(cu, inter=4, seed=n, pool_bytes=pool)
             for n, (cu, pool) in enumerate([([0, 128], None), ([0, 17, 60, 61, 128], 4096), ([0, 100, 120], None)])]  # fmt: skip
    results = gloo_pool(4).run(cases.run_cases, specs)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in results]
        cases.check_bytes(spec, per_rank)  # executor == plan, per rank and phase, exactly
        assert sum(r["stats"]["fwd"]["bytes_sent"] for r in per_rank) > 0
        for r in per_rank:
            for phase in ("fwd", "bwd"):
                st = r["stats"][phase]
                assert st["calls"] == 1 and st["compute_s"] > 0 and st["comm_s"] >= 0
                assert st["wall_s"] >= st["compute_s"] and st["wall_s"] >= st["comm_s"]


# --------------------------------------------------------------------------- kernel calls = plan/calls.py


def _count_kernel_calls(plan, cu_seed: int) -> dict[str, int]:
    """Run one forward and backward of ``plan`` on this rank (default group), counting the kernel
    invocations themselves (the executor's attn_forward / attn_backward, patched)."""
    import torch.distributed as dist

    import megatron_hsap.runtime.executor as executor_mod

    counts = {"fwd": 0, "bwd": 0}
    fwd, bwd = executor_mod.attn_forward, executor_mod.attn_backward

    def counting(fn, phase):
        def wrapped(*args, **kwargs):
            counts[phase] += 1
            return fn(*args, **kwargs)
        return wrapped

    executor_mod.attn_forward, executor_mod.attn_backward = counting(fwd, "fwd"), counting(bwd, "bwd")
    try:
        group = None if plan.inter_size == 1 else dist.group.WORLD
        ex = Executor(plan, group, "cpu", backend="cpu")
        s, t = plan.shape, plan.chunk_tokens
        gen = torch.Generator().manual_seed(cu_seed + ex.rank)
        q = torch.randn(t, s.num_heads, s.head_dim, generator=gen)
        k = torch.randn(t, s.num_kv_heads, s.head_dim, generator=gen)
        v = torch.randn(t, s.num_kv_heads, s.head_dim_v, generator=gen)
        out, lse = ex.forward(q, k, v, 0.5)
        ex.backward(torch.randn(out.shape, generator=gen), q, k, v, out, lse, 0.5)
    finally:
        executor_mod.attn_forward, executor_mod.attn_backward = fwd, bwd
    assert counts == {"fwd": ex.stats[Phase.FWD].kernel_calls, "bwd": ex.stats[Phase.BWD].kernel_calls}
    return {"rank": ex.rank, **counts}


def case_kernel_calls(specs: list[tuple]) -> list[dict[str, int]]:
    return [_count_kernel_calls(compile_plan(cu, inter, 1, **_OPTS, **opts), n) for n, (cu, inter, opts) in enumerate(specs)]


_OPTS = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "dtype_bytes": 4}


def test_kernel_invocations_are_the_plans_calls_one_rank():
    # stated property: the runtime launches exactly plan/calls.py's calls (one per stage here)
    for cu, opts in (([*range(41), 45, 45, 60, 64], {}), ([0, 3, 9, 10, 30, 31, 32], {"window_size": (4, 0)})):
        plan = compile_plan(cu, 1, 1, **_OPTS, **opts)
        got = _count_kernel_calls(plan, 0)
        assert (got["fwd"], got["bwd"]) == (call_counts(plan, "fwd")[0], call_counts(plan, "bwd")[0]) and got["fwd"] > 0


def test_kernel_invocations_are_the_plans_calls_four_ranks(gloo_pool):
    specs = [([0, 17, 60, 61, 128], 4, {"pool_bytes": 16384}), ([0, 100, 120, 128], 4, {"layout": "balanced", "layout_fallback": False}),
             ([0, 30, 31, 90, 128], 4, {"window_size": (16, 0)})]  # fmt: skip
    results = gloo_pool(4).run(case_kernel_calls, specs)
    for i, (cu, inter, opts) in enumerate(specs):
        plan = compile_plan(cu, inter, 1, **_OPTS, **opts)
        want = {ph: call_counts(plan, ph) for ph in ("fwd", "bwd")}
        got = {ph: tuple(r[i][ph] for r in sorted(results, key=lambda rr: rr[i]["rank"])) for ph in ("fwd", "bwd")}
        assert got == want and sum(want["fwd"]) > 0


def test_prepared_steps_mirror_the_program_by_type():
    # each IR instruction becomes exactly one typed step, in order, with the plan/calls.py calls
    from megatron_hsap.plan.calls import stage_calls
    from megatron_hsap.plan.ir import Accumulate, Merge, Post, Wait
    from megatron_hsap.runtime.prepared import (AccumulatePartial, ComputeCalls, MergePartial, PostRound, WaitRound,
                                                prepare)  # fmt: skip

    plan = compile_plan([0, 100, 120, 128], 4, 1, **_OPTS, pool_bytes=16384)  # merges received partials too
    kinds = set()
    for rank in range(4):
        rows = LocalRows(plan.layout.segments[rank])
        progs = (plan.program(rank, Phase.FWD), plan.program(rank, Phase.BWD))
        base = plan.round_base
        preps = prepare(progs, rows, torch.device("cpu"), (base[Phase.FWD], base[Phase.BWD]))
        for prog, prep, b in zip(progs, preps, (base[Phase.FWD], base[Phase.BWD])):
            assert len(prep.steps) == len(prog.instrs)
            for ins, step in zip(prog.instrs, prep.steps):
                kinds.add(type(step).__name__)
                match ins:
                    case Post():
                        assert step == PostRound(ins.round, ins.round.index - b) and step.stage >= 0
                    case Wait():
                        assert step == WaitRound(ins.index)
                    case Compute():
                        assert isinstance(step, ComputeCalls) and step.stage == ins.stage
                        assert tuple(c.call for c in step.calls) == stage_calls(ins, rows)
                    case Merge():
                        assert step == MergePartial(rows(ins.tokens), len(ins.tokens), ins.o, ins.lse)
                    case Accumulate():
                        assert step == AccumulatePartial(ins.wire, rows(ins.tokens), len(ins.tokens), ins.src)
            assert prep.kernel_calls == call_counts(plan, prog.phase)[rank]
    assert kinds == {"PostRound", "WaitRound", "ComputeCalls", "MergePartial", "AccumulatePartial"}


# --------------------------------------------------------------------------- gathered calls


def _gathered(plan) -> int:
    from megatron_hsap.plan.calls import program_calls

    return sum(c.gathered for ph in Phase for r in range(plan.inter_size)
               for st in program_calls(plan.program(r, ph), plan.layout.segments[r]) for c in st)  # fmt: skip


def test_gathered_calls_match_the_reference(gloo_pool):
    """Plans whose stages gather several remote kv slots for one local q range into one call
    (plan/calls.py): outputs and dq/dk/dv equal the float64 reference of the whole batch (the
    gradients of the concatenated kv split back into each part's result slot), and every rank
    sends and receives exactly the plan's bytes; MHA and GQA, one and several documents."""
    specs = [cases.build_spec([0, 100, 120, 128], inter=4, layout="balanced", seed=1),
             cases.build_spec([0, 40, 300, 310, 512], inter=4, layout="balanced", kv_heads=2, seed=2),
             cases.build_spec([0, 512], inter=4, layout="balanced", heads=4, kv_heads=1, dim_v=6, seed=3)]  # fmt: skip
    assert all(_gathered(cases.compile_for(s)) >= 2 for s in specs)  # not vacuous: every plan gathers
    results = gloo_pool(4).run(cases.run_cases, specs)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in results]
        cases.check_against_reference(spec, per_rank)
        cases.check_bytes(spec, per_rank)

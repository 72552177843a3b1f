"""The planner's API on hand-made batches: units and patterns, layout, messages, dump, stats,
bad input, padding, determinism, the cache and the no-torch rule (docs/design.md §2.1, §3).

These tests pin the paper's ``contiguous`` layout (their expectations are its chunks); the
balanced layout (the default) has its own tests in ``test_balanced.py`` and ``test_properties.py``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron_hsap.errors import BatchError, ConfigError, HSAPError
from megatron_hsap.plan import clear_plan_cache
from megatron_hsap.plan.ir import Compute, Phase, Post, Recv, Send, TokenRange, Wire
from tests.configured import compile_plan  # the configured topology (flatten="never")

# Small heads keep byte counts readable; the planner's decisions do not depend on them here.
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, layout="contiguous")

# Figure 3 of the paper, scaled to 64 tokens per rank: 8 ranks, 6 documents; S1 spans ranks 0–3,
# S2 spans ranks 3–5, S3 ends exactly on the edge of rank 5, S4 and S5 share rank 6, S6 fills 7.
C = 64
FIG3 = [0, 3 * C + C // 2, 5 * C + C // 2, 6 * C, 6 * C + 36, 7 * C, 8 * C]


def r(a: int, b: int) -> TokenRange:
    return TokenRange(a, b)


def test_figure3_units_and_patterns() -> None:
    plan = compile_plan(FIG3, 8, **SMALL)
    got = {(u.doc, u.q, u.kv, u.causal, u.q_owner, u.kv_owner, u.pattern) for u in plan.work_units}
    s1 = [r(0, 64), r(64, 128), r(128, 192), r(192, 224)]
    s2 = [r(224, 256), r(256, 320), r(320, 352)]
    want = set()
    for rank, p in enumerate(s1):  # diagonals A1
        want.add((0, p, p, True, rank, rank, "A1"))
    want |= {
        (0, s1[1], s1[0], False, 1, 0, "A2"), (0, s1[2], s1[0], False, 2, 0, "A2"), (0, s1[2], s1[1], False, 2, 1, "A2"),
        # rank 3 holds only the first half of its chunk of S1: rows partial, columns whole -> cross-right
        (0, s1[3], s1[0], False, 3, 0, "A4"), (0, s1[3], s1[1], False, 3, 1, "A4"), (0, s1[3], s1[2], False, 3, 2, "A4"),
    }
    for rank, p in zip((3, 4, 5), s2):
        want.add((1, p, p, True, rank, rank, "A1"))
    want |= {
        (1, s2[1], s2[0], False, 4, 3, "A3"),  # rows whole, columns partial: cross-up
        (1, s2[2], s2[0], False, 5, 3, "A5"),  # neither whole: cross-corner
        (1, s2[2], s2[1], False, 5, 4, "A4"),
    }
    want |= {(2, r(352, 384), r(352, 384), True, 5, 5, "A1"), (3, r(384, 420), r(384, 420), True, 6, 6, "A1"),
             (4, r(420, 448), r(420, 448), True, 6, 6, "A1"), (5, r(448, 512), r(448, 512), True, 7, 7, "A1")}
    assert got == want


def test_figure3_plan_verifies_and_balances() -> None:
    plan = compile_plan(FIG3, 8, **SMALL)
    plan.verify()
    s = plan.stats()
    assert s.owner_imbalance > 2.0  # S1 makes ranks 0–3 heavy when every block stays home
    # why 1e-12: two float sums of the same kind of terms in another order; a real loss is far larger
    assert s.estimated_time_s <= s.owner_computes_time_s * (1 + 1e-12)
    total = sum(u.work for u in plan.work_units)
    assert total == s.total_work == sum(s.work_per_rank)


def test_slices_never_whole_chunk_when_less_is_needed() -> None:
    # large heads so that moving work pays: S2's kv slice on rank 3 is [224, 256), not the chunk
    plan = compile_plan(FIG3, 8, num_heads=32, head_dim=128)
    starts = plan.batch.doc_starts
    for prog in plan.fwd_programs + plan.bwd_programs:
        for ins in prog.instrs:
            if isinstance(ins, Post):
                for op in ins.round.ops:
                    d = int(np.searchsorted(starts, op.tokens.start, side="right") - 1)
                    assert starts[d] <= op.tokens.start and op.tokens.stop <= starts[d + 1], op
            if isinstance(ins, Compute):
                for it in ins.items:
                    d = int(np.searchsorted(starts, it.q.start, side="right") - 1)
                    assert starts[d] <= it.kv.start and it.q.stop <= starts[d + 1]
    kv_from_3 = [m for m in plan.messages() if m[1] == 3 and m[3] == "kv"]
    assert all(m[4].start >= 224 or m[4].stop <= 224 for m in kv_from_3)  # S1's and S2's kv apart


def test_local_token_indices_contiguous_and_intra_split() -> None:
    plan = compile_plan([0, 100, 4096], 4, 2, **SMALL)
    assert plan.padded_tokens == 4096 and plan.chunk_tokens == 1024
    seen = []
    for cp in range(8):
        ids = plan.local_token_indices(cp)
        i, j = divmod(cp, 2)  # CP rank = i·P_intra + j: inter index i, intra index j
        np.testing.assert_array_equal(ids, np.arange(i * 1024 + j * 512, i * 1024 + (j + 1) * 512))
        seen.append(ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(4096))
    with pytest.raises(ConfigError, match="cp_rank"):
        plan.local_token_indices(8)


def test_padding_when_T_not_divisible() -> None:
    plan = compile_plan([0, 7, 10], 4, **SMALL)
    assert plan.num_tokens == 10 and plan.padded_tokens == 12
    ids = np.concatenate([plan.local_token_indices(c) for c in range(4)])
    np.testing.assert_array_equal(ids, np.arange(12))  # ids 10, 11 are padding (>= T)
    assert plan.batch.num_docs == 3  # the two documents and the padding document
    plan.verify()
    plan2 = compile_plan([0, 10], 2, pad_multiple=4, **SMALL)
    assert plan2.padded_tokens == 16  # a multiple of P·pad_multiple = 8


def test_empty_documents_cost_nothing() -> None:
    a = compile_plan([0, 300, 300, 300, 1000, 1024, 1024], 4, **SMALL)
    b = compile_plan([0, 300, 1000, 1024], 4, **SMALL)
    assert [(u.q, u.kv) for u in a.work_units] == [(u.q, u.kv) for u in b.work_units]
    # why rel=1e-12: the same units and messages; only float summation order may differ
    assert a.stats().estimated_time_s == pytest.approx(b.stats().estimated_time_s, rel=1e-12)


def test_messages_and_compute_units_shapes() -> None:
    # the contiguous layout: one document's chunks see each other's kv, so both q and kv travel
    # (the default may keep the balanced layout, where min-traffic moves only q)
    plan = compile_plan([0, 1 << 14], 4, num_heads=32, head_dim=128, layout="contiguous")
    msgs = plan.messages()
    names = {m[3] for m in msgs}
    assert names <= {"q", "kv", "o", "lse", "do", "delta", "dq", "dkv"}
    assert {"q", "kv", "o", "lse", "dq", "dkv"} <= names  # one document: both tricks are used
    fwd_rounds = plan.chosen.fwd.rounds
    fwd_names = {m[3] for m in msgs if m[0] < fwd_rounds}
    bwd_names = {m[3] for m in msgs if m[0] >= fwd_rounds}
    assert fwd_names <= {"q", "kv", "o", "lse"} and bwd_names <= {"q", "kv", "do", "lse", "delta", "dq", "dkv"}
    for rank, stage, q, kv, causal in plan.compute_units():
        assert 0 <= rank < 4 and stage >= 0 and len(q) > 0 and len(kv) > 0
        if causal:
            assert kv.stop == q.stop and kv.start <= q.start
        else:
            assert kv.stop <= q.start


def test_gqa_and_mla_bytes() -> None:
    cu = [0, 1 << 13]
    mha = compile_plan(cu, 2, num_heads=8, num_kv_heads=8, head_dim=64)
    gqa = compile_plan(cu, 2, num_heads=8, num_kv_heads=2, head_dim=64)
    mla = compile_plan(cu, 2, num_heads=8, num_kv_heads=8, head_dim=192, head_dim_v=128)
    for plan, hkv, d, dv in ((mha, 8, 64, 64), (gqa, 2, 64, 64), (mla, 8, 192, 128)):
        for prog in plan.fwd_programs + plan.bwd_programs:
            for ins in prog.instrs:
                if not isinstance(ins, Post):
                    continue
                for op in ins.round.ops:
                    n = len(op.tokens)
                    # bf16 rows; lse / delta fp32; partial gradients in bf16 (the default grad_wire_dtype)
                    per = {Wire.KV: hkv * (d + dv) * 2, Wire.DKV: hkv * (d + dv) * 2, Wire.Q: 8 * d * 2,
                           Wire.O: 8 * dv * 2, Wire.DO: 8 * dv * 2, Wire.LSE: 8 * 4, Wire.DELTA: 8 * 4, Wire.DQ: 8 * d * 2}[op.wire]
                    assert op.nbytes == n * per, (op.wire, op.nbytes, n, per)


def test_single_inter_rank_is_all_local() -> None:
    plan = compile_plan([0, 5, 17, 64], 1, 4, **SMALL)
    assert plan.messages() == []
    assert plan.stats().rounds_fwd == 2  # one compute stage and its (empty) round after
    plan.verify()


def test_dump_uses_the_papers_syntax() -> None:
    plan = compile_plan([0, 1 << 14], 4, num_heads=32, head_dim=128)
    text = plan.dump(3)
    for token in ("create $send-op $", "create $recv-op $", "copy-q", "copy-kv", "compute stage", "copy-o", "wait round"):
        assert token in text, token
    assert "%" in text and "$comm[" in text and "$local" in text
    bwd = plan.dump(0, "bwd")
    assert "copy-dq" in bwd or "copy-dkv" in bwd


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        ([1, 5, 9], "must start at 0"),
        ([0, 9, 5], "non-decreasing"),
        ([], "at least two entries"),
        ([0], "at least two entries"),
        ([0, 0], "empty batch"),
        ([0, 4.5, 9], "not an integer"),
        (np.array([0.0, 4.0, 8.0]), "must hold integers"),
        ([0, -3, 8], "negative"),
        ([0, True, 8], "not an integer"),
        ("0,4,8", "sequence of integers"),
        ([[0, 4], [4, 8]], "one-dimensional"),
    ],
)
def test_bad_cu_seqlens(cu, match: str) -> None:
    with pytest.raises(BatchError, match=match):
        compile_plan(cu, 2, **SMALL)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(inter_size=0), "inter_size"),
        (dict(inter_size=2, intra_size=0), "intra_size"),
        (dict(inter_size=2, num_heads=0), "num_heads"),
        (dict(inter_size=2, head_dim=-1), "head_dim"),
        (dict(inter_size=2, intra_size=3, num_heads=4), "not divisible by intra_size"),
        (dict(inter_size=2, num_heads=6, num_kv_heads=4), "not a multiple of num_kv_heads"),
        (dict(inter_size=2, intra_size=4, num_heads=24, num_kv_heads=6), "one must divide the other"),
        (dict(inter_size=2, pool_bytes=0), "pool_bytes"),
        (dict(inter_size=2, link="ethernet"), "link"),
        (dict(inter_size=2, layout="zigzag"), "layout"),
        (dict(inter_size=2, hardware="tpu"), "hardware"),
        (dict(inter_size=2, no_such_option=1), "unknown compile_plan option"),
    ],
)
def test_bad_sizes(kwargs: dict, match: str) -> None:
    kwargs = {"num_heads": 4, **kwargs}
    inter = kwargs.pop("inter_size")
    with pytest.raises(ConfigError, match=match):
        compile_plan([0, 64], inter, **kwargs)


def test_errors_are_hsap_errors() -> None:
    assert issubclass(BatchError, HSAPError) and issubclass(ConfigError, HSAPError)


# --------------------------------------------------------------------------- purity, determinism, cache


def test_compile_plan_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from megatron_hsap import compile_plan\n"
        "p = compile_plan([0, 300, 4096], 4, num_heads=8, head_dim=16)\n"
        "p.verify(); p.stats(); p.dump(0)\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m.startswith('megatron.')]\n"
        "print('LOADED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_deterministic_across_fresh_compiles() -> None:
    cu = [0, 1000, 2500, 2600, 8000, 12288]
    clear_plan_cache()
    a = compile_plan(cu, 4, num_heads=32, head_dim=128)
    clear_plan_cache()
    b = compile_plan(cu, 4, num_heads=32, head_dim=128)
    assert a is not b
    assert a.fwd_programs == b.fwd_programs and a.bwd_programs == b.bwd_programs
    assert a.stats() == b.stats()


def test_cache_by_every_input() -> None:
    clear_plan_cache()
    cu = [0, 100, 300, 1024]
    a = compile_plan(cu, 4, **SMALL)
    assert compile_plan(list(cu), 4, **SMALL) is a
    assert compile_plan(tuple(cu), 4, **SMALL) is a
    assert compile_plan(np.array(cu, dtype=np.int32), 4, **SMALL) is a  # same batch, another type
    assert compile_plan(cu, 4, **{**SMALL, "head_dim": 32}) is not a
    assert compile_plan(cu, 2, **SMALL) is not a
    assert compile_plan(cu, 4, **SMALL, pool_bytes=1 << 20) is not a


def test_cache_hit_does_no_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hit returns the cached object before any planning work (neither normalising nor compiling);
    # its cost is measured by `megatron-hsap plan-quality` (compile times), not asserted here.
    import megatron_hsap.plan.plan as plan_module

    cu = np.array([0, *range(1000, 65536, 1000), 65536], dtype=np.int64)
    first = compile_plan(cu, 8)

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not plan")

    monkeypatch.setattr(plan_module, "_compile_uncached", no_planning)
    monkeypatch.setattr(plan_module, "normalize_cu_seqlens", no_planning)
    for _ in range(3):
        assert compile_plan(cu, 8) is first
        assert compile_plan(cu.tolist(), 8) is first


def test_forced_placements() -> None:
    cu = [0, 1 << 13]
    owner = compile_plan(cu, 4, num_heads=32, head_dim=128, placement="owner-computes", layout="contiguous")
    auto = compile_plan(cu, 4, num_heads=32, head_dim=128, layout="contiguous")
    assert owner.stats().placement == "owner-computes"
    # why rel=1e-3: (2P−1)/P holds for equal chunks of one long causal document up to the diagonal's
    # O(1/L) share of the pairs (1.75 exactly only as the chunk length L grows)
    assert owner.stats().imbalance == pytest.approx(1.75, rel=1e-3)  # (2P−1)/P with P = 4
    assert auto.stats().estimated_time_s < owner.stats().estimated_time_s
    owner.verify()


def test_small_pool_still_plans() -> None:
    cu = [0, 700, 2048]
    plan = compile_plan(cu, 4, **SMALL, pool_bytes=8192)
    plan.verify()
    s = plan.stats()
    assert s.pool_peak_bytes <= 8192 and s.pool_capacity_bytes == 8192


def test_phase_enum_and_programs() -> None:
    plan = compile_plan([0, 1 << 12], 2, **SMALL)
    for phase in (Phase.FWD, Phase.BWD, "fwd", "bwd"):
        prog = plan.program(1, phase)
        assert prog.rank == 1 and prog.phase is Phase(phase)
    sends = [op for p in plan.fwd_programs for i in p.instrs if isinstance(i, Post) for op in i.round.ops if isinstance(op, Send)]
    recvs = [op for p in plan.fwd_programs for i in p.instrs if isinstance(i, Post) for op in i.round.ops if isinstance(op, Recv)]
    assert len(sends) == len(recvs)



def test_rebalanced_candidates_are_named_apart_from_the_balanced_layout() -> None:
    # "balanced" names the token layout (plan/balanced.py); a placement start shed toward τ under a
    # traffic budget is "<start>+rebalanced@<β>" (plan/rebalance.py), so the two never read alike.
    # the balanced layout without its fallback (the default keeps the contiguous one on this batch)
    plan = compile_plan([0, 5000, 6000, 8192], 4, num_heads=32, head_dim=128, layout_fallback=False)
    s = plan.stats()
    assert s.layout == "balanced"
    start, _, beta = s.placement.partition("+rebalanced@")
    assert start in {"owner-computes", "min-traffic", "region-distflash"} and float(beta) in {1.2, 0.6, 0.3}
    assert "+balanced" not in s.placement


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_a_compile_leaves_no_reference_cycles(layout: str) -> None:
    """Every object a compile makes and drops is freed by reference counting: none waits for the
    cyclic collector (the staging memos held a cycle per staging tried, ~4,000 objects on this
    batch, whose collection then ran inside the next compile: ``PricedLayout.release``)."""
    import gc

    from megatron_hsap.plan.workloads import pack_batches

    cu = pack_batches("fineweb", 65536, 1, 12345)[0]
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, layout=layout)
    compile_plan(cu, 8, **kw)  # the first compile imports modules lazily (a module's functions and globals: a cycle)
    clear_plan_cache()
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        plan = compile_plan(cu, 8, **kw)
        unreachable = gc.collect()
    finally:
        if was:
            gc.enable()
    assert plan.chosen.units  # the compile staged and built a plan with remote work
    assert unreachable == 0

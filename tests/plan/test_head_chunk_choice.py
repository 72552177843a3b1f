"""The head-chunk choice skips hopeless counts by a lower bound (``chunks.choose_head_chunks``,
``chunks.chunk_sap_floor``) and still picks exactly the count the exhaustive choice picks.

References: the exhaustive choice — every valid count priced in full (``head_chunk_estimates``,
every count above 1 re-priced at its shape by ``chunk_phase_times``) and the rule the planner
had before the bound (ascending, a count must beat the best so far by more than 1e-9 relative);
for the bound, each re-priced count's ``chunk_sap_s`` from that full pricing.

Why it can fail: a bound above the true price would skip a count that wins (the cases include
ones where a shared-kv count is chosen: MQA and GQA with one kv head per rank), and the rule must
not drift from ``min`` with ties to fewer chunks."""

from __future__ import annotations

import pytest

from megatron_hsap.plan import chunks as ch
from megatron_hsap.plan import clear_plan_cache
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.workloads import pack_batches
from tests.configured import compile_plan  # the configured topology (flatten="never")

K = 1024

# (workload, T, inter, intra, heads, kv heads, hardware, options): q / kv heads per rank in the comment
CASES = [
    ("fineweb", 256 * K, 4, 2, 32, 8, "h100", {}),  # 16 / 4: C = 8, 16 share kv; 4 chosen
    ("fineweb", 128 * K, 2, 2, 64, 16, "h100-fa3", {}),  # 32 / 8: C = 16, 32 share kv
    ("fineweb", 256 * K, 1, 8, 32, 8, "h100", {}),  # 4 / 1, pure Ulysses: a shared-kv count is chosen
    ("ultrachat", 64 * K, 2, 8, 64, 8, "h100-fa3", {}),  # 8 / 1: C = 8 (shared) is chosen
    ("slimpajama", 128 * K, 4, 4, 32, 1, "h100-fa3", {}),  # MQA, kv replicated: 8 / 1
    ("slimpajama", 256 * K, 16, 8, 64, 8, "h100-fa3", {}),  # 8 / 1 at 128 GPUs: C = 2 (shared) is chosen
    ("fineweb", 64 * K, 4, 4, 32, 32, "a100", {}),  # MHA: no shared kv
    ("sharegpt", 128 * K, 8, 2, 32, 8, "h100-fa3", {"window_size": (2048, 0)}),  # 16 / 4, windowed
    ("sharegpt", 64 * K, 8, 2, 32, 8, "a100", {"layout": "contiguous", "link": "ib"}),
]  # fmt: skip


def _exhaustive(est: dict[int, float]) -> int:
    """The choice as it was before the bound: ascending, strictly better by 1e-9 relative."""
    best = 1
    for c in sorted(est):
        if est[c] < est[best] * (1 - 1e-9):
            best = c
    return best


def _plan(workload, T, inter, intra, heads, kv_heads, hardware, kw):
    clear_plan_cache()
    cu = pack_batches(workload, T, 1, 0)[0]
    return compile_plan(cu, inter, intra, num_heads=heads, num_kv_heads=kv_heads, hardware=hardware, **kw)


@pytest.mark.parametrize("workload,T,inter,intra,heads,kv_heads,hardware,kw", CASES)
def test_bounded_choice_equals_the_exhaustive_one(workload, T, inter, intra, heads, kv_heads, hardware, kw, monkeypatch):
    plan = _plan(workload, T, inter, intra, heads, kv_heads, hardware, kw)
    est = ch.head_chunk_estimates(plan)
    shared = [c for c in est if ch._repriced(plan, c)]
    for c in shared:  # the bound never exceeds the price it stands in for
        floor = ch.chunk_sap_floor(plan, c)
        exact = ch.pipeline_phases(plan, c)
        for f, ph in zip(floor, (Phase.FWD, Phase.BWD)):
            assert f <= exact[ph].chunk_sap_s
    repriced = []
    full = ch.chunk_phase_times
    monkeypatch.setattr(ch, "chunk_phase_times", lambda p, c: repriced.append(c) or full(p, c))
    chosen = ch.choose_head_chunks(plan)
    assert set(repriced) <= set(shared) and len(repriced) == len(set(repriced))  # each at most once
    assert chosen == _exhaustive(est) == plan.head_chunks
    if chosen in shared:
        assert chosen in repriced  # (a winner is priced in full)


def test_hopeless_counts_are_skipped_at_one_kv_head_per_rank(monkeypatch):
    """128 GPUs (8 × 16), GQA 64:8 (one kv head per rank), slimpajama 128K: every C > 1 loses
    (estimated 1.93 ms at C = 1, 2.15 / 3.12 / 5.81 at C = 2 / 4 / 8), and the bounds show it
    without re-pricing any of C = 2, 4, 8 (so the skip is exercised). (At 512K, C = 2 wins since
    the partial gradients travel in bf16: 5.38 against 5.73 ms.)"""
    plan = _plan("slimpajama", 128 * K, 16, 8, 64, 8, "h100-fa3", {})
    repriced = []
    full = ch.chunk_phase_times
    monkeypatch.setattr(ch, "chunk_phase_times", lambda p, c: repriced.append(c) or full(p, c))
    assert ch.choose_head_chunks(plan) == 1
    assert repriced == [], repriced


def test_single_count_estimate_equals_the_table():
    """``head_chunk_estimate`` (the layout comparison's) prices one count as the table does."""
    plan = _plan("fineweb", 128 * K, 2, 2, 64, 16, "h100-fa3", {})
    est = ch.head_chunk_estimates(plan)
    for c in (1, 16):
        assert ch.head_chunk_estimate(plan, c) == est[c]

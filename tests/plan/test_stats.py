"""plan/stats.py: ``plan_stats``'s counts and totals equal what is re-counted from the plan's
programs — work per rank from the compute items (and the total from n(n+1)/2 per document),
bytes and messages from the Send ops, compute and remote items, rounds and stages, pool peaks
from the receive slots — and its ratios are the ratios of those totals (docs/design.md §4).

Reference: the programs (IR) walked here, and ``cu_seqlens`` for the total work."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan.ir import Compute, Phase, Post, Recv, Send
from tests.configured import compile_plan  # the configured topology (flatten="never")

KEYS = {  # the documented fields (PlanStats; as_dict() keys for JSON and metrics): a rename must be deliberate
    "num_tokens", "padded_tokens", "num_docs", "inter_size", "intra_size", "link", "hardware", "layout",
    "window_size", "head_chunks", "placement", "work_per_rank", "total_work", "imbalance", "owner_imbalance",
    "bytes_sent_per_rank", "bytes_recv_per_rank", "bytes_fwd", "bytes_bwd", "bytes_total", "necessary_bytes",
    "bytes_over_necessary", "rounds_fwd", "rounds_bwd", "pool_capacity_bytes", "pool_peak_bytes",
    "pool_peak_per_rank", "pool_tokens", "pool_use", "stages", "compute_items", "remote_items", "messages_fwd",
    "messages_bwd", "estimated_time_s", "fwd_time_s", "bwd_time_s", "owner_computes_time_s", "candidates",
    "compute_bound_s", "traffic_bound_s", "lower_bound_s", "efficiency", "compute_efficiency", "kernel_ideal_s",
    "kernel_efficiency", "compute_dominated", "flattened_from",
}


def check(plan, lengths) -> None:
    s = plan.stats()
    assert set(s.as_dict()) == KEYS
    P = plan.inter_size
    work = np.zeros(P, dtype=np.int64)
    sent = {ph: np.zeros(P, dtype=np.int64) for ph in Phase}
    recv = {ph: np.zeros(P, dtype=np.int64) for ph in Phase}
    n_send = {ph: 0 for ph in Phase}
    items = remote = 0
    peak = np.zeros(P, dtype=np.int64)
    for ph in Phase:
        for prog in (plan.fwd_programs if ph is Phase.FWD else plan.bwd_programs):
            for ins in prog.instrs:
                if isinstance(ins, Compute) and ph is Phase.FWD:
                    for it in ins.items:
                        work[prog.rank] += it.work
                        items += 1
                        remote += any(v is not None for _, v in it.srcs + it.dsts)
                elif isinstance(ins, Post):
                    for op in ins.round.ops:
                        if isinstance(op, Send):
                            sent[ph][prog.rank] += op.nbytes
                            n_send[ph] += 1
                        else:
                            assert isinstance(op, Recv)
                            recv[ph][prog.rank] += op.nbytes
                            peak[prog.rank] = max(peak[prog.rank], op.dst.end)
    pad = plan.padded_tokens - sum(lengths)
    assert s.total_work == sum(n * (n + 1) // 2 for n in lengths + [pad]) == work.sum()
    assert s.work_per_rank == tuple(work.tolist())
    assert s.imbalance == pytest.approx(work.max() / (work.sum() / P), rel=1e-12)  # why: one float division
    assert (s.bytes_fwd, s.bytes_bwd) == (sent[Phase.FWD].sum(), sent[Phase.BWD].sum())
    assert s.bytes_total == s.bytes_fwd + s.bytes_bwd
    assert s.bytes_sent_per_rank == tuple((sent[Phase.FWD] + sent[Phase.BWD]).tolist())
    assert s.bytes_recv_per_rank == tuple((recv[Phase.FWD] + recv[Phase.BWD]).tolist())
    assert (s.messages_fwd, s.messages_bwd) == (n_send[Phase.FWD], n_send[Phase.BWD])
    assert (s.compute_items, s.remote_items) == (items, remote)
    assert s.stages == s.rounds_fwd - 1 == s.rounds_bwd - 1
    assert all(peak <= np.asarray(s.pool_peak_per_rank))  # peaks count the 256-byte alignment too
    assert s.pool_peak_bytes == max(s.pool_peak_per_rank) <= s.pool_capacity_bytes == plan.pool_capacity
    assert s.estimated_time_s == s.fwd_time_s + s.bwd_time_s
    assert s.lower_bound_s == max(s.compute_bound_s, s.traffic_bound_s) <= s.estimated_time_s
    assert s.efficiency == s.lower_bound_s / s.estimated_time_s
    assert s.estimated_time_s <= s.owner_computes_time_s * (1 + 1e-9)  # why: the same float sums compared
    assert (s.num_tokens, s.padded_tokens, s.inter_size) == (sum(lengths), plan.padded_tokens, P)


def test_hand_made_batch_with_remote_work() -> None:
    lengths = [50, 80, 1, 119, 6]
    plan = compile_plan([0, 50, 130, 131, 250, 256], 4, num_heads=4, num_kv_heads=2, head_dim=16,
                        layout="contiguous", pool_bytes=4096)
    check(plan, lengths)
    assert plan.stats().remote_items > 0 and plan.stats().bytes_total > 0  # the counts are exercised


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4),
       st.sampled_from(["contiguous", "balanced"]), st.sampled_from([4096, None]))
def test_random_packings(lengths, inter, layout, pool) -> None:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    check(compile_plan(cu, inter, num_heads=4, num_kv_heads=2, head_dim=16, layout=layout, pool_bytes=pool), lengths)


def test_peak_bytes_count_the_shared_kv_gradient_sum_by_hand():
    """Head chunks sharing a kv chunk: the backward keeps the current kv chunk's fp32 dk, dv sum
    (runtime/hsap.py) beside the next q chunk's gradients, so ``accumulators`` grows by the inter
    chunk's rows × hkv/Ckv kv heads × (d + dv) × 4 bytes; nothing else changes. By hand, 1,024
    tokens on 2 × 2 ranks (512 rows per inter rank after the all-to-all), d 16, dv 8:
    H 8 / Hkv 2 → 4 q, 1 kv head per rank: fp32 dq 4·16·4 = 256 + dk, dv 1·24·4 = 96 per row
    (o + lse 4·8·4 + 4·4 = 144 is less): 512 · 352 = 180,224; C = 2 or 4 share the one kv head
    (Ckv 1): + 512 · 96 = 49,152. H 16 / Hkv 4 → 8 q, 2 kv heads: 512 · (512 + 192) = 360,448;
    C = 2 (Ckv 2) shares nothing; C = 4, 8 (Ckv 2, one kv head each): + 512 · 1·24·4 = 49,152."""
    cu = [0, 300, 1024]
    for heads, kv_heads, want in ((8, 2, {1: 180_224, 2: 229_376, 4: 229_376}),
                                  (16, 4, {1: 360_448, 2: 360_448, 4: 409_600, 8: 409_600})):
        base = None
        for c, acc in want.items():
            plan = compile_plan(cu, 2, 2, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, head_dim_v=8, head_chunks=c)
            assert plan.chunk_tokens == 512
            got = plan.peak_bytes()
            assert got["accumulators"] == acc, (heads, c)
            assert got["total"] == got["pool"] + got["all_to_all"] + got["accumulators"]
            if base is None:
                base = got
            assert (got["pool"], got["all_to_all"]) == (base["pool"], base["all_to_all"])

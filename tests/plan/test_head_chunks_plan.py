"""Head chunks of the intra all-to-all (issue 14 item 1), the planner's side: the rule and the
choice (``plan/chunks.py``, ``pipeline.pipelined_time``) — the valid counts, the errors of forced
bad values, the auto choice (1 without an intra or inter group; > 1 where the all-to-all is large
against SAP), the closed form against an independent event-by-event replay of the same schedule,
and the plan hash covering the count. The pipelined runtime is tested in
``tests/runtime/test_head_chunks.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.chunks import a2a_bytes_sent, chunk_shape, head_chunk_estimates, pipeline_phases, valid_head_chunks
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Wire
from megatron_hsap.plan.pipeline import PipelinePhase, pipelined_time
from megatron_hsap.plan.workloads import pack_batches
from tests.configured import compile_plan  # the configured topology (flatten="never")

K = 1024


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("h", "hkv", "want"), [(8, 8, (1, 2, 4, 8)), (8, 2, (1, 2, 4, 8)), (8, 1, (1, 2, 4, 8)), (6, 3, (1, 3, 6)),
                                                 (12, 8, (1, 2, 4)), (12, 4, (1, 2, 4, 12)), (6, 4, (1, 2))])
def test_valid_counts_never_straddle_a_kv_group(h, hkv, want):
    """C | h and (C | hkv or hkv | C): every q chunk's heads use exactly its kv chunk's heads — by
    brute force over the head indices, independent of the rule's formula."""
    from megatron_hsap.plan.chunks import kv_head_chunks

    assert valid_head_chunks(h, hkv) == want
    brute = []
    for c in range(1, h + 1):
        if h % c or h % hkv:
            continue
        kv = min(c, hkv)
        if hkv % kv:
            continue
        # q head i uses kv head i // (h/hkv); chunk j of c holds q heads [j·h/c, (j+1)·h/c) and kv
        # chunk j·kv // c holds kv heads [(j·kv//c)·hkv/kv, ...): they must be exactly the used ones
        ok = all({i // (h // hkv) for i in range(j * h // c, (j + 1) * h // c)}
                 <= set(range((j * kv // c) * hkv // kv, (j * kv // c + 1) * hkv // kv)) for j in range(c))
        if ok:
            brute.append(c)
    if h % hkv == 0:
        assert tuple(brute) == want
    for c in want:
        assert kv_head_chunks(c, hkv) == min(c, hkv)


def test_chunk_shape_is_one_chunk_of_the_heads():
    s = HeadShape(num_heads=8, num_kv_heads=4, head_dim=64, head_dim_v=32, dtype_bytes=2)
    part = chunk_shape(s, 2)
    assert (part.num_heads, part.num_kv_heads, part.head_dim, part.head_dim_v, part.dtype_bytes) == (4, 2, 64, 32, 2)
    assert chunk_shape(s, 1) == s
    # a token's bytes summed over the chunks are the plan's (every message shrinks by C)
    assert all(2 * part.token_bytes(w) == s.token_bytes(w) for w in Wire)
    with pytest.raises(ConfigError, match="3 head chunks"):
        chunk_shape(s, 3)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(head_chunks=0), "head_chunks=0 must be None"),
        (dict(head_chunks=-2), "head_chunks=-2 must be None"),
        (dict(head_chunks=True), "head_chunks=True must be None"),
        (dict(head_chunks=2.0), "head_chunks=2.0 must be None"),
        (dict(head_chunks=3), "head_chunks=3 cannot split the 8 q heads and 2 kv heads"),
        (dict(head_chunks=3), "valid head_chunks: [1, 2, 4, 8]"),
        (dict(head_chunks=16), "head_chunks=16 cannot split"),
        # 6 q and 3 kv heads per rank: 2 neither divides 3 nor is a multiple of it
        (dict(num_heads=24, num_kv_heads=12, head_chunks=2), "valid head_chunks: [1, 3, 6]"),
    ],
)
def test_forced_bad_values_raise_config_error_naming_them(kw, says):
    with pytest.raises(ConfigError) as exc:
        compile_plan([0, 100, 256], 2, 4, **{"num_heads": 32, "num_kv_heads": 8, **kw})
    assert says in str(exc.value)


def test_forced_chunks_without_an_intra_group_raise():
    with pytest.raises(ConfigError, match="intra_size=1"):
        compile_plan([0, 256], 4, 1, num_heads=8, head_chunks=2)
    assert compile_plan([0, 256], 4, 1, num_heads=8, head_chunks=1).head_chunks == 1
    # one kv head per rank: q chunks share it (C a multiple of hkv = 1)
    assert compile_plan([0, 256], 2, 4, num_heads=8, num_kv_heads=2, head_chunks=2).head_chunks == 2
    with pytest.raises(ConfigError, match=r"valid head_chunks: \[1, 2\]"):
        compile_plan([0, 256], 2, 4, num_heads=8, num_kv_heads=2, head_chunks=4)


def test_forced_counts_are_kept_and_change_nothing_else():
    cu = [0, 300, 1000, 1024]
    base = compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8)
    for c in (1, 2, 4, np.int64(4)):
        p = compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8, head_chunks=c)
        assert p.head_chunks == c and type(p.head_chunks) is int
        assert p.fwd_programs == base.fwd_programs and p.bwd_programs == base.bwd_programs
        assert p.layout.segments == base.layout.segments and p.pool_capacity == base.pool_capacity


# --------------------------------------------------------------------------- the choice


def test_no_intra_group_chooses_one_chunk_and_one_kv_head_per_rank_may_chunk():
    cu = pack_batches("fineweb", 256 * K, 1, 0)[0]
    assert compile_plan(cu, 8, 1, num_heads=32, num_kv_heads=8, hardware="h100").head_chunks == 1  # pure SAP
    # 1 kv head per rank (4 q heads): q chunks share it; pure Ulysses has no P2P to re-send, so chunks pay
    plan = compile_plan(cu, 1, 8, num_heads=32, num_kv_heads=8, hardware="h100")
    est = head_chunk_estimates(plan)
    assert sorted(est) == [1, 2, 4] and plan.head_chunks > 1 and est[plan.head_chunks] == min(est.values())
    assert compile_plan(cu, 1, 4, num_heads=32, num_kv_heads=32, hardware="h100", head_chunks=4).head_chunks == 4


def test_pure_ulysses_pipelines_by_the_same_estimate():
    """P_inter = 1: the local attention of chunk k hides its neighbours' all-to-alls, so the planner
    chooses by the same closed form (the least of head_chunk_estimates, ties to fewer chunks)."""
    cu = pack_batches("fineweb", 256 * K, 1, 0)[0]
    plan = compile_plan(cu, 1, 4, num_heads=32, num_kv_heads=32, hardware="h100")
    est = head_chunk_estimates(plan)
    assert plan.head_chunks == min(est, key=lambda c: (est[c], c)) and plan.head_chunks > 1
    assert est[plan.head_chunks] < est[1]


def test_estimate_prefers_chunks_where_the_all_to_all_is_large():
    """fineweb 256K on 2×4 H100s, GQA 32/8: the all-to-all of 16 q + 4 kv heads is worth hiding."""
    cu = pack_batches("fineweb", 256 * K, 1, 0)[0]
    plan = compile_plan(cu, 4, 2, num_heads=32, num_kv_heads=8, hardware="h100")
    est = head_chunk_estimates(plan)
    assert sorted(est) == [1, 2, 4, 8, 16]  # 16 q and 4 kv heads per rank: 8 and 16 share kv heads
    assert plan.head_chunks > 1 and est[plan.head_chunks] == min(est.values())
    assert est[plan.head_chunks] < 0.95 * est[1]
    # C = 1 is the sequential layer: all-to-all in, SAP, all-to-all out, both phases (8 calls). The
    # all-to-all runs at NVLink × a2a_efficiency plus its rearranges (4 × each whole tensor through
    # HBM; a rank's whole tensor is its bytes sent × P/(P−1)); SAP's launches are already in its
    # estimate (one per plan/calls.py kernel call, the count the pipeline pays per chunk)
    hw = plan.hardware
    p = plan.intra_size
    sent = a2a_bytes_sent(plan)
    total = sent["fwd"] + sent["bwd"]
    launches = sum(ph.launch_s for ph in pipeline_phases(plan).values())
    assert launches == pytest.approx(plan.chosen.fwd_time.launch + plan.chosen.bwd_time.launch, rel=1e-12)
    want = plan.chosen.time + total / (hw.nvlink_bw * hw.a2a_efficiency) + 4 * total * p / (p - 1) / hw.hbm_bw \
        + 8 * hw.nvlink_latency
    assert est[1] == pytest.approx(want, rel=1e-12)


def test_tiny_batches_keep_one_chunk():
    """Latency-bound: every extra chunk pays its all-to-all latencies and SAP's launches again.
    Reference: the simulator (event by event) on the same batch, where one chunk is fastest too.
    (A 4K batch, [0, 7, 8, 1500, 1501, 4000], is no longer latency-bound under the per-rank
    estimate: 2 chunks, simulated 802.6 µs against 856.5 µs with one.)"""
    import numpy as np

    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    cu = [0, 7, 8, 500, 501, 1024]
    plan = compile_plan(cu, 4, 2, layout="contiguous")
    assert plan.head_chunks == 1
    sim = {c: run_method("hsap", np.asarray(cu), hw=sim_hardware("a100"), intra=2, inter=4, shape=full_shape(32, 32),
                         plan_options={"layout": "contiguous", "head_chunks": c, "flatten": "never"}).seconds for c in (1, 2, 4)}
    assert min(sim, key=sim.get) == 1, sim


def test_a2a_bytes_equal_ulysses_volume():
    from megatron_hsap.runtime.ulysses import ulysses_bytes

    for h, hkv, p in ((32, 8, 2), (32, 8, 8), (8, 1, 4), (16, 16, 4)):
        plan = compile_plan([0, 100, 1000, 4096], 2, p, num_heads=h, num_kv_heads=hkv, head_dim=64, head_dim_v=32)
        want = ulysses_bytes(plan.local_tokens, h, hkv, 64, p, head_dim_v=32, dtype_bytes=2)
        assert a2a_bytes_sent(plan) == {"fwd": want["fwd"], "bwd": want["bwd"]}


# --------------------------------------------------------------------------- the closed form


def _engine(ph: PipelinePhase, chunks: int, bw: float, lat: float) -> float:
    """The runtime's schedule run by the simulator's event engine (``sim/engine.py``, the
    independent reference): one side stream serving the all-to-alls in issue order, one compute
    stream. Chunk 1's all-to-all is issued first; at the start of chunk k's SAP the host issues
    chunk k+1's all-to-all, then chunk k−1's return; SAP k waits for its own all-to-all and runs
    ``1 + overlap_slowdown`` times slower where it overlaps side-stream work; the last return
    follows the last SAP (``sim/hsap.hsap_workload``'s program, one rank)."""
    from megatron_hsap.plan.hardware import LinkClass
    from megatron_hsap.sim.builder import Builder
    from megatron_hsap.sim.engine import simulate

    a = ph.in_bytes / chunks / bw + ph.in_calls * lat
    r = ph.out_bytes / chunks / bw + ph.out_calls * lat
    s = (ph.sap_s - ph.latency_s) / chunks + ph.latency_s + ph.launch_s
    b = Builder(1)
    tags = iter(range(10**6))
    arriving = next(tags)
    b.launch(0, arriving, a)
    for k in range(chunks):
        b.join(0, arriving)
        if k + 1 < chunks:
            arriving = next(tags)
            b.launch(0, arriving, a)
        if k:
            b.launch(0, next(tags), r)
        b.busy(0, s, "compute", overlap_slowdown=ph.overlap_slowdown)
    last = next(tags)
    b.launch(0, last, r)
    b.join(0, last)
    tl = simulate(b.build(), link=lambda i, j: LinkClass.NVLINK, bandwidth=lambda c: bw, latency=lambda c: lat)
    return tl.makespan


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("sap", "in_b", "out_b"), [(1e-3, 1e6, 3e5), (1e-4, 5e7, 5e7), (2e-3, 2e7, 6e7), (5e-4, 3e6, 1e6)])
@pytest.mark.parametrize("slowdown", [0.0, 0.1, 0.5])
def test_pipelined_time_is_the_simulators_schedule(chunks, sap, in_b, out_b, slowdown):
    """``pipelined_time`` prices the runtime's issue order and the SM contention beside the side
    stream exactly as the simulator's engine runs them: compute-bound, link-bound and mixed, one
    chunk to eight (one chunk: nothing overlaps, ``A + S + R``)."""
    ph = PipelinePhase(sap_s=sap, latency_s=sap / 10, launch_s=2e-5, in_bytes=int(in_b), out_bytes=int(out_b), in_calls=3, out_calls=1,
                       overlap_slowdown=slowdown)
    bw, lat = 1e11, 1e-5
    got, want = pipelined_time(ph, chunks, bw, lat), _engine(ph, chunks, bw, lat)
    assert got == pytest.approx(want, rel=1e-12)
    a = ph.in_bytes / chunks / bw + 3 * lat
    r = ph.out_bytes / chunks / bw + lat
    s = (sap - sap / 10) / chunks + sap / 10 + 2e-5
    if chunks == 1:
        assert got == pytest.approx(a + s + r, rel=1e-12)
    elif slowdown == 0 and s >= a + r:  # compute-bound: every step is one SAP chunk
        assert got == pytest.approx(a + chunks * s + r, rel=1e-12)
    # never below either stream's own work: the link's transfers, or the first transfer, every SAP and the last return
    assert got >= max(chunks * (a + r), a + chunks * s + r) * (1 - 1e-12)


def test_the_slowdown_only_costs_where_sap_overlaps_the_side_stream():
    """Beside the side stream SAP is slower (compute-bound: each chunk but the first overlaps
    transfers), so the phase takes longer than without contention — by at most the slowdown of
    every SAP chunk."""
    ph0 = PipelinePhase(sap_s=4e-3, latency_s=0.0, launch_s=0.0, in_bytes=10**7, out_bytes=10**7, in_calls=1, out_calls=1)
    ph1 = PipelinePhase(**{**{f: getattr(ph0, f) for f in ph0.__dataclass_fields__}, "overlap_slowdown": 0.1})
    bw, lat = 1e11, 0.0
    t0, t1 = pipelined_time(ph0, 4, bw, lat), pipelined_time(ph1, 4, bw, lat)
    assert t0 < t1 <= t0 + 0.1 * 4e-3 * (1 + 1e-12)


@settings(deadline=None, max_examples=300, derandomize=True)
@given(chunks=st.sampled_from([2, 3, 4, 8, 16]), kv_div=st.sampled_from([1, 2, 4, 8, 16]), slowdown=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       in_b=st.integers(1, 10**8), out_b=st.integers(1, 10**8), s1=st.floats(0, 1e-3), ds=st.floats(0, 1e-3))
def test_pipelined_time_never_falls_as_sap_grows(chunks, kv_div, slowdown, in_b, out_b, s1, ds):
    """``choose_head_chunks`` skips a count whose price at a lower bound of its chunk SAP already
    loses: sound only if the price is non-decreasing in the chunk's SAP seconds (overlap slowdowns
    below 1 included: a later start loses at most that much overlap)."""
    kv = kv_div if chunks % kv_div == 0 else 1
    ph = PipelinePhase(sap_s=1e-3, latency_s=0.0, launch_s=1e-5, in_bytes=in_b, out_bytes=out_b, in_calls=3, out_calls=1,
                       kv_in_bytes=in_b // 3, kv_in_calls=2, overlap_slowdown=slowdown)
    lo = pipelined_time(replace(ph, chunk_sap_s=s1), chunks, 1e11, 1e-5, kv)
    hi = pipelined_time(replace(ph, chunk_sap_s=s1 + ds), chunks, 1e11, 1e-5, kv)
    assert hi >= lo * (1 - 1e-12)


def test_chunk_count_enters_the_hash_only_above_one():
    cu = [0, 300, 1000, 1024]
    plans = {c: compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8, head_chunks=c) for c in (None, 1, 2, 4)}
    assert plans[None].head_chunks == 1
    assert plans[None].hash == plans[1].hash  # one chunk: the hash from before chunks existed
    assert len({plans[1].hash, plans[2].hash, plans[4].hash}) == 3


# --------------------------------------------------------------------------- q chunks sharing a kv head


def _estimates_and_sim(cu, inter: int, intra: int, heads: int, kv_heads: int, hw: str):
    """The plan, its estimate per valid count and the simulator's seconds per count (event by
    event: the independent reference), all on one NVLink node (estimate and simulator agree there)."""
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    plan = compile_plan(cu, inter, intra, num_heads=heads, num_kv_heads=kv_heads, hardware=hw)
    est = head_chunk_estimates(plan)
    sim = {c: run_method("hsap", np.asarray(cu), hw=sim_hardware(hw), intra=intra, inter=inter, shape=full_shape(heads, kv_heads),
                         plan_options={"head_chunks": c, "flatten": "never"}).seconds for c in est}  # fmt: skip
    for c in est:  # the two computations agree on every count, shared kv included, on the plan
        # the simulator runs: compiled with that count (its staging may differ from the default
        # plan's, whose every count ``est`` prices: the stage shape is picked by the time of its
        # code at the forced count — [0, 8K] 4x2 GQA 16/2 keeps another layout at C ≥ 2)
        forced = plan if c == plan.head_chunks else compile_plan(cu, inter, intra, num_heads=heads, num_kv_heads=kv_heads,
                                                                  hardware=hw, head_chunks=c)
        assert head_chunk_estimates(forced)[c] == pytest.approx(sim[c], rel=0.05), (c, est, sim)
    return plan, est, sim


def test_chunks_sharing_the_kv_head_win_where_the_all_to_all_dominates():
    """fineweb 64K on 4×2 H100s (P_intra 4), GQA 32/4: 8 q heads and ONE kv head per rank, so
    before the rule allowed C = 1 only. SAP's kv traffic is small against the all-to-all of 8 q
    heads: the planner picks C > hkv, and the simulator agrees it is the fastest count and beats
    one chunk by more than 15% (measured: 3.34 -> 2.56 ms)."""
    plan, est, sim = _estimates_and_sim(pack_batches("fineweb", 64 * K, 1, 0)[0], 2, 4, 32, 4, "h100")
    assert plan.shape.num_kv_heads == 1 and sorted(est) == [1, 2, 4, 8]
    assert plan.head_chunks > 1
    assert sim[plan.head_chunks] <= min(sim.values()) * 1.01, (plan.head_chunks, sim)
    assert sim[plan.head_chunks] < 0.85 * sim[1], sim


def test_chunks_sharing_the_kv_head_lose_where_sap_moves_mostly_kv():
    """One 8K document on 4×2 A100s (P_inter 4), GQA 16/2: 8 q heads and one kv head per rank,
    and SAP ships the document's kv along the inter ranks; each extra q chunk re-sends it. The
    planner keeps one chunk, and the simulator agrees every C > hkv is slower (measured: 1.17 ms
    with one chunk, 1.18 / 1.29 / 1.64 ms with 2 / 4 / 8)."""
    plan, est, sim = _estimates_and_sim([0, 8 * K], 4, 2, 16, 2, "a100")
    assert plan.shape.num_kv_heads == 1 and sorted(est) == [1, 2, 4, 8]
    assert plan.head_chunks == 1
    assert all(sim[c] > sim[1] for c in (2, 4, 8)), sim
    # priced as the runtime runs it: the kv side re-sent by each q chunk (the SAP bytes grow with C)
    from megatron_hsap.plan.chunks import chunked_p2p_bytes

    grown = {c: sum(int(s.sum()) for s, _ in chunked_p2p_bytes(compile_plan([0, 8 * K], 4, 2, num_heads=16, num_kv_heads=2,
                                                                             hardware="a100", head_chunks=c)).values())
             for c in (1, 2, 8)}  # fmt: skip
    assert grown[1] < grown[2] < grown[8], grown

"""Head chunks of the intra all-to-all (issue 14 item 1): the planner's rule and choice
(``plan/chunks.py``, ``estimate.pipelined_time``) and the pipelined runtime (``runtime/hsap.py``).

Planner: the valid counts, the errors of forced bad values, the auto choice (1 without an intra
or inter group; > 1 where the all-to-all is large against SAP), the closed form against an
independent event-by-event replay of the same schedule, and the plan hash covering the count.

Runtime (gloo, CPU): ``head_chunks`` forced to 1, 2 and the most the heads allow at each 4- and
8-rank topology, MHA and GQA, forward and backward, against the float64 reference
(``tests/reference.py``, fp32 tolerance 1e-5 × max(1, |ref|max), ``cases.TOLERANCE``); every
chunk count equal to one chunk within 1e-6 relative (fp32: the same kernels on fewer heads);
bytes equal to the plan (P2P) and to Ulysses' volume (all-to-all); the order of issues, waits and
SAP calls proving the overlap; sinks; an error mid-pipeline raising on every rank within the
deadline. The full matrix (random packings, balanced layout, bf16) is in
``test_head_chunks_slow.py``.
"""

from __future__ import annotations

import heapq
import os
import re

import numpy as np
import pytest
import torch

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.chunks import a2a_bytes_sent, chunk_shape, head_chunk_estimates, pipeline_phases, valid_head_chunks
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Wire
from megatron_hsap.plan.estimate import PipelinePhase, pipelined_time
from megatron_hsap.plan.options import kv_heads_per_rank
from megatron_hsap.plan.workloads import pack_batches
from tests.runtime import cases

K = 1024


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("h", "hkv", "want"), [(8, 8, (1, 2, 4, 8)), (8, 2, (1, 2)), (8, 1, (1,)), (6, 3, (1, 3)), (12, 8, (1, 2, 4))])
def test_valid_counts_split_q_and_kv_heads_alike(h, hkv, want):
    assert valid_head_chunks(h, hkv) == want
    for c in want:  # chunk c's q heads use exactly chunk c's kv heads
        per_q, per_kv, group = h // c, hkv // c, h // hkv if h % hkv == 0 else None
        if group is not None:
            assert {i // group for i in range(per_q)} == set(range(per_kv))


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
        (dict(head_chunks=4), "valid head_chunks: [1, 2]"),
        (dict(head_chunks=16), "head_chunks=16 cannot split"),
    ],
)
def test_forced_bad_values_raise_config_error_naming_them(kw, says):
    with pytest.raises(ConfigError) as exc:
        compile_plan([0, 100, 256], 2, 4, num_heads=32, num_kv_heads=8, **kw)
    assert says in str(exc.value)


def test_forced_chunks_without_an_intra_group_raise():
    with pytest.raises(ConfigError, match="intra_size=1"):
        compile_plan([0, 256], 4, 1, num_heads=8, head_chunks=2)
    assert compile_plan([0, 256], 4, 1, num_heads=8, head_chunks=1).head_chunks == 1
    with pytest.raises(ConfigError, match=r"valid head_chunks: \[1\]"):  # one kv head per rank
        compile_plan([0, 256], 2, 4, num_heads=8, num_kv_heads=2, head_chunks=2)


def test_forced_counts_are_kept_and_change_nothing_else():
    cu = [0, 300, 1000, 1024]
    base = compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8)
    for c in (1, 2, 4, np.int64(4)):
        p = compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8, head_chunks=c)
        assert p.head_chunks == c and type(p.head_chunks) is int
        assert p.fwd_programs == base.fwd_programs and p.bwd_programs == base.bwd_programs
        assert p.layout.segments == base.layout.segments and p.pool_capacity == base.pool_capacity


# --------------------------------------------------------------------------- the choice


def test_no_intra_group_or_one_kv_head_per_rank_chooses_one_chunk():
    cu = pack_batches("fineweb", 256 * K, 1, 0)[0]
    assert compile_plan(cu, 8, 1, num_heads=32, num_kv_heads=8, hardware="h100").head_chunks == 1  # pure SAP
    assert compile_plan(cu, 1, 8, num_heads=32, num_kv_heads=8, hardware="h100").head_chunks == 1  # 1 kv head per rank
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
    assert sorted(est) == [1, 2, 4]
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
    """Latency-bound: every extra chunk pays its all-to-all latencies and SAP's launches again."""
    plan = compile_plan([0, 7, 8, 1500, 1501, 4000], 4, 2, layout="contiguous")
    assert plan.head_chunks == 1


def test_a2a_bytes_equal_ulysses_volume():
    from megatron_hsap.runtime.ulysses import ulysses_bytes

    for h, hkv, p in ((32, 8, 2), (32, 8, 8), (8, 1, 4), (16, 16, 4)):
        plan = compile_plan([0, 100, 1000, 4096], 2, p, num_heads=h, num_kv_heads=hkv, head_dim=64, head_dim_v=32)
        want = ulysses_bytes(plan.local_tokens, h, hkv, 64, p, head_dim_v=32, dtype_bytes=2)
        assert a2a_bytes_sent(plan) == {"fwd": want["fwd"], "bwd": want["bwd"]}


# --------------------------------------------------------------------------- the closed form


def _replay(ph: PipelinePhase, chunks: int, bw: float, lat: float) -> float:
    """The runtime's schedule event by event: one intra link serving all-to-alls in issue order,
    one compute stream. At the start of chunk k's SAP the host has issued chunk k+1's all-to-all,
    then chunk k−1's return; SAP k starts when its all-to-all landed and SAP k−1 finished."""
    a = ph.in_bytes / chunks / bw + ph.in_calls * lat
    r = ph.out_bytes / chunks / bw + ph.out_calls * lat
    s = (ph.sap_s - ph.latency_s) / chunks + ph.latency_s + ph.launch_s
    link_free = 0.0
    arrived: dict[int, float] = {}

    def issue(t: float, dur: float) -> float:
        nonlocal link_free
        link_free = max(link_free, t) + dur
        return link_free

    arrived[1] = issue(0.0, a)
    sap_end = 0.0
    done_out = []
    for k in range(1, chunks + 1):
        start = max(sap_end, arrived[k])
        if k < chunks:
            arrived[k + 1] = issue(start, a)
        if k > 1:
            heapq.heappush(done_out, issue(start, r))
        sap_end = start + s
    done_out.append(issue(sap_end, r))
    return max(done_out)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("sap", "in_b", "out_b"), [(1e-3, 1e6, 3e5), (1e-4, 5e7, 5e7), (2e-3, 2e7, 6e7), (5e-4, 3e6, 1e6)])
def test_closed_form_against_an_event_replay(chunks, sap, in_b, out_b):
    ph = PipelinePhase(sap_s=sap, latency_s=sap / 10, launch_s=2e-5, in_bytes=int(in_b), out_bytes=int(out_b), in_calls=3, out_calls=1)
    bw, lat = 1e11, 1e-5
    closed, replay = pipelined_time(ph, chunks, bw, lat), _replay(ph, chunks, bw, lat)
    if chunks == 1:
        assert closed == pytest.approx(replay, rel=1e-12)
        return
    a = ph.in_bytes / chunks / bw + 3 * lat
    r = ph.out_bytes / chunks / bw + lat
    s = (sap - sap / 10) / chunks + sap / 10 + 2e-5
    if s >= a + r:  # compute-bound: every step is one SAP chunk, the replay agrees exactly
        assert closed == pytest.approx(replay, rel=1e-12)
        assert closed == pytest.approx(a + chunks * s + r, rel=1e-12)
    else:  # link-bound: the closed form waits for both transfers each step, never less than the replay
        assert replay <= closed * (1 + 1e-12)
        assert closed <= replay + (chunks - 1) * r  # ... and by at most the overlap of returns


def test_chunk_count_enters_the_hash_only_above_one():
    cu = [0, 300, 1000, 1024]
    plans = {c: compile_plan(cu, 2, 2, num_heads=8, num_kv_heads=8, head_chunks=c) for c in (None, 1, 2, 4)}
    assert plans[None].head_chunks == 1
    assert plans[None].hash == plans[1].hash  # one chunk: the hash from before chunks existed
    assert len({plans[1].hash, plans[2].hash, plans[4].hash}) == 3


# --------------------------------------------------------------------------- runtime: helpers

# (intra, inter) -> (heads, kv_heads): GQA where the heads allow more than one chunk, else MHA
FAST = {4: [((2, 2), (16, 8)), ((4, 1), (8, 8)), ((1, 4), (8, 2))], 8: [((2, 4), (16, 8)), ((4, 2), (8, 8)), ((8, 1), (16, 16))]}
TOKENS = {4: 128, 8: 256}


def chunk_counts(intra: int, heads: int, kv_heads: int) -> list[int]:
    """1, 2 and the largest valid count (those the heads allow)."""
    if intra == 1:
        return [1]
    valid = valid_head_chunks(heads // intra, kv_heads_per_rank(heads, kv_heads, intra))
    return sorted({c for c in (1, 2, valid[-1]) if c in valid})


def chunk_specs(cu: list[int], intra: int, inter: int, heads: int, kv_heads: int, **kw) -> list[dict]:
    """The same batch and tensors once per chunk count (``spec["head_chunks"]``)."""
    out = []
    for c in chunk_counts(intra, heads, kv_heads):
        spec = cases.build_spec(cu, intra=intra, inter=inter, heads=heads, kv_heads=kv_heads, dim=8, **kw)
        spec["head_chunks"] = c
        out.append(spec)
    return out


def check_chunk_group(specs: list[dict], results: list[list[dict]]) -> None:
    """Each run against the reference and the plan's bytes; every count equal to one chunk."""
    base = None
    for spec, per_rank in zip(specs, results):
        plan = cases.compile_for(spec)
        assert plan.head_chunks == spec["head_chunks"]
        cases.check_against_reference(spec, per_rank)
        cases.check_bytes(spec, per_rank)
        for r in per_rank:  # one executor pass per chunk and phase; all-to-all bytes as the plan says
            assert r["stats"]["fwd"]["calls"] == r["stats"]["bwd"]["calls"] == plan.head_chunks
            assert r["a2a"] == (a2a_bytes_sent(plan) if plan.intra_size > 1 else {"fwd": 0, "bwd": 0})
        if base is None:
            base = per_rank
            continue
        for r, r1 in zip(per_rank, base):
            for name in ("out", "dq", "dk", "dv"):
                scale = max(1e-30, float(np.abs(r1[name]).max()))
                err = float(np.abs(r[name] - r1[name]).max()) / scale
                assert err <= 1e-6, f"{name}: head_chunks={spec['head_chunks']} differs from 1 chunk by {err:.3g} rel"


def _run_groups(gloo_pool, world: int, groups: list[list[dict]]) -> None:
    flat = [s for g in groups for s in g]
    results = gloo_pool(world).run(cases.run_cases, flat, timeout=900)
    i = 0
    for g in groups:
        check_chunk_group(g, [[r[i + n] for r in results] for n in range(len(g))])
        i += len(g)


# --------------------------------------------------------------------------- runtime: exactness


@pytest.mark.parametrize("world", [4, 8])
def test_forced_chunks_are_exact_at_every_topology(gloo_pool, world):
    total = TOKENS[world]
    groups = []
    for n, ((intra, inter), (h, hkv)) in enumerate(FAST[world]):
        cu = [0, 5, total // 2 + 1, total - 2] if n % 2 else [0, 1, 2, total // 3, total]
        groups.append(chunk_specs(cu, intra, inter, h, hkv, seed=n))
    _run_groups(gloo_pool, world, groups)


def test_sinks_with_chunks(gloo_pool):
    """Sinks merge per chunk and their gradient covers each chunk's heads (test_sinks' checks)."""
    from tests.runtime.test_sinks import _check, _sink_spec, run_sink_cases

    specs = []
    for c, kind in ((2, "random"), (4, "with_inf")):
        spec = _sink_spec([0, 3, 70, 128], intra=2, inter=2, heads=16, kv_heads=16, dim=8, seed=c, sink_kind=kind)
        spec["head_chunks"] = c
        specs.append(spec)
    results = gloo_pool(4).run(run_sink_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        assert cases.compile_for(spec).head_chunks == spec["head_chunks"]
        _check(spec, [r[i] for r in results])


# --------------------------------------------------------------------------- runtime: overlap order


def case_event_order(spec: dict) -> list[tuple[str, str, int]]:
    """Forward + backward with every intra all-to-all issue, wait and SAP call recorded in order:
    ``("issue" | "wait", "<phase> to heads" | "<phase> return", chunk)``, ``("sap", phase, n)``
    at the start of the n-th SAP call of the phase and ``("sap-end", phase, n)`` at its end;
    ``("async", "", 0)`` each time ``all_to_all_single`` is called with ``async_op=True``."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap as hsap_mod
    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.hsap import runner_for

    events: list[tuple[str, str, int]] = []
    plan = cases.compile_for(spec)
    intra, inter = cases.make_groups(spec["intra"], spec["inter"])
    runner = runner_for(plan, intra_group=intra, inter_group=inter)
    ex = runner.executor
    real_issue, real_a2a = hsap_mod.issue_exchange, dist.all_to_all_single
    calls = {"fwd": 0, "bwd": 0}

    def parse(stage: str) -> tuple[str, int]:
        m = re.match(r"(\w+ (?:to heads|return)), tensor \d+/\d+ of head chunk (\d+)/", stage)
        assert m, stage
        return m.group(1), int(m.group(2)) - 1

    class Recorded:
        def __init__(self, x):
            self.x = x

        def wait(self):
            events.append(("wait", *parse(self.x.stage)))
            return self.x.wait()

        def __getattr__(self, name):
            return getattr(self.x, name)

    def issue(recv, send, group, *, timeout_s, stage):
        events.append(("issue", *parse(stage)))
        return Recorded(real_issue(recv, send, group, timeout_s=timeout_s, stage=stage))

    def a2a(*args, **kwargs):
        if kwargs.get("async_op"):
            events.append(("async", "", 0))
        return real_a2a(*args, **kwargs)

    def recorded(phase, fn):
        def run(*args, **kwargs):
            n = calls[phase]
            calls[phase] += 1
            events.append(("sap", phase, n))
            out = fn(*args, **kwargs)
            events.append(("sap-end", phase, n))
            return out
        return run

    hsap_mod.issue_exchange, dist.all_to_all_single = issue, a2a
    ex.forward, ex.backward = recorded("fwd", ex.forward), recorded("bwd", ex.backward)
    try:
        rank = dist.get_rank()
        idx = torch.from_numpy(plan.local_token_indices(rank))
        q, k, v, do = (torch.from_numpy(spec[n])[idx] for n in ("q", "k", "v", "do"))
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        hsap_attn_func(q, k, v, plan, intra_group=intra, inter_group=inter).backward(do)
    finally:
        hsap_mod.issue_exchange, dist.all_to_all_single = real_issue, real_a2a
        del ex.forward, ex.backward
    return events


def check_overlap_order(events: list[tuple[str, str, int]], chunks: int, tensors_in: dict[str, int]) -> None:
    """Chunk k's SAP starts after its own all-to-all was waited, after chunk k+1's all-to-all and
    chunk k−1's return were issued, and before either is waited (they overlap it); every issue
    is waited; every exchange is an async all_to_all_single."""
    pos = {e: i for i, e in enumerate(events) if e[0] in ("sap", "sap-end")}
    for phase in ("fwd", "bwd"):
        into, back = f"{phase} to heads", f"{phase} return"
        at = lambda kind, side, c: [i for i, e in enumerate(events) if e == (kind, side, c)]  # noqa: E731
        for c in range(chunks):
            start, end = pos[("sap", phase, c)], pos[("sap-end", phase, c)]
            assert len(at("issue", into, c)) == tensors_in[phase] and len(at("wait", into, c)) == tensors_in[phase]
            assert max(at("wait", into, c)) < start, (phase, c, events)
            if c + 1 < chunks:  # the next chunk's all-to-all is in flight during this chunk's SAP
                assert max(at("issue", into, c + 1)) < start < end < min(at("wait", into, c + 1)), (phase, c, events)
            if c > 0:  # ... and the previous chunk's return
                assert max(at("issue", back, c - 1)) < start < end < min(at("wait", back, c - 1)), (phase, c, events)
            assert min(at("issue", back, c)) > end  # a chunk's results go back after it was computed
    issues = [e for e in events if e[0] == "issue"]
    assert sorted(issues) == sorted(("issue", *e[1:]) for e in events if e[0] == "wait")  # every issue waited
    assert sum(e[0] == "async" for e in events) == len(issues)


@pytest.mark.parametrize(("intra", "inter", "chunks"), [(2, 2, 4), (4, 1, 2)])
def test_next_chunk_is_in_flight_while_sap_computes(gloo_pool, intra, inter, chunks):
    spec = cases.build_spec([0, 20, 70, 128], intra=intra, inter=inter, heads=16, kv_heads=16, dim=8, seed=3)
    spec["head_chunks"] = chunks
    for events in gloo_pool(intra * inter).run(case_event_order, spec, timeout=600):
        check_overlap_order(events, chunks, {"fwd": 3, "bwd": 1})


# --------------------------------------------------------------------------- runtime: buffers


def case_saved_bytes(counts: list[int]) -> list[int]:
    """Bytes the layer keeps for backward (its autograd node's saved tensors), per chunk count."""
    from megatron_hsap.runtime import hsap_attn_func

    intra, _ = cases.make_groups(2, 1)
    out = []
    for c in counts:
        plan = compile_plan([0, 300, 1024], 1, 2, num_heads=16, num_kv_heads=8, head_dim=8, dtype_bytes=4, head_chunks=c)
        x = torch.randn(plan.local_tokens, 16, 8, requires_grad=True)
        kv = torch.randn(plan.local_tokens, 8, 8, requires_grad=True)
        y = hsap_attn_func(x, kv, kv, plan, intra_group=intra)
        out.append(sum(t.numel() * t.element_size() for t in y.grad_fn.saved_tensors if t is not None))
        y.sum().backward()
    return out


def test_saved_buffers_do_not_grow_with_chunks(gloo_pool):
    """Received q, k, v, the output and its fp32 LSE: the same bytes whatever the chunk count,
    the sizes of the layer without chunks (the inter chunk's 1024 rows × this rank's heads)."""
    t, h, hkv, d = 1024, 8, 4, 8  # rows and heads per rank after the all-to-all
    want = 4 * (t * h * d + 2 * t * hkv * d + t * h * d + t * h)
    for got in gloo_pool(2).run(case_saved_bytes, [1, 2, 4], timeout=300):
        assert got == [want] * 3, (got, want)


# --------------------------------------------------------------------------- runtime: faults


def test_ranks_on_other_chunk_counts_are_caught_before_the_all_to_all(gloo_pool):
    """Same batch, head_chunks 2 on rank 0 and 1 on rank 1: the intra handshake (plan hash) raises on
    both ranks, naming the option, before any payload; the group stays usable."""
    from tests.runtime.test_faults import CASE_TIMEOUT, case_plans

    mine = cases.build_spec([0, 5, 32], intra=2, inter=1, heads=4, kv_heads=4, dim=4, seed=1)
    other = dict(mine)
    mine["head_chunks"] = 2
    results = gloo_pool(2).run(case_plans, [mine, other], timeout=CASE_TIMEOUT)
    for rank, r in enumerate(results):
        assert not r["ok"] and r["error"] == "RuntimeMismatchError", r
        assert "(intra group rank" in r["message"], r
        assert ("head_chunks: 2 here, None on the peer" if rank == 0 else "head_chunks: None here, 2 on the peer") in r["message"], r
        assert r["usable"]



def case_fault_mid_pipeline(fail_rank: int, fail_call: int, phase: str) -> str:
    """2×1 with 2 chunks on a fresh group and a 2 s deadline; ``fail_rank``'s ``fail_call``-th SAP
    call of ``phase`` raises. Returns what this rank raised (flagged if the failing rank left an
    exchange it issued in flight)."""
    import torch.distributed as dist

    from megatron_hsap.errors import HSAPError
    from megatron_hsap.runtime import hsap as hsap_mod
    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.hsap import runner_for

    os.environ["HSAP_P2P_TIMEOUT_S"] = "2"
    try:
        rank = dist.get_rank()
        intra = dist.new_group([0, 1], backend="gloo")
        plan = compile_plan([0, 30, 64], 1, 2, num_heads=4, num_kv_heads=4, head_dim=4, dtype_bytes=4, head_chunks=2)
        runner = runner_for(plan, intra_group=intra, inter_group=None)
        ex = runner.executor
        real = getattr(ex, phase)
        seen = [0]

        def maybe_fail(*args, **kwargs):
            seen[0] += 1
            if rank == fail_rank and seen[0] == fail_call + 1:
                raise RuntimeError("injected SAP failure")
            return real(*args, **kwargs)

        issued = []
        real_issue = hsap_mod.issue_exchange

        def issue(*args, **kwargs):
            issued.append(real_issue(*args, **kwargs))
            return issued[-1]

        setattr(ex, phase, maybe_fail)
        hsap_mod.issue_exchange = issue
        try:
            x = torch.randn(plan.local_tokens, 4, 4, requires_grad=True)
            hsap_attn_func(x, x, x, plan, intra_group=intra).sum().backward()
            return "ok"
        except (HSAPError, RuntimeError) as exc:
            # nothing this rank issued is left in flight (the peer issued the same ones first)
            drained = all(x.done and x.work.is_completed() for x in issued) if rank == fail_rank else True
            return f"{type(exc).__name__}: {exc}" + ("" if drained else " [exchanges left in flight]")
        finally:
            delattr(ex, phase)
            hsap_mod.issue_exchange = real_issue
    finally:
        os.environ.pop("HSAP_P2P_TIMEOUT_S", None)


@pytest.mark.parametrize(("fail_call", "phase"), [(0, "forward"), (1, "forward"), (1, "backward")])
def test_error_mid_pipeline_raises_everywhere_within_the_deadline(gloo_pool, fail_call, phase):
    """The failing rank waits what it issued and re-raises; its peer's next exchange misses the
    2 s deadline (a 30 s case clock: a hang fails the test)."""
    results = gloo_pool(2).run(case_fault_mid_pipeline, 0, fail_call, phase, timeout=30)
    assert results[0] == "RuntimeError: injected SAP failure", results
    assert results[1].startswith("CommunicationError: Ulysses all_to_all_single ("), results
    assert "did not complete within 2 s" in results[1], results

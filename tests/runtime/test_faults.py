"""Faults never corrupt or hang (issue 18): ranks on different plans are caught on the wire before
any payload, every HSAP collective has a deadline, and bad input raises before any collective.

Each multi-rank case runs on a fresh gloo group (destroyed after the case by the pool, pending
operations with it) so a deliberately broken group never leaks into the next case. Times are
bounded by configuration, never measured: deadlines are 2 s (``HSAP_P2P_TIMEOUT_S``) and every
``pool.run`` has a 30 s case timeout, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import BatchError, CommunicationError, ConfigError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.fingerprint import INPUT_NAMES, differing_inputs, input_vector, join_hash, split_hash
from megatron_hsap.runtime.env import read_env
from tests.runtime import cases, reliability_cases

CASE_TIMEOUT = 30.0  # the pool's per-case clock: no test waits longer
DEADLINE = "2"  # HSAP_P2P_TIMEOUT_S inside the cases


# --------------------------------------------------------------------------- rank-side cases


def _fresh_groups(intra: int, inter: int) -> tuple[Any, Any]:
    """New gloo (intra, inter) groups over the world (destroyed by the pool after the case)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    assert intra * inter == world
    mine = [None, None]
    for i in range(inter):
        g = dist.new_group(list(range(i * intra, (i + 1) * intra)), backend="gloo") if intra > 1 else None
        if rank // intra == i:
            mine[0] = g
    for j in range(intra):
        g = dist.new_group(list(range(j, world, intra)), backend="gloo") if inter > 1 else None
        if rank % intra == j:
            mine[1] = g
    return mine[0], mine[1]


def _group_usable(groups: tuple[Any, Any]) -> bool:
    """An all-reduce on every real group finishes within 5 s: nothing was left unmatched."""
    import datetime

    import torch.distributed as dist

    for g in groups:
        if g is None:
            continue
        work = dist.all_reduce(torch.ones(1), group=g, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=5))
        except RuntimeError:
            return False
    return True


def case_plans(specs: list[dict], *, backward: bool = True, check_usable: bool = True) -> dict:
    """Rank r compiles ``specs[r]`` and runs forward (+ backward) with ``hsap_attn_func``; returns
    the error (class, message) or the output and gradients, and whether the groups still work."""
    import torch.distributed as dist

    from megatron_hsap.errors import HSAPError
    from megatron_hsap.runtime import hsap_attn_func

    rank = dist.get_rank()
    spec = specs[rank]
    os.environ["HSAP_P2P_TIMEOUT_S"] = DEADLINE
    try:
        plan = cases.compile_for(spec)
        groups = _fresh_groups(spec["intra"], spec["inter"])
        idx, q, k, v, do = cases.rank_inputs(spec, plan, rank)
        try:
            out = hsap_attn_func(q, k, v, plan, intra_group=groups[0], inter_group=groups[1])
            if backward:
                out.backward(do)
            result: dict = {"ok": True, "idx": idx.numpy(), "out": out.detach().float().numpy()}
            if backward:
                result.update(dq=q.grad.float().numpy(), dk=k.grad.float().numpy(), dv=v.grad.float().numpy())
        except HSAPError as exc:
            result = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        if check_usable:
            result["usable"] = _group_usable(groups)
        return result
    finally:
        os.environ.pop("HSAP_P2P_TIMEOUT_S", None)


def case_peer_raises_first(cu: list[int], bad_rank: int) -> str:
    """Every rank calls the attention on the same plan; ``bad_rank`` hands it a wrong shape (its
    own validation error, raised before any collective). The others must fail within the deadline
    pointing at it. The bad rank stays alive past the deadline (a closed socket is another story)."""
    import time

    import torch.distributed as dist

    from megatron_hsap.errors import HSAPError
    from megatron_hsap.runtime import hsap_attn_func

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["HSAP_P2P_TIMEOUT_S"] = DEADLINE
    try:
        plan = compile_plan(cu, world, 1, num_heads=2, head_dim=4, dtype_bytes=4)
        _, inter = _fresh_groups(1, world)
        t = plan.local_tokens - (rank == bad_rank)
        x = torch.randn(t, 2, 4)
        try:
            hsap_attn_func(x, x, x, plan, inter_group=inter)
            result = "ok"
        except HSAPError as exc:
            result = f"{type(exc).__name__}: {exc}"
        if rank == bad_rank:
            time.sleep(float(DEADLINE) + 2)
        return result
    finally:
        os.environ.pop("HSAP_P2P_TIMEOUT_S", None)


def case_handshake_cache(cu: list[int], other_cu: list[int]) -> list[int]:
    """Exchanges counted: first call of a plan, second call (cached), backward, a new plan."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.handshake import handshake_count

    world = dist.get_world_size()
    _, inter = _fresh_groups(1, world)
    counts = [handshake_count()]
    for c in (cu, cu, other_cu):
        plan = compile_plan(c, world, 1, num_heads=2, head_dim=4, dtype_bytes=4)
        x = torch.randn(plan.local_tokens, 2, 4, requires_grad=True)
        hsap_attn_func(x, x, x, plan, inter_group=inter).sum().backward()
        counts.append(handshake_count())
    return [b - a for a, b in zip(counts, counts[1:])]


def case_lonely_collective(kind: str, lonely_rank: int) -> str:
    """Only ``lonely_rank`` issues one HSAP collective (the others never call it); its error."""
    import time

    import torch.distributed as dist

    from megatron_hsap.runtime.consistency import fingerprint_mismatch
    from megatron_hsap.runtime.p2p import warm_up
    from megatron_hsap.runtime.ulysses import seq_to_heads

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    result = "not called"
    if rank == lonely_rank:
        try:
            if kind == "warm_up":
                warm_up(group, torch.device("cpu"), timeout_s=1.0)
            elif kind == "all_to_all":
                seq_to_heads(torch.randn(4, 2 * world, 3), group, timeout_s=1.0)
            elif kind == "debug_all_gather":
                fingerprint_mismatch([0, 8], group, timeout_s=1.0)
            result = "returned"
        except CommunicationError as exc:
            result = f"CommunicationError: {exc}"
    else:
        time.sleep(3.0)  # alive past the lonely rank's deadline
    return result


def case_bad_call(kind: str) -> str:
    """One wrong argument on every rank of world 2; the error and the collectives issued (0)."""
    from megatron_hsap.errors import HSAPError
    from megatron_hsap.runtime import hsap_attn_func

    plan = compile_plan([0, 10, 32], 2, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    _, inter = cases.make_groups(1, 2)
    x = torch.randn(plan.local_tokens, 2, 4)
    q = k = v = x
    scale = None
    if kind == "inf_scale":
        scale = math.inf
    elif kind == "nan_scale":
        scale = math.nan
    elif kind == "meta":
        q = k = v = x.to("meta")
    with reliability_cases._CountCollectives() as calls:
        try:
            hsap_attn_func(q, k, v, plan, inter_group=inter, softmax_scale=scale)
            result = "no error"
        except HSAPError as exc:
            result = f"{type(exc).__name__}: {exc}"
    return f"{result} | collectives: {len(calls)}"


# --------------------------------------------------------------------------- helpers


def _spec(cu: list[int], *, inter: int = 2, intra: int = 1, seed: int = 0, **extra: Any) -> dict:
    spec = cases.build_spec(cu, intra=intra, inter=inter, heads=2, kv_heads=2, dim=4, seed=seed)
    spec.update(extra)
    return spec


def _check_exact(specs: list[dict], results: list[dict]) -> None:
    """Every rank returned, against the float64 reference of the (shared) spec."""
    assert all(r["ok"] for r in results), [r.get("message") for r in results]
    cases.check_against_reference(specs[0], results)


# --------------------------------------------------------------------------- plan hash (pure)


def test_plan_hash_covers_every_input_and_is_stable():
    base = dict(num_heads=2, head_dim=4, dtype_bytes=4, layout="contiguous")
    a = compile_plan([0, 5, 16], 2, **base)
    assert a.hash == compile_plan(np.array([0, 5, 16], dtype=np.int32), 2, **base).hash  # same inputs
    assert 0 < a.hash < 1 << 128 and join_hash(*split_hash(a.hash)) == a.hash
    variants = {
        "cu_seqlens": compile_plan([0, 6, 16], 2, **base),
        "T": compile_plan([0, 5, 24], 2, **base),
        "pool_bytes": compile_plan([0, 5, 16], 2, **{**base, "pool_bytes": 1 << 21}),
        "layout": compile_plan([0, 5, 16], 2, **{**base, "layout": "balanced", "layout_fallback": False}),
        "dtype_bytes": compile_plan([0, 5, 16], 2, **{**base, "dtype_bytes": 2}),
        "num_heads": compile_plan([0, 5, 16], 2, **{**base, "num_heads": 4}),
        "inter_size": compile_plan([0, 5, 16], 4, **base),
    }
    hashes = {name: p.hash for name, p in variants.items()}
    assert a.hash not in hashes.values() and len(set(hashes.values())) == len(hashes)
    # the second exchange names the differing input, with both values where they are numbers
    assert differing_inputs(a, input_vector(variants["pool_bytes"])).startswith("pool_bytes: None here, 2097152 on the peer")
    assert differing_inputs(a, input_vector(variants["T"])) == "cu_seqlens: 3 entries, T=16 here; 3 entries, T=24 on the peer"
    assert "same length and T, other boundaries" in differing_inputs(a, input_vector(variants["cu_seqlens"]))
    assert differing_inputs(a, input_vector(variants["layout"])).startswith("layout: 'contiguous' here, another value")
    assert len(input_vector(a)) == len(INPUT_NAMES)


# --------------------------------------------------------------------------- mismatched plans


@pytest.mark.parametrize(
    ("name", "peer_spec", "says"),
    [
        ("T", dict(cu=[0, 5, 24]), "cu_seqlens: 3 entries, T=16 here; 3 entries, T=24 on the peer"),
        ("pool_bytes", dict(pool_bytes=1 << 21), "pool_bytes: None here, 2097152 on the peer"),
        ("layout", dict(layout="balanced"), "layout: 'contiguous' here, another value on the peer"),
    ],
)
def test_mismatched_plans_raise_on_both_ranks_before_any_payload(gloo_pool, name, peer_spec, says):
    mine = _spec([0, 5, 16])
    other = _spec(peer_spec.get("cu", [0, 5, 16]), **{k: v for k, v in peer_spec.items() if k != "cu"})
    results = gloo_pool(2).run(case_plans, [mine, other], timeout=CASE_TIMEOUT)
    for rank, r in enumerate(results):
        assert not r["ok"] and r["error"] == "RuntimeMismatchError", r
        msg = r["message"]
        assert msg.startswith("ranks run different plans (inter group rank"), msg
        assert re.search(r"plan hash [0-9a-f]{32} here vs [0-9a-f]{32} on the peer", msg), msg
        if rank == 0:  # rank 1 sees the same difference from its side
            assert says in msg, msg
        assert "no payload was sent, the group is still usable" in msg
        assert r["usable"], "the handshake left unmatched messages on the group"


def test_intra_group_mismatch_is_caught_before_the_all_to_all(gloo_pool):
    mine, other = _spec([0, 5, 16], inter=1, intra=2), _spec([0, 7, 16], inter=1, intra=2)
    results = gloo_pool(2).run(case_plans, [mine, other], timeout=CASE_TIMEOUT)
    for r in results:
        assert r["error"] == "RuntimeMismatchError" and "(intra group rank" in r["message"], r
        assert "cu_seqlens: 3 entries, T=16 here; 3 entries, T=16 on the peer (same length and T" in r["message"]
        assert r["usable"]


def test_agreeing_plans_are_exact_and_checked_once_per_plan(gloo_pool):
    spec = _spec([0, 5, 16, 30])
    results = gloo_pool(2).run(case_plans, [spec, spec], timeout=CASE_TIMEOUT)
    _check_exact([spec, spec], results)
    # first call: one exchange; same plan again and its backward: none; a new plan: one
    for deltas in gloo_pool(2).run(case_handshake_cache, [0, 9, 32], [0, 3, 32], timeout=CASE_TIMEOUT):
        assert deltas == [1, 0, 1]


def test_peer_failing_validation_makes_the_others_fail_within_the_deadline(gloo_pool):
    results = gloo_pool(2).run(case_peer_raises_first, [0, 9, 32], 1, timeout=CASE_TIMEOUT)
    assert results[1].startswith("RuntimeMismatchError: q has shape (15, 2, 4)"), results[1]
    msg = results[0]
    assert msg.startswith("CommunicationError: plan handshake on inter group rank 0 (global 0), fwd"), msg
    assert "no header from peer 1 (global 1): recv from it did not complete within 2 s" in msg, msg
    assert "raised before the first round" in msg


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("warm_up", "P2P warm-up all_reduce (before the first round on this group)"),
        ("all_to_all", "Ulysses all_to_all_single (sequence to heads, [4, 4, 3] per rank)"),
        ("debug_all_gather", "cu_seqlens fingerprint all_gather (batch consistency check)"),
    ],
)
def test_every_collective_has_a_deadline(gloo_pool, kind, says):
    results = gloo_pool(2).run(case_lonely_collective, kind, 0, timeout=CASE_TIMEOUT)
    assert results[1] == "not called"
    msg = results[0]
    assert msg.startswith(f"CommunicationError: {says} on global rank 0, group of global ranks [0, 1], "), msg
    assert "did not complete within 1 s" in msg and "a peer never called it" in msg, msg


@pytest.mark.parametrize("raw", ["inf", "1e15", "nan", "-1", "0", "604801"])
def test_timeout_must_be_finite_and_bounded(raw):
    with pytest.raises(ConfigError, match=re.escape(f"HSAP_P2P_TIMEOUT_S={raw!r} must be a finite number")):
        read_env({"HSAP_P2P_TIMEOUT_S": raw})
    assert read_env({"HSAP_P2P_TIMEOUT_S": "604800"}).p2p_timeout_s == 604800.0


def test_executor_refuses_an_unbounded_timeout_at_construction():
    from megatron_hsap.runtime.executor import Executor

    plan = compile_plan([0, 16], 1, num_heads=2, head_dim=4, dtype_bytes=4)
    with pytest.raises(ConfigError, match="timeout_s=inf must be a finite number of seconds"):
        Executor(plan, None, "cpu", timeout_s=math.inf)


# --------------------------------------------------------------------------- bad input, before any collective


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("inf_scale", "ConfigError: softmax_scale must be a finite number > 0"),
        ("nan_scale", "ConfigError: softmax_scale must be a finite number > 0"),
        ("meta", "RuntimeMismatchError: q, k, v are on the meta device"),
    ],
)
def test_bad_calls_raise_before_any_collective(gloo_pool, kind, says):
    for msg in gloo_pool(2).run(case_bad_call, kind, timeout=CASE_TIMEOUT):
        assert msg.startswith(says) and msg.endswith("| collectives: 0"), msg


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda: compile_plan([0, 2**70], 2), BatchError, "exceeds 2147483647 (2^31 - 1)"),
        (lambda: compile_plan([0, 16], 2, pool_bytes=[1]), ConfigError, "pool_bytes must be an integer >= 1, got [1]"),
        (lambda: compile_plan([0, 16], 2, dtype_bytes=3), ConfigError, "dtype_bytes=3 is not an activation size"),
        (lambda: compile_plan([0, 16], 2).dump(-1), ConfigError, "inter rank -1 is out of range"),
        (lambda: compile_plan([0, 16], 2).dump(5), ConfigError, "inter rank 5 is out of range"),
    ],
)
def test_plan_inputs_raise_one_line_errors(call, error, says):
    with pytest.raises(error) as info:
        call()
    assert says in str(info.value)


@pytest.fixture
def no_memory(monkeypatch):
    """Every compile runs out of host memory."""
    from megatron_hsap.plan import plan as plan_module

    def out(*_args, **_kwargs):
        raise MemoryError

    monkeypatch.setattr(plan_module, "_compile_uncached", out)


def test_planning_out_of_host_memory_is_a_batch_error(no_memory):
    """A batch too large for the planner's per-token arrays (2^30 tokens on a small host): one line."""
    with pytest.raises(BatchError, match=r"planning a batch of T=1073741824 tokens \(1 documents\) at inter_size=2 ran out of host memory"):
        compile_plan([0, 1 << 30], 2, num_heads=3)  # num_heads=3: not a cached plan


def test_out_of_memory_with_a_small_pool_still_names_the_batch(no_memory):
    """A small pool_bytes once exhausted host memory (thousands of stages per candidate, found by a
    planner fuzz); the stage cap bounds that now (tests/plan/test_stage_cap.py compiles the fuzz's
    batch under 64 KiB), so running out of memory is about the batch, whatever the pool."""
    cu, kw = [0, 109614, 147835, 206573, 227113], dict(num_heads=64, num_kv_heads=32, head_dim=64, flatten="never")
    with pytest.raises(BatchError, match=r"T=227113 tokens \(4 documents\) at inter_size=16 ran out of host memory.*split the micro-batch"):
        compile_plan(cu, 16, 8, pool_bytes=65536, **kw)


def test_option_cache_does_not_confuse_true_with_one():
    compile_plan([0, 16], 1)
    with pytest.raises(ConfigError, match="inter_size must be an integer >= 1, got True"):
        compile_plan([0, 16], True)
    compile_plan([0, 16], 2, pad_multiple=1)
    with pytest.raises(ConfigError, match="pad_multiple must be an integer >= 1, got True"):
        compile_plan([0, 16], 2, pad_multiple=True)


# --------------------------------------------------------------------------- property: raise everywhere or exact


_MUTATIONS = ("same", "boundary", "T", "pool_bytes", "layout", "heads", "dtype")


@st.composite
def _rank_pair(draw: st.DrawFn, topologies: tuple[tuple[int, int], ...]) -> tuple[dict, dict, str]:
    """Two ranks' specs: a random packing, and the same or a mutated batch / option set."""
    intra, inter = draw(st.sampled_from(topologies))
    lengths = draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))
    cu = [0, *np.cumsum(lengths).tolist()]
    kind = draw(st.sampled_from(_MUTATIONS))
    other_cu, extra_a, extra_b = list(cu), {}, {}
    heads_b, dtype_b = 4, "float32"
    if kind == "boundary" and len(cu) > 2:
        pos = draw(st.integers(1, len(cu) - 2))
        other_cu[pos] = other_cu[pos] + (1 if other_cu[pos] < other_cu[pos + 1] else -1)
        other_cu = sorted(other_cu)
    elif kind in ("boundary", "T"):
        other_cu[-1] += draw(st.integers(1, 9))
    elif kind == "pool_bytes":
        extra_b["pool_bytes"] = draw(st.sampled_from([1 << 21, 1 << 22]))
    elif kind == "layout":
        extra_b["layout"] = "balanced"
    elif kind == "heads":
        heads_b = 8
    elif kind == "dtype":
        dtype_b = "bfloat16"
    base = dict(intra=intra, inter=inter, kv_heads=2, dim=4, seed=draw(st.integers(0, 3)))
    a = cases.build_spec(cu, heads=4, **base, **extra_a)
    b = cases.build_spec(other_cu, heads=heads_b, dtype=dtype_b, **{**base, "kv_heads": 2}, **extra_b)
    return a, b, kind


def _raise_everywhere_or_exact(pool: Any, a: dict, b: dict, kind: str) -> None:
    """Rank 0 runs ``a``, every other rank ``b``: all exact when the plans agree, else every rank
    raises. Ranks whose own groups agree but whose inter peer raised at the intra handshake (2×2)
    fail by the deadline instead, naming the silent peer; every other rank names both plans."""
    world = a["intra"] * a["inter"]
    specs = [a] + [b] * (world - 1)
    same_plan = cases.compile_for(a).hash == cases.compile_for(b).hash
    event(f"{kind}: {'same plan' if same_plan else 'plans differ'}")
    results = pool.run(case_plans, specs, check_usable=world == 2, timeout=CASE_TIMEOUT)
    outcomes = [r["ok"] for r in results]
    if same_plan:
        _check_exact(specs, results)
        return
    assert not any(outcomes), f"{kind}: plans differ but ranks {[i for i, ok in enumerate(outcomes) if ok]} returned"
    assert results[0]["error"] == "RuntimeMismatchError", (kind, results[0]["message"])
    for r in results:
        if r["error"] == "RuntimeMismatchError":
            assert "ranks run different plans" in r["message"], (kind, r["message"])
            assert r.get("usable", True), f"{kind}: the handshake left the group unusable"
        else:
            assert r["error"] == "CommunicationError" and "no header from peer" in r["message"], (kind, r)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=_rank_pair(((1, 2), (2, 1))))
def test_property_two_ranks_raise_everywhere_or_are_exact(gloo_pool, pair):
    _raise_everywhere_or_exact(gloo_pool(2), *pair)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=_rank_pair(((1, 4), (2, 2), (4, 1))))
def test_property_four_ranks_raise_everywhere_or_are_exact(gloo_pool, pair):
    _raise_everywhere_or_exact(gloo_pool(4), *pair)

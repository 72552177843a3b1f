"""Head chunks finer than the kv heads (``hkv | C``, ``plan/chunks.py``): q chunks that share a kv
head, the runtime's side (the rule and the estimate: ``tests/plan/test_head_chunks_plan.py``).

Runtime (gloo, CPU): GQA with 1 or 2 kv heads per intra rank (kv replicated when
``P_intra > Hkv``) and ``C`` up to the q heads per rank, at 4- and 8-rank topologies, forward and
backward against the float64 reference (``tests/reference.py``) and against one chunk (1e-6
relative in fp32: dk, dv are summed over a kv chunk's q chunks in fp32); P2P bytes equal to
``plan/chunks.chunked_p2p_bytes`` (q side once, kv side ``C/Ckv`` times) and all-to-all bytes to
Ulysses' volume (``cases.check_bytes``); sinks; the issue order (k, v exchanged once per kv
chunk, with its first q chunk; dk, dv returned once, after its last). bf16 and the balanced
layout: ``test_head_chunks_slow.py``.
"""

from __future__ import annotations

import pytest

from megatron_hsap.plan.chunks import chunked_p2p_bytes, kv_head_chunks
from tests.runtime import cases
from tests.runtime.test_head_chunks import TOKENS, _run_groups, case_event_order

# (intra, inter, heads, kv_heads, chunk counts): q heads / kv heads per intra rank in the comment
SHARED = {
    4: [(2, 2, 8, 2, (1, 2, 4)),  # 4 / 1
        (4, 1, 8, 2, (1, 2)),  # 2 / 1, kv replicated (P_intra 4 > Hkv 2)
        (2, 2, 16, 4, (1, 4, 8))],  # 8 / 2: Ckv 2, 2 and 4 q chunks per kv chunk
    8: [(2, 4, 16, 2, (1, 2, 8)),  # 8 / 1
        (4, 2, 8, 2, (1, 2))],  # 2 / 1, kv replicated
}  # fmt: skip


def shared_specs(cu: list[int], intra: int, inter: int, heads: int, kv_heads: int, counts, **kw) -> list[dict]:
    out = []
    for c in counts:
        spec = cases.build_spec(cu, intra=intra, inter=inter, heads=heads, kv_heads=kv_heads, dim=8, **kw)
        spec["head_chunks"] = c
        out.append(spec)
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_q_chunks_sharing_a_kv_head_are_exact(gloo_pool, world):
    total = TOKENS[world]
    groups = []
    for n, (intra, inter, h, hkv, counts) in enumerate(SHARED[world]):
        cu = [0, 5, total // 2 + 1, total - 2] if n % 2 else [0, 1, 2, total // 3, total]
        groups.append(shared_specs(cu, intra, inter, h, hkv, counts, seed=n))
    for g in groups:  # the cases do exercise q chunks sharing a kv chunk, with P2P to re-send
        plan = cases.compile_for(g[-1])
        assert kv_head_chunks(plan.head_chunks, plan.shape.num_kv_heads) < plan.head_chunks
    _run_groups(gloo_pool, world, groups)


def test_shared_kv_bytes_resend_the_kv_side_only():
    """The prediction by hand: per wire, q-side once and kv-side C/Ckv times, from the programs at
    C = 1 (an independent sum over the Send/Recv ops)."""
    from megatron_hsap.plan.ir import Post, Send, Wire

    cu = [0, 5, 70, 128]
    for c in (2, 4):
        plan = cases.compile_for(shared_specs(cu, 2, 2, 8, 2, (c,))[0])
        assert plan.head_chunks == c and plan.shape.num_kv_heads == 1
        got = chunked_p2p_bytes(plan)
        for ph in ("fwd", "bwd"):
            kv_total = 0
            for r in range(plan.inter_size):
                q_side = kv_side = 0
                for ins in plan.program(r, ph).instrs:
                    if isinstance(ins, Post):
                        for op in ins.round.ops:
                            if isinstance(op, Send):
                                if op.wire in (Wire.KV, Wire.DKV):
                                    kv_side += op.nbytes
                                else:
                                    q_side += op.nbytes
                assert int(got[ph][0][r]) == q_side + kv_side * c, (ph, r)
                kv_total += kv_side
            assert kv_total > 0  # the batch has kv-side traffic in both phases


def test_sinks_with_shared_kv_chunks(gloo_pool):
    """Sinks merge per q chunk and their gradient covers each chunk's heads when q chunks share a kv head."""
    from tests.runtime.test_sinks import _check, _sink_spec, run_sink_cases

    specs = []
    for c, hkv, kind in ((4, 2, "random"), (2, 1, "with_inf")):
        spec = _sink_spec([0, 3, 70, 128], intra=2, inter=2, heads=8, kv_heads=hkv, dim=8, seed=c, sink_kind=kind)
        spec["head_chunks"] = c
        specs.append(spec)
    results = gloo_pool(4).run(run_sink_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        plan = cases.compile_for(spec)
        assert plan.head_chunks == spec["head_chunks"] and plan.shape.num_kv_heads == 1
        _check(spec, [r[i] for r in results])


def check_shared_kv_order(events: list[tuple[str, str, int]], chunks: int, per: int) -> None:
    """k, v go to heads once per kv chunk, with its first q chunk, waited before that chunk's SAP;
    dk, dv return once per kv chunk, after its last q chunk's SAP; q, dO, o, dq every chunk; the
    next chunk's q all-to-all overlaps this chunk's SAP; every issue waited."""
    pos = {e: i for i, e in enumerate(events) if e[0] in ("sap", "sap-end")}
    at = lambda kind, side, c: [i for i, e in enumerate(events) if e == (kind, side, c)]  # noqa: E731
    issued = lambda side: sorted(e[2] for e in events if e[:2] == ("issue", side))  # noqa: E731
    firsts, lasts = list(range(0, chunks, per)), list(range(per - 1, chunks, per))
    every = list(range(chunks))
    assert issued("fwd to heads q") == every and issued("fwd return o") == every
    assert issued("fwd to heads k") == firsts and issued("fwd to heads v") == firsts
    assert issued("bwd to heads do") == every and issued("bwd return dq") == every
    assert issued("bwd return dk") == lasts and issued("bwd return dv") == lasts
    for c in firsts:
        for name in ("k", "v"):
            assert max(at("wait", f"fwd to heads {name}", c)) < pos[("sap", "fwd", c)], (c, events)
    for c in lasts:  # after every q chunk of the kv chunk was computed
        for name in ("dk", "dv"):
            assert min(at("issue", f"bwd return {name}", c)) > pos[("sap-end", "bwd", c)], (c, events)
    for phase, into in (("fwd", "fwd to heads q"), ("bwd", "bwd to heads do")):
        for c in range(chunks - 1):
            start, end = pos[("sap", phase, c)], pos[("sap-end", phase, c)]
            assert max(at("issue", into, c + 1)) < start < end < min(at("wait", into, c + 1)), (phase, c, events)
    issues = sorted(e[1:] for e in events if e[0] == "issue")
    assert issues == sorted(e[1:] for e in events if e[0] == "wait")  # every issue waited


@pytest.mark.parametrize(("heads", "kv_heads", "chunks"), [(8, 2, 4), (16, 4, 8)])
def test_kv_goes_once_per_kv_chunk_and_dkv_returns_once(gloo_pool, heads, kv_heads, chunks):
    spec = cases.build_spec([0, 20, 70, 128], intra=2, inter=2, heads=heads, kv_heads=kv_heads, dim=8, seed=3)
    spec["head_chunks"] = chunks
    plan = cases.compile_for(spec)
    per = chunks // kv_head_chunks(chunks, plan.shape.num_kv_heads)
    assert per > 1
    for events in gloo_pool(4).run(case_event_order, spec, True, timeout=600):
        check_shared_kv_order(events, chunks, per)

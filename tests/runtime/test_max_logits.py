"""Max attention logits for qk-clip (``hsap_attn_func(..., max_logits=)``, ``runtime/max_logits.py``)
against a float64 dense reference written from scratch: per q head, the largest ``scale · q·k`` over
the pairs document-causal attention allows (a window's too), sinks excluded.

The MAX over the CP group (what megatron-core's ``clip_qk`` all-reduces) must equal the reference
on every topology, layout and head chunking, and each rank's own accumulator the maximum over the
pairs its program's compute items cover (read from the plan, scored here), on its Ulysses head
slice only: a pair computed nowhere, one skipped where it is computed (e.g. a block computed for
another rank's rows), or a head slice mapped to the wrong heads fails it. The forward's output must
not move, and the accumulator only rises (it keeps an earlier, larger value).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hsap.errors import RuntimeMismatchError
from tests.reference import positions_from_cu_seqlens
from tests.runtime import cases


def allowed_scores(spec: dict) -> torch.Tensor:
    """``[H, T', T']`` float64 scaled logits of the padded batch (its padding is one more document,
    as in ``cases.reference``), ``-inf`` where document-causal attention (and a window) forbids."""
    padded = spec["q"].shape[0]
    cu = list(spec["cu"]) + ([padded] if padded > spec["cu"][-1] else [])
    pos, doc = positions_from_cu_seqlens(cu)
    q, k = (torch.from_numpy(spec[n]).double() for n in ("q", "k"))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if spec.get("window"):
        allowed &= pos[None, :] >= pos[:, None] - spec["window"][0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * (spec["scale"] or spec["dim"] ** -0.5)
    return scores.masked_fill(~allowed, float("-inf"))


def computed_pairs(plan, inter_rank: int, padded: int) -> torch.Tensor:
    """``[T', T']`` bool: the (q token, kv token) rectangles of the forward program's compute items
    of ``inter_rank`` (the pairs it attends, before the causal / window mask)."""
    from megatron_hsap.plan.ir import Compute, Phase

    covered = torch.zeros((padded, padded), dtype=torch.bool)
    for ins in plan.program(inter_rank, Phase.FWD).instrs:
        if isinstance(ins, Compute):
            for it in ins.items:
                covered[it.q.start : it.q.stop, it.kv.start : it.kv.stop] = True
    return covered


def _spec(cu, *, sinks: bool = False, start: float | None = None, **kw) -> dict:
    spec = cases.build_spec(cu, **kw)
    spec["sinks"] = np.random.default_rng(1).normal(0.0, 3.0, spec["heads"]).astype(np.float32) if sinks else None
    spec["start"] = start  # the accumulator's value before the call (None: -inf)
    return spec


def run_max_logit_cases(specs: list[dict]) -> list[dict]:
    """On every rank: forward with a max-logit accumulator; this rank's accumulator, its MAX over
    the world, and whether the output equals the call without one."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap_attn_func

    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for spec in specs:
        plan = cases.compile_for(spec)
        _, q, k, v, _ = cases.rank_inputs(spec, plan, rank)
        sinks = torch.from_numpy(spec["sinks"]) if spec.get("sinks") is not None else None
        intra, inter = cases.make_groups(spec["intra"], spec["inter"]) if plan.cp_size > 1 else (None, None)
        kw = dict(intra_group=intra, inter_group=inter, softmax_scale=spec["scale"], sinks=sinks)
        ml = torch.full((spec["heads"],), float("-inf") if spec["start"] is None else spec["start"])
        with torch.no_grad():
            out = hsap_attn_func(q, k, v, plan, max_logits=ml, **kw)
            same = bool(torch.equal(out, hsap_attn_func(q, k, v, plan, **kw)))
        mine = ml.clone()
        if dist.is_initialized():
            dist.all_reduce(ml, op=dist.ReduceOp.MAX)
        results.append({"mine": mine.numpy(), "all": ml.numpy(), "same": same})
    return results


def _check(spec: dict, per_rank: list[dict]) -> None:
    """The MAX over ranks equals the batch's largest allowed logit per head; each rank's own
    accumulator equals the largest over the pairs its program computes, on its Ulysses head slice
    (rank ``(i, j)``: inter rank ``i``'s program, heads ``[j·H/P_intra, (j+1)·H/P_intra)``), and the
    start value elsewhere."""
    scores = allowed_scores(spec)
    start = float("-inf") if spec["start"] is None else spec["start"]
    want = scores.amax(dim=(1, 2)).clamp_min(start)
    plan = cases.compile_for(spec)
    padded, h, intra = scores.shape[1], scores.shape[0], spec["intra"]
    where = f"{spec['intra']}x{spec['inter']} cu={spec['cu']} heads={spec['heads']}/{spec['kv_heads']} layout={spec['layout']}"
    for r, res in enumerate(per_rank):
        got = torch.from_numpy(res["all"]).double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"rank {r}: {got.tolist()} != {want.tolist()} ({where})"
        assert res["same"], f"rank {r}: the output moved with max_logits ({where})"
        i, j = divmod(r, intra)
        mine = torch.full((h,), start, dtype=torch.float64)
        heads = slice(j * h // intra, (j + 1) * h // intra)
        cover = computed_pairs(plan, i, padded)
        mine[heads] = scores[heads].masked_fill(~cover, float("-inf")).amax(dim=(1, 2)).clamp_min(start)
        got_mine = torch.from_numpy(res["mine"]).double()
        assert torch.allclose(got_mine, mine, rtol=1e-5, atol=1e-5), \
            f"rank {r} (inter {i}, heads {heads.start}:{heads.stop}): {got_mine.tolist()} != {mine.tolist()} ({where})"


def _run(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(run_max_logit_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        _check(spec, [r[i] for r in results])


def _topology_specs(intra: int, inter: int, layout: str = "contiguous") -> list[dict]:
    total = 32 * intra * inter
    specs = [_spec(cu, **kw) for cu, kw in cases.topology_packings(intra, inter, layout)]
    specs.append(_spec([0, total // 3, total], intra=intra, inter=inter, seed=51, start=1.5, layout=layout))
    return specs


def test_one_rank_matches_dense_reference():
    specs = [_spec([0, 5, 5, 17, 40], inter=1, seed=1, heads=8, kv_heads=2), _spec([0, 40], inter=1, seed=2, sinks=True),
             _spec([0, 11, 40], inter=1, seed=3, window=(4, 0), heads=4, kv_heads=4, dim=12, dim_v=8),
             _spec([0, 23, 40], inter=1, seed=4, start=2.0), _spec([0, 40], inter=1, seed=5, start=50.0)]
    for spec, result in zip(specs, run_max_logit_cases(specs)):
        _check(spec, [result])


def test_tiles_cover_long_sequences_and_gathered_calls():
    """Sequences longer than one score tile in both directions (the tiling's seams and the causal
    diagonal crossing tiles) and a window that skips whole tiles: equal to the reference."""
    specs = [_spec([0, 700, 1100], inter=1, seed=6, heads=4, kv_heads=2), _spec([0, 1100], inter=1, seed=7, window=(600, 0))]
    for spec, result in zip(specs, run_max_logit_cases(specs)):
        _check(spec, [result])


@pytest.mark.parametrize("bad, what", [(torch.full((8,), 0.0, dtype=torch.float64), "float64"),
                                       (torch.full((4,), 0.0), r"shape \(4,\)"), ([0.0] * 8, "list")])
def test_bad_accumulator_raises_before_any_collective(bad, what):
    from megatron_hsap.runtime import hsap_attn_func

    spec = cases.build_spec([0, 9, 30], inter=1, seed=3)
    q, k, v = (torch.from_numpy(spec[n]) for n in ("q", "k", "v"))
    with pytest.raises(RuntimeMismatchError, match=f"max_logits .*{what}|{what}.*max_logits|max_logits must be"):
        hsap_attn_func(q, k, v, cases.compile_for(spec), max_logits=bad)


@pytest.mark.parametrize("intra, inter", [(1, 2), (1, 4), (2, 2), (4, 1)])
def test_max_logits_equal_dense_reference(gloo_pool, intra, inter):
    _run(gloo_pool, intra * inter, _topology_specs(intra, inter))


def test_head_chunks_balanced_layout_and_small_pool(gloo_pool):
    """Head chunks (each chunk's slice of the accumulator), the balanced layout and a pool small
    enough for remote blocks in several stages and gathered calls."""
    specs = [_spec([0, 40, 41, 128], intra=2, inter=2, seed=60, heads=8, kv_heads=4, dim=8, **extra)
             for extra in ({"layout": "balanced"}, {}, {"sinks": True}, {"pool_bytes": 2048})]
    specs[1]["head_chunks"] = 2
    specs[2]["head_chunks"] = 4
    _run(gloo_pool, 4, specs)


@pytest.mark.parametrize("intra, inter", [(1, 4), (2, 2)])
def test_blocks_computed_for_other_ranks_rows(gloo_pool, intra, inter):
    """The min-traffic placement sends q to its kv's rank (MHA: q is the smaller side), so blocks of
    one rank's rows are computed on another: their logits count where they are computed."""
    from megatron_hsap.plan.ir import Compute, Phase, Wire

    packings = ([0, 128], [0, 100, 128]) if intra == 1 else ([0, 100, 128], [0, 5, 128])
    specs = [_spec(cu, intra=intra, inter=inter, seed=80 + n, heads=8, kv_heads=8, dim=8) for n, cu in enumerate(packings)]
    for spec in specs:
        spec["placement"] = "min-traffic"
        plan = cases.compile_for(spec)
        remote_q = [it for r in range(inter) for ins in plan.program(r, Phase.FWD).instrs if isinstance(ins, Compute)
                    for it in ins.items if it.src(Wire.Q) is not None]
        assert remote_q, "the case must compute some rank's rows elsewhere"
    _run(gloo_pool, intra * inter, specs)


@pytest.mark.slow
@pytest.mark.parametrize("intra, inter", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_max_logits_equal_dense_reference_8_ranks(gloo_pool, intra, inter):
    _run(gloo_pool, 8, _topology_specs(intra, inter) + _topology_specs(intra, inter, "balanced")[:2])

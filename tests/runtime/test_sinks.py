"""Attention sinks (``hsap_attn_func(..., sinks=[H])``) against a float64 dense reference with a sink column.

The reference is written independently of the runtime's merge-side correction: the dense score
matrix gets one extra column holding the head's sink logit, the softmax runs over
``[scores, sink]`` and the sink column is dropped (GPT-OSS / megatron-core ``SoftmaxOne``); autograd
gives every gradient, the sink's included. So the runtime's derived sink gradient
(``-Σ_rows p_sink · rowsum(dO ∘ O)``) is checked against autograd, not against itself.

Multi-rank: every CP rank returns the sink gradient of its own rows only (no reduction), and the
test checks each rank's contribution exactly: rows of its inter chunk, heads of its Ulysses slice.
A sink merged once per partial instead of once per row fails the output check on every packing
with a document spanning chunks. Sliding-window plans (window 1 and 5) run with sinks too. Default: edge packings at P_inter 2 and 4 and the 2×2 topology;
slow: P_inter 3 and 8, every 4- and 8-rank topology, the balanced layout, bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reference import positions_from_cu_seqlens
from tests.runtime import cases

HEADS = (
    dict(heads=8, kv_heads=8, dim=8),
    dict(heads=8, kv_heads=2, dim=8),
    dict(heads=4, kv_heads=4, dim=12, dim_v=8),  # MLA shapes: d_qk != d_v
    dict(heads=8, kv_heads=1, dim=8),
)
TOKENS = {2: 64, 3: 96, 4: 128, 8: 256}


def reference_with_sinks(q, k, v, cu, scale: float, sinks, window_left: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention in float64 with a sink column (and a sliding window of
    ``window_left`` keys back); returns ``out [t, h, dv]`` and the sink column's probability
    ``p_sink [t, h]``. Differentiable w.r.t. q, k, v and sinks."""
    pos, doc = positions_from_cu_seqlens(cu)
    group = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [t, t]
    if window_left is not None:
        allowed &= pos[None, :] >= pos[:, None] - window_left
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_col = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)  # [h, t, 1]
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)  # [h, t, t+1]
    out = torch.einsum("hqk,khd->qhd", probs[..., :-1], v64)
    return out, probs[..., -1].transpose(0, 1)


def _sink_spec(cu, *, sink_kind: str = "random", learnable: bool = True, **kw) -> dict:
    spec = cases.build_spec(cu, **kw)
    h = spec["heads"]
    rng = np.random.default_rng(kw.get("seed", 0) + 1000)
    sinks = rng.normal(0.0, 2.0, h)
    if sink_kind == "large":  # near the ~1e4 logits of large_logits: sinks of the same size matter
        sinks = 1e4 + rng.integers(-3, 4, h)
    elif sink_kind == "with_inf":  # -inf = no sink for that head; +6 dominates short rows
        sinks[0], sinks[-1] = -np.inf, 6.0
    elif sink_kind == "zero":  # off-by-one
        sinks = np.zeros(h)
    spec["sinks"] = sinks.astype(np.float32)
    spec["learnable"] = learnable
    return spec


def run_sink_cases(specs: list[dict]) -> list[dict]:
    """On every rank: hsap_attn_func with sinks, forward and backward; this rank's rows and grads."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap_attn_func

    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for spec in specs:
        plan = cases.compile_for(spec)
        idx, q, k, v, do = cases.rank_inputs(spec, plan, rank)
        sinks = torch.from_numpy(spec["sinks"]).requires_grad_(spec["learnable"])
        intra, inter = cases.make_groups(spec["intra"], spec["inter"]) if plan.cp_size > 1 else (None, None)
        out = hsap_attn_func(q, k, v, plan, intra_group=intra, inter_group=inter, softmax_scale=spec["scale"], sinks=sinks)
        out.backward(do)
        results.append({**cases.rank_results(idx, out, q, k, v),
                        "dsinks": None if sinks.grad is None else sinks.grad.numpy()})
    return results


def _reference(spec: dict) -> dict:
    padded = spec["q"].shape[0]
    cu = list(spec["cu"]) + ([padded] if padded > spec["cu"][-1] else [])  # padding: one extra document
    q, k, v = (torch.from_numpy(spec[n]).double().requires_grad_(True) for n in ("q", "k", "v"))
    sinks = torch.from_numpy(spec["sinks"]).double().requires_grad_(True)
    window = spec.get("window")
    out, p_sink = reference_with_sinks(q, k, v, cu, spec["scale"] or spec["dim"] ** -0.5, sinks, window[0] if window else None)
    do = torch.from_numpy(spec["do"]).double()
    out.backward(do)
    # per-row, per-head contribution to d sink, from the reference's own probabilities
    contrib = -(p_sink * (do * out).sum(-1)).detach()  # [t, h]
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsinks": sinks.grad, "contrib": contrib}


def _check(spec: dict, per_rank: list[dict]) -> None:
    ref = _reference(spec)
    padded = spec["q"].shape[0]
    tol = spec["tolerance"]
    where = f"{spec['intra']}x{spec['inter']} cu={spec['cu']} heads={spec['heads']}/{spec['kv_heads']} {spec['dtype']}"
    for name in ("out", "dq", "dk", "dv"):
        got, want = cases.gather(per_rank, name, padded), ref[name]
        scale = max(1.0, float(want.abs().max())) if spec["dtype"] == "float32" else float(want.abs().max())
        err = float((got - want).abs().max()) / scale
        assert err <= tol, f"{name}: error {err:.3g} > {tol} ({where})"
    if not spec["learnable"]:
        assert all(r["dsinks"] is None for r in per_rank), "a fixed (off-by-one) sink must get no gradient"
        return
    # the derivation against autograd: the rows' contributions sum to autograd's d sink
    assert torch.allclose(ref["contrib"].sum(0), ref["dsinks"], rtol=1e-9, atol=1e-12)
    # each rank: only its own rows (its inter chunk) and, under Ulysses, only its head slice;
    # tolerance relative to Σ|contributions| (fp32 sums over up to a few hundred rows)
    intra, h = spec["intra"], spec["heads"]
    per = h // intra
    scale = max(1.0, float(ref["contrib"].abs().sum(0).max()))
    total = np.zeros(h)
    for rank, r in enumerate(per_rank):
        node = per_rank[(rank // intra) * intra : (rank // intra + 1) * intra]
        rows = torch.from_numpy(np.concatenate([x["idx"] for x in node]))
        heads = slice((rank % intra) * per, (rank % intra + 1) * per)
        want = torch.zeros(h, dtype=torch.float64)
        want[heads] = ref["contrib"][rows][:, heads].sum(0)
        err = float((torch.from_numpy(r["dsinks"]).double() - want).abs().max()) / scale
        assert err <= tol, f"rank {rank} d sink {r['dsinks']} != its rows' {want.numpy()} ({where})"
        total += r["dsinks"]
    err = float((torch.from_numpy(total) - ref["dsinks"]).abs().max()) / scale
    assert err <= tol, f"Σ ranks' d sink {total} != autograd {ref['dsinks'].numpy()} ({where})"


def _run(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(run_sink_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        _check(spec, [r[i] for r in results])


def _edge_specs(intra: int, inter: int, layout: str = "contiguous", dtype: str = "float32") -> list[dict]:
    world = intra * inter
    total = TOKENS.get(world, 32 * world)
    kinds = ("random", "with_inf", "zero", "random")
    specs = []
    for n, cu in enumerate(cases.special_packings(total, world).values()):  # chunks of every CP rank
        heads = dict(HEADS[n % len(HEADS)])
        if intra > 1 and heads["kv_heads"] % intra and intra % heads["kv_heads"]:
            heads = dict(HEADS[0])
        if heads["heads"] % intra:
            heads = dict(HEADS[0])
        kind = kinds[n % len(kinds)]
        specs.append(_sink_spec(cu, intra=intra, inter=inter, seed=n, layout=layout, dtype=dtype, sink_kind=kind,
                                learnable=kind != "zero", **heads))  # fmt: skip
    specs.append(_sink_spec([0, 3, total // 2 + 1, total], intra=intra, inter=inter, seed=99, layout=layout,
                            large_logits=True, sink_kind="large"))  # fmt: skip
    # sliding windows (plans carry them): a row's few keys make the sink weigh more; window 1
    for n, left in enumerate((1, 5)):
        specs.append(_sink_spec([0, 7, total // 2 + 3, total], intra=intra, inter=inter, seed=200 + n, layout=layout,
                                dtype=dtype, window=(left, 0), sink_kind="with_inf"))  # fmt: skip
    return specs


# --------------------------------------------------------------------------- single process


def test_merge_sinks_is_a_sink_column():
    """merge_sinks on (o, lse) of the keys equals the dense softmax over [scores, sink]; -inf sinks
    leave results bit-equal; a row without keys becomes (0, sink)."""
    from megatron_hsap.runtime.merge import merge_sinks

    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 3, 7, generator=g, dtype=torch.float64) * 3  # [n, h, keys]
    v = torch.randn(5, 3, 7, 4, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -float("inf"), 8.0], dtype=torch.float64)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("nhk,nhkd->nhd", torch.softmax(s, -1), v)
    out0, lse0 = out.clone(), lse.clone()
    lse[4] = float("-inf")  # row 4: no keys
    out[4] = 0
    merge_sinks(out, lse, sinks)
    p = torch.softmax(torch.cat((s, sinks[None, :, None].expand(5, 3, 1)), -1), -1)
    want = torch.einsum("nhk,nhkd->nhd", p[..., :-1], v)
    assert torch.allclose(out[:4], want[:4], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:4, 1], out0[:4, 1]) and torch.equal(lse[:4, 1], lse0[:4, 1])
    assert torch.allclose(lse[:4], torch.logsumexp(torch.cat((s, sinks[None, :, None].expand(5, 3, 1)), -1), -1)[:4])
    assert torch.equal(out[4], torch.zeros_like(out[4])) and lse[4, 0] == 0.5 and lse[4, 1] == float("-inf")


def test_sink_merged_per_partial_would_be_wrong():
    """Why the sink is merged after the last merge: merged into each of two partials of a row and
    then LSE-merged, it is counted twice and the result differs from the sink-column softmax."""
    from megatron_hsap.runtime.merge import merge_into, merge_sinks

    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 2, 6, generator=g, dtype=torch.float64)
    v = torch.randn(4, 2, 6, 3, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.3, 1.5], dtype=torch.float64)
    parts = [(torch.einsum("nhk,nhkd->nhd", torch.softmax(s[..., sl], -1), v[..., sl, :]), torch.logsumexp(s[..., sl], -1))
             for sl in (slice(0, 2), slice(2, 6))]  # fmt: skip
    p = torch.softmax(torch.cat((s, sinks[None, :, None].expand(4, 2, 1)), -1), -1)
    want = torch.einsum("nhk,nhkd->nhd", p[..., :-1], v)
    once_o, once_l = parts[0][0].clone(), parts[0][1].clone()
    merge_into(once_o, once_l, *parts[1])
    merge_sinks(once_o, once_l, sinks)
    twice = [(o.clone(), l.clone()) for o, l in parts]
    for o, l in twice:
        merge_sinks(o, l, sinks)
    merge_into(twice[0][0], twice[0][1], *twice[1])
    assert torch.allclose(once_o, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(twice[0][0], want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["random", "with_inf", "zero", "large"])
def test_single_rank_sinks_match_autograd_reference(kind):
    specs = [
        _sink_spec([0, 5, 5, 17, 40], inter=1, seed=i, sink_kind=kind, learnable=kind != "zero",
                   large_logits=kind == "large", **h)  # fmt: skip
        for i, h in enumerate(HEADS)
    ]
    for spec, result in zip(specs, run_sink_cases(specs)):
        _check(spec, [result])


def test_no_sinks_is_unchanged_and_minus_inf_sinks_equal_none():
    """sinks=None runs the sink-free path; all -inf sinks give bit-equal outputs and a zero gradient."""
    from megatron_hsap.runtime import hsap_attn_func

    spec = cases.build_spec([0, 9, 30], inter=1, seed=3)
    plan = cases.compile_for(spec)
    q, k, v = (torch.from_numpy(spec[n]) for n in ("q", "k", "v"))
    base = hsap_attn_func(q, k, v, plan)
    sinks = torch.full((8,), -float("inf"), requires_grad=True)
    out = hsap_attn_func(q, k, v, plan, sinks=sinks)
    assert torch.equal(out, base)
    out.backward(torch.from_numpy(spec["do"]))
    assert torch.equal(sinks.grad, torch.zeros(8))


@pytest.mark.parametrize(
    "bad, match",
    [(torch.zeros(7), r"sinks has shape \(7,\) but q has 8 heads"), (torch.zeros(8, dtype=torch.long), "floating-point"),
     (np.zeros(8), "must be a torch.Tensor")],  # fmt: skip
)
def test_bad_sinks_raise_before_any_collective(bad, match):
    from megatron_hsap.errors import RuntimeMismatchError
    from megatron_hsap.runtime import hsap_attn_func

    spec = cases.build_spec([0, 9, 30], inter=1, seed=3)
    q, k, v = (torch.from_numpy(spec[n]) for n in ("q", "k", "v"))
    with pytest.raises(RuntimeMismatchError, match=match):
        hsap_attn_func(q, k, v, cases.compile_for(spec), sinks=bad)


# --------------------------------------------------------------------------- multi-rank


@pytest.mark.parametrize("intra, inter", [(1, 2), (1, 4), (2, 2)])
def test_sinks_edge_packings(gloo_pool, intra, inter):
    _run(gloo_pool, intra * inter, _edge_specs(intra, inter))


@pytest.mark.slow
@pytest.mark.parametrize("intra, inter", [(1, 3), (1, 8), (4, 1), (2, 4), (4, 2), (8, 1)])
def test_sinks_edge_packings_all_topologies(gloo_pool, intra, inter):
    _run(gloo_pool, intra * inter, _edge_specs(intra, inter))


@pytest.mark.slow
@pytest.mark.parametrize("intra, inter", [(1, 4), (2, 2), (2, 4)])
def test_sinks_balanced_layout_bf16(gloo_pool, intra, inter):
    specs = _edge_specs(intra, inter, layout="balanced")[:4] + _edge_specs(intra, inter, dtype="bfloat16")[:3]
    _run(gloo_pool, intra * inter, specs)

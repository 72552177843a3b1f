"""Attention dropout (``hsap_attn_func(..., dropout_p=p)``, ``runtime/dropout.py``) against a float64
dense reference that applies the same mask.

The ``cpu`` kernel keys its mask on global coordinates (seed, q head, q token, k token), so a
distributed run must equal one dense attention whose probabilities are multiplied by that mask
and ``1/(1-p)`` — written here from scratch over the whole padded batch; autograd gives every
gradient. That checks the plumbing a mask depends on (each call's global tokens, each Ulysses
slice's and head chunk's global heads, the forward's mask redrawn by its backward) on every
topology, and that dropout commutes with the LSE merges, sinks and windows. The GPU kernels draw
their masks per call and the executor hands each backward call its forward call's rng state:
``test_backward_gets_its_forward_calls_rng_state`` checks that hand-over with a recording kernel,
``test_phases_group_blocks_into_the_same_calls`` the plan property it relies on (the recorded
kernel signatures' plumbing: ``test_kernel_signatures.py``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime.dropout import keep_mask
from tests.reference import positions_from_cu_seqlens
from tests.runtime import cases

P = 0.3
SEED = 987654321987


def reference_with_dropout(q, k, v, cu, scale: float, p: float, seed: int, window_left: int | None = None,
                           sinks=None) -> torch.Tensor:
    """Document-causal attention in float64 over the whole batch, each probability kept by
    ``keep_mask(seed, p, head, q token, k token)`` and scaled by ``1/(1-p)`` (a sink column, when
    given, only joins the softmax's normaliser). Differentiable w.r.t. q, k, v (and sinks)."""
    pos, doc = positions_from_cu_seqlens(cu)
    t, h = q.shape[:2]
    group = h // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window_left is not None:
        allowed &= pos[None, :] >= pos[:, None] - window_left
    scores = (torch.einsum("qhd,khd->hqk", q.double(), k64) * scale).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None, None].expand(-1, t, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :t]
    keep = keep_mask(seed, p, torch.arange(h), torch.arange(t), torch.arange(t)).double() / (1 - p)
    return torch.einsum("hqk,khd->qhd", probs * keep, v64)


def _spec(cu, *, p: float = P, seed: int = SEED, sinks: bool = False, **kw) -> dict:
    spec = cases.build_spec(cu, **kw)
    spec.update(p=p, dseed=seed)
    if sinks:
        spec["sinks"] = np.random.default_rng(kw.get("seed", 0)).normal(0.0, 2.0, spec["heads"]).astype(np.float32)
    return spec


def run_dropout_cases(specs: list[dict]) -> list[dict]:
    """On every rank: forward and backward with dropout; this rank's rows and gradients."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap_attn_func

    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for spec in specs:
        plan = cases.compile_for(spec)
        idx, q, k, v, do = cases.rank_inputs(spec, plan, rank)
        sinks = torch.from_numpy(spec["sinks"]).requires_grad_(True) if spec.get("sinks") is not None else None
        intra, inter = cases.make_groups(spec["intra"], spec["inter"]) if plan.cp_size > 1 else (None, None)
        out = hsap_attn_func(q, k, v, plan, intra_group=intra, inter_group=inter, softmax_scale=spec["scale"],
                             sinks=sinks, dropout_p=spec["p"], dropout_seed=spec["dseed"])  # fmt: skip
        out.backward(do)
        results.append({**cases.rank_results(idx, out, q, k, v), "dsinks": None if sinks is None else sinks.grad.numpy()})
    return results


def _check(spec: dict, per_rank: list[dict]) -> None:
    padded = spec["q"].shape[0]
    cu = list(spec["cu"]) + ([padded] if padded > spec["cu"][-1] else [])
    q, k, v = (torch.from_numpy(spec[n]).double().requires_grad_(True) for n in ("q", "k", "v"))
    sinks = torch.from_numpy(spec["sinks"]).double().requires_grad_(True) if spec.get("sinks") is not None else None
    window = spec.get("window")
    out = reference_with_dropout(q, k, v, cu, spec["scale"] or spec["dim"] ** -0.5, spec["p"], spec["dseed"],
                                 window[0] if window else None, sinks)  # fmt: skip
    out.backward(torch.from_numpy(spec["do"]).double())
    where = f"{spec['intra']}x{spec['inter']} cu={spec['cu']} heads={spec['heads']}/{spec['kv_heads']} p={spec['p']}"
    for name, want in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = cases.gather(per_rank, name, padded)
        err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert err <= spec["tolerance"], f"{name}: error {err:.3g} > {spec['tolerance']} ({where})"
    if sinks is not None:  # each rank holds its rows' part of d sink: their sum is autograd's
        total = sum(torch.from_numpy(r["dsinks"]).double() for r in per_rank)
        err = float((total - sinks.grad).abs().max()) / max(1.0, float(sinks.grad.abs().max()))
        assert err <= spec["tolerance"], f"d sinks: error {err:.3g} ({where})"


def _run(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(run_dropout_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        _check(spec, [r[i] for r in results])


def _topology_specs(intra: int, inter: int, layout: str = "contiguous") -> list[dict]:
    total = 32 * intra * inter
    specs = [_spec(cu, **kw) for cu, kw in cases.topology_packings(intra, inter, layout)]
    specs.append(_spec([0, total // 3, total], intra=intra, inter=inter, seed=51, p=0.9, layout=layout))
    return specs


# --------------------------------------------------------------------------- the mask


def test_keep_mask_keeps_one_minus_p_independently():
    """Over 2^20 coordinates the kept fraction is 1-p (within 5 σ), and masks of neighbouring
    heads, rows, columns and seeds are uncorrelated (a hash that ignored one coordinate would
    correlate them completely)."""
    heads, rows, cols = torch.arange(16), torch.arange(256), torch.arange(256)
    for p in (0.1, 0.5, 0.9):
        m = keep_mask(SEED, p, heads, rows, cols).double()
        n = m.numel()
        assert abs(m.mean().item() - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5, (p, m.mean())
        other = keep_mask(SEED + 1, p, heads, rows, cols).double()
        shifted = {"head": (m[1:], m[:-1]), "row": (m[:, 1:], m[:, :-1]), "col": (m[..., 1:], m[..., :-1]), "seed": (m, other)}
        for what, (a, b) in shifted.items():
            corr = torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1].item()
            assert abs(corr) < 0.01, f"masks of neighbouring {what}s correlate: {corr:.3g} (p={p})"
    assert keep_mask(SEED, 0.0, heads, rows, cols).all()
    # a pure function of the coordinates: any subset of rows and columns, in any order
    sub = keep_mask(SEED, 0.5, heads[3:5], rows[[9, 2]], cols[[200, 0, 17]])
    assert torch.equal(sub, keep_mask(SEED, 0.5, heads, rows, cols)[3:5][:, [9, 2]][:, :, [200, 0, 17]])


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("shape", [dict(heads=8, kv_heads=2, dim=8), dict(heads=4, kv_heads=4, dim=12, dim_v=8)])
def test_one_rank_matches_dense_reference(shape):
    specs = [_spec([0, 5, 5, 17, 40], inter=1, seed=1, **shape), _spec([0, 40], inter=1, seed=2, sinks=True, **shape),
             _spec([0, 11, 40], inter=1, seed=3, window=(4, 0), **shape), _spec([0, 23, 40], inter=1, seed=4, p=0.9, **shape)]
    for spec, result in zip(specs, run_dropout_cases(specs)):
        _check(spec, [result])


def test_zero_p_is_the_dropout_free_path_and_masks_change_the_result():
    from megatron_hsap.runtime import hsap_attn_func

    spec = cases.build_spec([0, 9, 30], inter=1, seed=3)
    plan = cases.compile_for(spec)
    q, k, v = (torch.from_numpy(spec[n]) for n in ("q", "k", "v"))
    base = hsap_attn_func(q, k, v, plan)
    assert torch.equal(hsap_attn_func(q, k, v, plan, dropout_p=0.0), base)
    a = hsap_attn_func(q, k, v, plan, dropout_p=0.5, dropout_seed=1)
    assert torch.equal(a, hsap_attn_func(q, k, v, plan, dropout_p=0.5, dropout_seed=1))  # same seed: same masks
    assert not torch.allclose(a, base) and not torch.allclose(a, hsap_attn_func(q, k, v, plan, dropout_p=0.5, dropout_seed=2))
    torch.manual_seed(0)  # no seed: drawn from the default generator, so a reset generator repeats it
    b = hsap_attn_func(q, k, v, plan, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(b, hsap_attn_func(q, k, v, plan, dropout_p=0.5))


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, "half", float("nan")])
def test_bad_dropout_p_raises_before_any_collective(bad):
    from megatron_hsap.runtime import hsap_attn_func

    spec = cases.build_spec([0, 9, 30], inter=1, seed=3)
    q, k, v = (torch.from_numpy(spec[n]) for n in ("q", "k", "v"))
    with pytest.raises(ConfigError, match="dropout_p="):
        hsap_attn_func(q, k, v, cases.compile_for(spec), dropout_p=bad)


def test_phases_group_blocks_into_the_same_calls():
    """The GPU kernels' masks are redrawn per call, so each backward call must cover exactly the
    blocks of one forward call (``CallStates.get`` refuses otherwise): on plans with gathered and
    fused calls, remote blocks, windows and several stages, every rank's two phases make the same
    calls."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.calls import program_calls
    from megatron_hsap.plan.ir import Phase

    rng = np.random.default_rng(7)
    calls = gathered = 0
    for inter, kw in itertools.product((4, 8), ({}, {"window_size": (300, 0)}, {"layout": "balanced"})):
        for cu in ([0, 2048], [0, 1500, 2048], cases.random_packing(2048, rng)):
            # a small pool and no flattening: many stages, remote blocks and gathered calls
            plan = compile_plan(cu, inter, num_heads=8, num_kv_heads=2, head_dim=64, pool_bytes=1 << 16, flatten="never", **kw)
            for r in range(plan.inter_size):
                made = {ph: [c for st in program_calls(plan.program(r, ph), plan.layout.segments[r]) for c in st]
                        for ph in (Phase.FWD, Phase.BWD)}  # fmt: skip
                keys = {ph: [(c.gathered, c.blocks) for c in made[ph]] for ph in made}
                assert sorted(keys[Phase.FWD]) == sorted(keys[Phase.BWD]), (cu, inter, kw, r)
                assert len(set(keys[Phase.FWD])) == len(keys[Phase.FWD])
                calls += len(made[Phase.FWD])
                gathered += sum(c.gathered for c in made[Phase.FWD])
    assert calls > 3000 and gathered > 50, (calls, gathered)


# --------------------------------------------------------------------------- multi-rank


def record_rng_hand_over(specs: list[dict]) -> list[dict]:
    """``run_dropout_cases`` with the executor's kernels wrapped: each forward call returns a fresh
    token as its rng state and records what it computed; each backward call checks that the token
    it gets names a forward call over the same rows and keys."""
    from megatron_hsap.runtime import executor as ex_mod

    made: dict[int, tuple] = {}
    counter = itertools.count()
    real_fwd, real_bwd = ex_mod.attn_forward_dropout, ex_mod.attn_backward

    def fwd(q, k, v, **kw):
        out, lse, _ = real_fwd(q, k, v, **kw)
        token = next(counter)
        made[token] = (kw["q_pos"].tolist(), kw["k_pos"].tolist(), kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist())
        return out, lse, ("token", token)

    def bwd(*args, **kw):
        tag, token = kw["rng_state"]
        got = (kw["q_pos"].tolist(), kw["k_pos"].tolist(), kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist())
        assert tag == "token" and made.pop(token) == got, "a backward call got another call's rng state"
        kw["rng_state"] = None
        return real_bwd(*args, **kw)

    ex_mod.attn_forward_dropout, ex_mod.attn_backward = fwd, bwd
    try:
        out = run_dropout_cases(specs)
    finally:
        ex_mod.attn_forward_dropout, ex_mod.attn_backward = real_fwd, real_bwd
    assert not made, f"{len(made)} forward calls' states were never used by a backward call"
    return out


@pytest.mark.parametrize("intra, inter", [(1, 2), (1, 4), (2, 2), (4, 1)])
def test_dropout_equals_dense_reference(gloo_pool, intra, inter):
    _run(gloo_pool, intra * inter, _topology_specs(intra, inter))


def test_head_chunks_and_balanced_layout(gloo_pool):
    specs = [_spec([0, 40, 41, 128], intra=2, inter=2, seed=60, heads=8, kv_heads=4, dim=8, **extra)
             for extra in ({"layout": "balanced"}, {}, {"sinks": True})]
    specs[1]["head_chunks"] = 2
    specs[2]["head_chunks"] = 4
    _run(gloo_pool, 4, specs)


def test_backward_gets_its_forward_calls_rng_state(gloo_pool):
    specs = [_spec(cu, intra=1, inter=4, seed=70 + n, heads=8, kv_heads=2, dim=8, pool_bytes=4096)
             for n, cu in enumerate(([0, 128], [0, 5, 60, 61, 128], [0, 100, 128]))]
    results = gloo_pool(4).run(record_rng_hand_over, specs, timeout=900)
    for i, spec in enumerate(specs):
        _check(spec, [r[i] for r in results])


@pytest.mark.slow
@pytest.mark.parametrize("intra, inter", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_dropout_equals_dense_reference_8_ranks(gloo_pool, intra, inter):
    _run(gloo_pool, 8, _topology_specs(intra, inter) + _topology_specs(intra, inter, "balanced")[:2])

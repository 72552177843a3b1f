"""Sliding-window attention end to end (issue 15 items 1 and 5) against the float64 reference.

The CPU kernel's banded path is checked against a dense band mask written here from the
flash-attn convention (query ``r`` of lengths ``(lq, lk)`` sees key ``j`` iff
``r + lk - lq - left <= j <= r + lk - lq + right``), independently of ``plan/window.py``.
Multi-rank: plans compiled with ``window_size=(left, 0)`` run through ``hsap_attn_func`` on gloo
ranks; out, dq, dk, dv are compared with ``tests/reference.py`` under the same window
(tolerances from ``cases.TOLERANCE``), and the executor's P2P bytes with the plan's. Windows:
0 and 1, smaller than, equal to and larger than the documents and the chunks. Default: P_inter 2
and 4 and the 2×2 topology; slow: every 4- and 8-rank topology and P_inter 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hsap.runtime import cpu_attention
from tests.runtime import cases


def _band_reference(q, k, v, lq, lk, causal, window, scale):
    """Dense softmax over the band (float64, autograd)."""
    left, right = window
    qpos = torch.cat([torch.arange(a) + b - a for a, b in zip(lq, lk)])
    kpos = torch.cat([torch.arange(b) for b in lk])
    qdoc = torch.cat([torch.full((a,), i) for i, a in enumerate(lq)])
    kdoc = torch.cat([torch.full((b,), i) for i, b in enumerate(lk)])
    diff = kpos[None, :] - qpos[:, None]
    allowed = qdoc[:, None] == kdoc[None, :]
    if causal:
        allowed &= diff <= 0
    if right >= 0:
        allowed &= diff <= right
    if left >= 0:
        allowed &= diff >= -left
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    has = allowed.any(1)
    s = torch.where(has[None, :, None], s, torch.zeros_like(s))
    p = torch.softmax(s, -1) * allowed[None]
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1))


def test_cpu_kernel_banded_matches_dense_band():
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for trial in range(16):  # small tiles make many tiny calls: a few cases cover every band edge
        n = int(rng.integers(1, 4))
        causal = bool(rng.integers(0, 2))
        lq = [int(x) for x in rng.integers(1, 40, n)]
        lk = [a + int(rng.integers(0, 30)) for a in lq] if causal else [int(x) for x in rng.integers(1, 40, n)]
        window = (int(rng.choice([-1, 0, 1, 3, 10, 50])), int(rng.choice([-1, 0]) if causal else rng.choice([-1, 0, 2, 30])))
        q = torch.randn(sum(lq), 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        k = torch.randn(sum(lk), 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        v = torch.randn(sum(lk), 2, 6, dtype=torch.float64, generator=gen, requires_grad=True)
        cq = torch.tensor(np.concatenate(([0], np.cumsum(lq))))
        ck = torch.tensor(np.concatenate(([0], np.cumsum(lk))))
        # small tiles: the band crosses many tile edges
        o, lse = cpu_attention.varlen_forward(q, k, v, cq, ck, causal=causal, softmax_scale=0.3, window=window,
                                              block_q=7, block_k=5)
        ref = _band_reference(q, k, v, lq, lk, causal, window, 0.3)
        torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)  # float64 both: only summation order differs
        do = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
        ref.backward(do)
        dq, dk, dv = cpu_attention.varlen_backward(do, q.detach(), k.detach(), v.detach(), lse, (do * o).sum(-1),
                                                   cq, ck, causal=causal, softmax_scale=0.3, window=window,
                                                   block_q=7, block_k=5)
        for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"trial {trial}: {m}")


def test_cpu_kernel_skips_tiles_outside_the_window(monkeypatch):
    """Work per block: a long sequence with a short window computes only the tiles that meet the
    band (counted score tiles), never the T × T square."""
    calls = []
    real = torch.bmm

    def counting(a, b, *args, **kw):
        calls.append(a.shape[1] * b.shape[2])
        return real(a, b, *args, **kw)

    t = 2048
    q = torch.randn(t, 1, 8)
    cu = torch.tensor([0, t])
    monkeypatch.setattr(cpu_attention.torch, "bmm", counting)
    cpu_attention.varlen_forward(q, q, q, cu, cu, causal=True, softmax_scale=1.0, window=(16, 0), block_q=64, block_k=64)
    # each 64-row tile meets at most two 64-key tiles: scores for <= 2·64·64 pairs per row tile
    assert sum(calls) <= (t // 64) * 2 * 64 * 64 < t * t // 8


def _specs(world: int, topologies, layouts=("contiguous",), per=None) -> list[dict]:
    total = {2: 64, 3: 96, 4: 128, 8: 256}[world]
    specs = []
    n = 0
    for intra, inter in topologies:
        chunk = total // inter
        packings = list(cases.special_packings(total, max(inter, 2)).items())  # (parts=1 has no chunk edges)
        windows = [0, 1, 5, chunk - 1, chunk, chunk + 7, total // 2, total]
        for i, ((label, cu), left) in enumerate(zip(packings * 2, windows)):
            if per is not None and i >= per:
                break
            kv = (8, 2, 1)[n % 3] if intra <= 2 or n % 3 != 1 else 8
            layout = layouts[n % len(layouts)]
            specs.append(cases.build_spec(cu, intra=intra, inter=inter, heads=8, kv_heads=kv, dim=8, seed=n,
                                          layout=layout, window=(left, 0)))
            n += 1
    return specs


def _check(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(cases.run_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in results]
        plan = cases.compile_for(spec)
        assert plan.options.window_size == tuple(spec["window"])
        plan.verify()
        cases.check_against_reference(spec, per_rank)
        cases.check_bytes(spec, per_rank)


@pytest.mark.parametrize("world,topologies", [(2, [(1, 2)]), (4, [(1, 4), (2, 2)])])
def test_window_exact_fast_subset(gloo_pool, world, topologies):
    _check(gloo_pool, world, _specs(world, topologies, layouts=("contiguous", "balanced"), per=5))


def test_window_reference_differs_from_full_causal():
    """The windowed reference must not equal the full one on these batches (else the multi-rank
    tests could not tell a dropped window from an applied one)."""
    spec = cases.build_spec([0, 5, 64], inter=2, heads=8, kv_heads=8, dim=8, window=(5, 0))
    full = dict(spec, window=None)
    assert float((cases.reference(spec)["out"] - cases.reference(full)["out"]).abs().max()) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("world,topologies", [(2, [(1, 2)]), (3, [(1, 3)]), (4, [(1, 4), (2, 2), (4, 1)]),
                                              (8, [(1, 8), (2, 4), (4, 2), (8, 1)])])
def test_window_exact_full_matrix(gloo_pool, world, topologies):
    specs = _specs(world, topologies, layouts=("contiguous", "balanced"))
    for start in range(0, len(specs), 8):
        _check(gloo_pool, world, specs[start:start + 8])

"""``merge_into`` against float64 logsumexp of concatenated key blocks, large logits, empty rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.runtime.merge import merge_into
from tests.reference import reference_attention

NEG_INF = float("-inf")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: intra-op threads only add contention on a shared CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _merge_all(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype=torch.float32):
    n, h, dv = parts[0][0].shape
    out = torch.zeros((n, h, dv), dtype=dtype)
    lse = torch.full((n, h), NEG_INF, dtype=dtype)
    for o, l in parts:
        merge_into(out, lse, o, l)
    return out, lse


def _exact(parts):
    """Float64 definition: lse = logsumexp over blocks; out = Σ e^{lse_b - lse} out_b."""
    lses = torch.stack([l.double() for _, l in parts])  # [B, n, h]
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lses - safe)  # 0 where a block is empty
    out = sum(w[i].unsqueeze(-1) * o.double() for i, (o, _) in enumerate(parts))
    return out, lse


def test_merging_key_blocks_equals_attention_over_all_keys():
    # Partial attention of the same queries over 3 disjoint key blocks (one fully masked for
    # some rows) merged in fp32 must equal attention over the concatenated keys.
    g = torch.Generator().manual_seed(0)
    tq, tk, h, d, dv = 12, 30, 4, 8, 6
    q = torch.randn(tq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, h, dv, generator=g, dtype=torch.float64)
    q_pos = torch.arange(tq) * 2  # causal by position: early rows see few keys
    k_pos = torch.arange(tk)
    doc_q, doc_k = torch.zeros(tq, dtype=torch.long), torch.zeros(tk, dtype=torch.long)
    full_out, full_lse = reference_attention(q, k, v, q_pos, k_pos, doc_q, doc_k, 0.4)
    parts = []
    for a, b in ((0, 7), (7, 19), (19, 30)):
        o, l = reference_attention(q, k[a:b], v[a:b], q_pos, k_pos[a:b], doc_q, doc_k[a:b], 0.4)
        parts.append((o.float(), l.float()))
    assert torch.isinf(parts[2][1]).any()  # some rows see nothing of the last block
    out, lse = _merge_all(parts)
    # fp32 inputs and math: a few ulps of values O(1-10).
    torch.testing.assert_close(out.double(), full_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), full_lse, rtol=0, atol=1e-5)


def test_huge_logits_do_not_overflow():
    g = torch.Generator().manual_seed(1)
    n, h, dv = 64, 4, 8
    parts = []
    for shift in (1e4, 1e4 + 3.0, -1e4, 9.99e3):
        lse = shift + torch.randn(n, h, generator=g)
        parts.append((torch.randn(n, h, dv, generator=g), lse.float()))
    out, lse = _merge_all(parts)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = _exact(parts)
    # fp32 at |lse| ~ 1e4 has ulp ~1e-3; weights exp(Δ) inherit that absolute error.
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=4e-3)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=2e-2)


def test_large_logits_from_scaled_queries():
    # Real attention with scores ~1e4 (q scaled up): merged result is finite and exact.
    g = torch.Generator().manual_seed(2)
    tq, tk, h, d = 8, 16, 2, 4
    q = 300.0 * torch.randn(tq, h, d, generator=g, dtype=torch.float64)
    k = 10.0 * torch.randn(tk, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, h, 3, generator=g, dtype=torch.float64)
    pos_q, pos_k = torch.full((tq,), tk), torch.arange(tk)
    dq, dk = torch.zeros(tq, dtype=torch.long), torch.zeros(tk, dtype=torch.long)
    full_out, full_lse = reference_attention(q, k, v, pos_q, pos_k, dq, dk, 1.0)
    assert full_lse.abs().max() > 1e3
    parts = []
    for a, b in ((0, 5), (5, 16)):
        o, l = reference_attention(q, k[a:b], v[a:b], pos_q, pos_k[a:b], dq, dk[a:b], 1.0)
        parts.append((o.float(), l.float()))
    out, lse = _merge_all(parts)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # |lse| up to ~1e4 in fp32: relative 1e-7 of it; outputs are convex mixes of |v| <= 4.
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out.double(), full_out, rtol=0, atol=1e-4)


def test_empty_rows_stay_empty_without_nan():
    n, h, dv = 3, 2, 4
    out = torch.zeros(n, h, dv)
    lse = torch.full((n, h), NEG_INF)
    part = torch.zeros(n, h, dv)
    merge_into(out, lse, part, torch.full((n, h), NEG_INF))  # both sides empty
    assert torch.isneginf(lse).all() and (out == 0).all()

    vals = torch.randn(n, h, dv)
    lse_part = torch.tensor([[0.5, NEG_INF], [NEG_INF, NEG_INF], [-2.0, 7.0]])
    merge_into(out, lse, vals, lse_part)  # one side empty: the other is taken exactly
    has = torch.isfinite(lse_part)
    assert torch.equal(lse[has], lse_part[has]) and torch.isneginf(lse[~has]).all()
    assert torch.equal(out[has], vals[has]) and (out[~has] == 0).all()

    merge_into(out, lse, torch.full((n, h, dv), 5.0), torch.full((n, h), NEG_INF))  # empty part
    assert torch.equal(out[has], vals[has]) and not torch.isnan(out).any()


def test_part_is_not_modified_and_bf16_part_accepted():
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5, 2, 4, generator=g)
    lse = torch.randn(5, 2, generator=g)
    part = torch.randn(5, 2, 4, generator=g)
    part_copy = part.clone()
    merge_into(out, lse, part, torch.randn(5, 2, generator=g))
    assert torch.equal(part, part_copy)
    merge_into(out, lse, part.bfloat16(), torch.randn(5, 2, generator=g))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(1, 5),
    n=st.integers(1, 9),
    scale=st.sampled_from([1.0, 30.0, 3e3]),
    empty_frac=st.floats(0.0, 0.7),
    seed=st.integers(0, 2**16),
)
def test_merge_matches_float64_definition(blocks, n, scale, empty_frac, seed):
    g = torch.Generator().manual_seed(seed)
    h, dv = 3, 5
    parts = []
    for _ in range(blocks):
        lse = scale * torch.randn(n, h, generator=g)
        lse[torch.rand(n, h, generator=g) < empty_frac] = NEG_INF
        o = torch.randn(n, h, dv, generator=g)
        o[torch.isinf(lse)] = 0.0  # kernels return 0 for rows that saw no key
        parts.append((o, lse))
    out, lse = _merge_all(parts)
    ref_out, ref_lse = _exact(parts)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    # fp32: lse error ~ ulp(|lse|) (scale up to 3e3 → ~3e-4); out error ~ that × |out| ≤ ~4.
    tol = max(1e-5, 4 * scale * 2.0**-23 * math.sqrt(blocks))
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=0, atol=tol * 10)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=tol * 100)

"""qk-clip's one-launch Triton max-logit pass (``runtime/fused_max_logits.py``), run by Triton's
interpreter on CPU tensors, against the eager tiles (``max_logits.varlen_max_logits``) and a float64
dense reference written here; and through an executor that takes it (as on CUDA)."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_hsap.runtime.env import EnvSettings
from megatron_hsap.runtime.max_logits import use_fused_max_logits, varlen_max_logits
from tests.runtime.interpreted import interpreted

_MOD = "megatron_hsap.runtime.fused_max_logits"


@pytest.fixture(scope="module")
def fml():
    """The kernel module under Triton's interpreter (``tests/runtime/interpreted.py``)."""
    yield from interpreted(_MOD, "_max_logits_kernel")


def _dense(q, k, lqs, lks, causal, window, scale):
    """``[h]`` float64: the largest ``scale · q·k`` per head over each sequence's visible pairs
    (flash-attn's convention: query ``i`` sits at key ``i + lk - lq`` and sees keys ``[that - left,
    that + right]``, causal capping the right at 0)."""
    h = q.shape[1]
    k = k.double().repeat_interleave(h // k.shape[1], 1)
    best = torch.full((h,), float("-inf"), dtype=torch.float64)
    q0 = k0 = 0
    for lq, lk in zip(lqs, lks):
        if lq and lk:
            s = torch.einsum("qhd,khd->hqk", q[q0 : q0 + lq].double(), k[k0 : k0 + lk]) * scale
            diff = torch.arange(lk)[None, :] - torch.arange(lq)[:, None]
            ok = torch.ones(lq, lk, dtype=torch.bool)
            if causal:
                ok &= diff <= lk - lq
            if window[1] >= 0:
                ok &= diff <= lk - lq + window[1]
            if window[0] >= 0:
                ok &= diff >= lk - lq - window[0]
            best = torch.maximum(best, s.masked_fill(~ok, float("-inf")).amax(dim=(1, 2)))
        q0, k0 = q0 + lq, k0 + lk
    return best


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


@settings(max_examples=12, deadline=None)
@example(seqs=[(20, 90)], causal=False, left=30, right=75, shape=(4, 2, 12), bf16=False, seed=1)  # a windowed rectangle
@example(seqs=[(70, 40), (0, 5)], causal=True, left=-1, right=-1, shape=(4, 1, 8), bf16=False, seed=2)  # rows seeing no key
@example(seqs=[(130, 130)], causal=True, left=7, right=0, shape=(2, 2, 24), bf16=True, seed=3)  # a causal window over 3 tiles
@given(seqs=st.lists(st.tuples(st.integers(0, 130), st.integers(0, 130)), min_size=1, max_size=3),
       causal=st.booleans(), left=st.sampled_from([-1, 0, 7, 100]), right=st.sampled_from([-1, 0, 5, 90]),
       shape=st.sampled_from([(4, 2, 12), (2, 2, 24), (4, 1, 8)]), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_equals_eager_and_dense(fml, seqs, causal, left, right, shape, bf16, seed):
    """Random varlen calls (empty sequences, q longer or shorter than kv, tiles crossing the
    diagonal and the window's edges, head sizes that are no power of two, GQA); windows as
    ``plan/window.kernel_window`` gives them: a windowed rectangle's right edge lies past 0."""
    if causal and right > 0:
        right = 0  # (a causal call's window ends at the diagonal)
    lqs, lks = [s[0] for s in seqs], [s[1] for s in seqs]
    h, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    q = torch.randn(sum(lqs), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lks), hkv, d, generator=g).to(dtype)
    window, scale = (left, right), d**-0.5
    got = fml.fused_varlen_max_logits(q, k, _cu(lqs), _cu(lks), max(lqs), causal=causal, softmax_scale=scale, window=window)
    eager = varlen_max_logits(q, k, tuple(lqs), tuple(lks), causal=causal, softmax_scale=scale, window=window)
    want = _dense(q, k, lqs, lks, causal, window, scale)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    fin = torch.isfinite(want)
    assert torch.allclose(got.double()[fin], want[fin], rtol=1e-5, atol=1e-5), (got, want)
    assert torch.allclose(got[fin], eager[fin], rtol=1e-5, atol=1e-5), (got, eager)


def test_executor_takes_the_kernel_where_it_would_on_cuda(fml, monkeypatch):
    """An executor told to fuse (as ``use_fused_max_logits`` tells a CUDA one) calls the kernel for
    every forward call and ends with the eager pass's maxima."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime.executor import Executor

    plan = compile_plan([0, 40, 41, 200, 256], 1, num_heads=4, num_kv_heads=2, head_dim=16, dtype_bytes=4, window_size=(60, 0))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(256, h, 16, generator=g) for h in (4, 2, 2))
    ex = Executor(plan, None, "cpu", backend="cpu")
    eager = torch.full((4,), float("-inf"))
    ex.forward(q, k, v, 0.25, eager)
    calls = []
    real = fml.fused_varlen_max_logits
    monkeypatch.setattr(fml, "fused_varlen_max_logits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ex.fused_max = True
    fused = torch.full((4,), float("-inf"))
    ex.forward(q, k, v, 0.25, fused)
    assert len(calls) == ex.stats["fwd"].kernel_calls // 2 > 0  # (two forwards counted)
    assert torch.allclose(fused, eager, rtol=1e-6, atol=1e-6) and torch.isfinite(eager).all()


def test_the_kernel_is_chosen_on_cuda_with_triton_only():
    on = EnvSettings()
    assert not use_fused_max_logits(torch.device("cpu"), on)
    assert use_fused_max_logits(torch.device("cuda", 0), on) == (importlib.util.find_spec("triton") is not None)
    off = EnvSettings(fused_merge=False)
    assert not use_fused_max_logits(torch.device("cuda", 0), off)

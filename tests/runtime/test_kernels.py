"""Attention kernels against the float64 dense-mask reference (``tests/reference.py``).

Every backend available on this machine is checked (only ``cpu`` without a GPU; on a GPU
machine the CUDA backends join in bf16). Tolerances are relative to ``max(1, |ref|max)``:
* float64: 1e-10 — same math as the reference up to summation order;
* float32: 1e-5 — unit roundoff 6e-8 times sums over ≤ a few hundred keys plus the online-
  softmax rescaling stays well under 1e-6; 1e-5 leaves margin without hiding a masking bug
  (a wrong mask moves outputs by O(0.1));
* bf16: 2e-2 — outputs are rounded to bf16 (2^-9 relative) and GPU kernels run P·V in bf16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.runtime import cpu_attention, kernels
from megatron_hsap.runtime.env import ENV_VARS, EnvSettings, read_env
from megatron_hsap.runtime.kernels import (
    attn_backward,
    attn_forward,
    available_backends,
    resolve_backend,
)
from megatron_hsap.runtime.merge import merge_into
from tests.reference import reference_attention, reference_varlen

# why these: the kernels and the float64 reference sum in different orders and the LSE merge
# rescales by exp(lse_a - lse); relative to max|ref|, fp64 rounding (2^-53 ≈ 1.1e-16) over ~1e3
# terms stays ≪ 1e-10; fp32 (2^-24 ≈ 6e-8) over a few hundred keys and one merge stays < 1e-5;
# bf16 rounds q, k, v and the output (2^-8 ≈ 3.9e-3 each), a few roundings ≈ 1e-2 < 2e-2
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = [(dev, name) for dev in DEVICES for name in available_backends(dev)]
# lengths (lq, lk) per sequence: equal, zero queries, 1×1, lq < lk, lq > lk, zero keys
LENS_Q = [5, 0, 1, 17, 9, 3]
LENS_K = [5, 3, 1, 30, 4, 0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small tiles gain nothing from intra-op threads, and on a shared, oversubscribed CPU the
    # OpenMP barriers of 2 threads made the long-document test 20× slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cu(lens, device="cpu"):
    offsets = [0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()]
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _inputs(lens_q, lens_k, h, hkv, d, dv, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(tq, h, dv, generator=g, dtype=torch.float64)
    return [x.to(device) for x in (q, k, v, dout)]


def _close(actual, expected, dtype, what):
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    err = (actual.double().cpu() - expected.cpu()).abs().max().item() if expected.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]} × {scale:.3g}"


def _close_lse(actual, expected, dtype, what):
    a, e = actual.double().cpu(), expected.detach().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), f"{what}: -inf rows differ"
    fin = torch.isfinite(e)
    _close(a[fin], e[fin], dtype, what)


def _check(device, backend, dtype, causal, h, hkv, d, dv, scale, lens_q=LENS_Q, lens_k=LENS_K):
    """Forward and backward of one backend against the reference and its autograd."""
    if backend != "cpu" and dtype != torch.bfloat16:
        pytest.skip("GPU kernels take fp16/bf16 only")
    q, k, v, dout = _inputs(lens_q, lens_k, h, hkv, d, dv, 0, device)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k), causal=causal, softmax_scale=scale,
              backend=backend)  # fmt: skip
    out, lse = attn_forward(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], h, dv)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    cu_lists = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    ref_out, ref_lse = reference_varlen(*leaves, *cu_lists, causal, scale)
    _close(out, ref_out.detach(), dtype, "out")
    _close_lse(lse, ref_lse, dtype, "lse")

    ref_out.backward(dout.double().cpu())
    grads = attn_backward(dout, q, k, v, out, lse, **kw)
    for got, leaf, name in zip(grads, leaves, ("dq", "dk", "dv")):
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), name
        _close(got, leaf.grad, dtype, name)


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "rect"])
@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_matches_reference(device, backend, causal, h, hkv, dtype):
    _check(device, backend, dtype, causal, h, hkv, d=16, dv=16, scale=0.37)


@pytest.mark.parametrize("device,backend", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mla_head_sizes(device, backend, dtype):
    # MLA-shaped: d_qk 192 / d_v 128 in production; small stand-ins with d != dv, d % 8 != 0.
    _check(device, backend, dtype, True, 4, 2, d=24, dv=16, scale=24**-0.5)
    _check(device, backend, dtype, False, 4, 4, d=12, dv=20, scale=0.5)


@pytest.mark.parametrize("device,backend", CASES)
def test_large_softmax_scale(device, backend):
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    _check(device, backend, dtype, True, 2, 1, d=8, dv=8, scale=4.0)  # peaked softmax


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
    heads=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3)]),
    dims=st.sampled_from([(8, 8), (4, 12), (16, 8)]),
    causal=st.booleans(),
    blocks=st.tuples(st.integers(1, 24), st.integers(1, 24)),
    seed=st.integers(0, 2**16),
)
def test_cpu_tiles_match_reference(lens, heads, dims, causal, blocks, seed):
    """Random shapes and tile sizes straight through ``cpu_attention`` in float64."""
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    (h, hkv), (d, dv), (bq, bk) = heads, dims, blocks
    q, k, v, dout = _inputs(lens_q, lens_k, h, hkv, d, dv, seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    tile = dict(causal=causal, softmax_scale=0.3, block_q=bq, block_k=bk)
    out, lse = cpu_attention.varlen_forward(q, k, v, cu_q, cu_k, **tile)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_varlen(*leaves, cu_q.tolist(), cu_k.tolist(), causal, 0.3)
    _close(out, ref_out.detach(), torch.float64, "out")
    _close_lse(lse, ref_lse, torch.float64, "lse")
    ref_out.backward(dout)
    delta = (dout * out).sum(-1)
    grads = cpu_attention.varlen_backward(dout, q, k, v, lse, delta, cu_q, cu_k, **tile)
    for got, leaf, name in zip(grads, leaves, ("dq", "dk", "dv")):
        _close(got, leaf.grad, torch.float64, name)


@pytest.mark.parametrize("device,backend", CASES)
def test_kv_split_partials_merge_and_sum_to_full(device, backend):
    """How the executor uses the kernels: the tail rows of each document attend a rectangle
    of early keys and a bottom-right causal block of later keys; forward parts merged with
    ``merge_into`` equal full attention, and backward partials (given the final out/lse) sum
    to the full gradients."""
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    # (document length n, first query row s, split t <= s): rows [s, n) attend keys [0, t)
    # as a rectangle and keys [t, n) causally with lq = n - s <= lk = n - t (bottom-right).
    docs = [(40, 25, 10), (7, 3, 3), (1, 0, 0), (30, 29, 5)]
    h, hkv, d, dv, scale = 4, 2, 16, 8, 0.25
    g = torch.Generator().manual_seed(5)
    lens = [n for n, _, _ in docs]
    tokens = sum(lens)
    q_all = torch.randn(tokens, h, d, generator=g, dtype=torch.float64)
    k_all = torch.randn(tokens, hkv, d, generator=g, dtype=torch.float64)
    v_all = torch.randn(tokens, hkv, dv, generator=g, dtype=torch.float64)
    starts = _cu(lens).tolist()
    rows = torch.cat([torch.arange(b + s, b + n) for (n, s, _), b in zip(docs, starts)])
    keys_a = torch.cat([torch.arange(b, b + t) for (_, _, t), b in zip(docs, starts)])
    keys_b = torch.cat([torch.arange(b + t, b + n) for (n, _, t), b in zip(docs, starts)])
    cu_rows = _cu([n - s for n, s, _ in docs], device)
    cu_a, cu_b = _cu([t for *_, t in docs], device), _cu([n - t for n, _, t in docs], device)

    q, k, v = (x.to(dtype).to(device) for x in (q_all[rows], k_all, v_all))
    max_q = max(n - s for n, s, _ in docs)
    common = dict(cu_seqlens_q=cu_rows, max_seqlen_q=max_q, softmax_scale=scale, backend=backend)
    max_a, max_b = max(t for *_, t in docs), max(n - t for n, _, t in docs)
    part_a = dict(cu_seqlens_k=cu_a, max_seqlen_k=max_a, causal=False, **common)
    part_b = dict(cu_seqlens_k=cu_b, max_seqlen_k=max_b, causal=True, **common)
    o_a, l_a = attn_forward(q, k[keys_a], v[keys_a], **part_a)
    o_b, l_b = attn_forward(q, k[keys_b], v[keys_b], **part_b)
    out = torch.zeros(o_a.shape, dtype=torch.float32, device=device)
    lse = torch.full(l_a.shape, float("-inf"), dtype=torch.float32, device=device)
    merge_into(out, lse, o_a, l_a.float())
    merge_into(out, lse, o_b, l_b.float())

    # Reference: the tail rows against all tokens, document-causal by position.
    leaves = [x.to(dtype).double().requires_grad_() for x in (q_all, k_all, v_all)]
    pos = torch.cat([torch.arange(n) for n in lens])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    ref_out, ref_lse = reference_attention(
        leaves[0][rows], leaves[1], leaves[2], pos[rows], pos, doc[rows], doc, scale
    )
    _close(out, ref_out.detach(), dtype, "merged out")
    _close_lse(lse, ref_lse, dtype, "merged lse")

    dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    ref_out.backward(dout)
    dout = dout.to(dtype).to(device)
    out_final = out.to(dtype)
    delta = (dout.float() * out_final.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    dk = torch.zeros(k_all.shape, dtype=torch.float32, device=device)
    dvv = torch.zeros(v_all.shape, dtype=torch.float32, device=device)
    for keys, part in ((keys_a, part_a), (keys_b, part_b)):
        grads = attn_backward(dout, q, k[keys], v[keys], out_final, lse, delta=delta, **part)
        dq += grads[0]  # the executor's accumulation of partial gradients
        dk.index_add_(0, keys.to(device), grads[1])
        dvv.index_add_(0, keys.to(device), grads[2])
    _close(dq, leaves[0].grad[rows], dtype, "dq")
    _close(dk, leaves[1].grad, dtype, "dk")
    _close(dvv, leaves[2].grad, dtype, "dv")


class _SizeGuard(TorchDispatchMode):
    """Records the largest tensor any op produces, and the largest matmul output."""

    MATMULS = {"bmm", "baddbmm", "mm", "addmm", "matmul", "addbmm"}

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_matmul = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        biggest = max(sizes, default=0)
        self.largest = max(self.largest, biggest)
        if func.overloadpacket.__name__.rstrip("_") in self.MATMULS:
            self.largest_matmul = max(self.largest_matmul, biggest)
        return result


def test_long_document_is_tiled_and_memory_bounded():
    """One 5000-token causal document with tiny tiles: no op output is larger than an input-
    sized tensor (a per-document n×n is 25M elements per head; a row strip 64×5000×h), every
    matmul output is one tile, and sampled rows plus all kv gradients match the reference."""
    n, h, hkv, d, dv, bq, bk = 5000, 2, 1, 16, 8, 64, 256
    lens = [n]
    q, k, v, dout = _inputs(lens, lens, h, hkv, d, dv, seed=9)
    q, k, v = q.float(), k.float(), v.float()
    sample = torch.cat([torch.arange(0, 40), torch.arange(2500, 2540), torch.arange(n - 40, n)])
    dout_sparse = torch.zeros(n, h, dv)
    dout_sparse[sample] = dout[sample].float()  # other rows: zero dout, so zero contribution
    cu = _cu(lens)
    tile = dict(causal=True, softmax_scale=0.25, block_q=bq, block_k=bk)
    guard = _SizeGuard()
    with guard:
        out, lse = cpu_attention.varlen_forward(q, k, v, cu, cu, **tile)
        delta = (dout_sparse * out).sum(-1)
        grads = cpu_attention.varlen_backward(dout_sparse, q, k, v, lse, delta, cu, cu, **tile)
    dq, dk, dvv = grads
    assert guard.largest <= n * h * d, guard.largest  # nothing bigger than q itself
    assert guard.largest_matmul <= hkv * (h // hkv) * bq * bk, guard.largest_matmul

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    pos = torch.arange(n)
    zeros = torch.zeros(n, dtype=torch.long)
    ref_out, ref_lse = reference_attention(
        leaves[0][sample], leaves[1], leaves[2], pos[sample], pos, zeros[sample], zeros, 0.25
    )
    _close(out[sample], ref_out.detach(), torch.float32, "out")
    _close_lse(lse[sample], ref_lse, torch.float32, "lse")
    ref_out.backward(dout_sparse[sample].double())
    _close(dq[sample], leaves[0].grad[sample], torch.float32, "dq")
    assert (dq[~torch.isin(pos, sample)] == 0).all()
    _close(dk, leaves[1].grad, torch.float32, "dk")
    _close(dvv, leaves[2].grad, torch.float32, "dv")


@pytest.mark.parametrize("device,backend", CASES)
def test_empty_inputs(device, backend):
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    for tq, tk, lq, lk in ((0, 6, [0, 0], [2, 4]), (5, 0, [2, 3], [0, 0])):
        q = torch.randn(tq, 4, 8, dtype=dtype, device=device)
        k = torch.randn(tk, 2, 8, dtype=dtype, device=device)
        v = torch.randn(tk, 2, 8, dtype=dtype, device=device)
        kw = dict(cu_seqlens_q=_cu(lq, device), cu_seqlens_k=_cu(lk, device),
                  max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=True, softmax_scale=0.3,
                  backend=backend)  # fmt: skip
        out, lse = attn_forward(q, k, v, **kw)
        assert out.shape == (tq, 4, 8) and (out == 0).all() and torch.isneginf(lse).all()
        grads = attn_backward(torch.ones_like(out), q, k, v, out, lse, **kw)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert all((g == 0).all() for g in grads)


def test_shape_errors_are_batch_errors():
    q, k = torch.randn(4, 3, 8), torch.randn(4, 2, 8)
    cu = _cu([4])
    with pytest.raises(BatchError, match="multiple of kv heads"):
        attn_forward(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
                     causal=True, softmax_scale=1.0, backend="cpu")  # fmt: skip
    with pytest.raises(BatchError, match="cu_seqlens"):
        attn_forward(k, k, k, cu_seqlens_q=cu, cu_seqlens_k=_cu([2, 2]), max_seqlen_q=4,
                     max_seqlen_k=2, causal=True, softmax_scale=1.0, backend="cpu")  # fmt: skip


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("HSAP_ATTN_BACKEND", raising=False)
    assert available_backends("cpu") == ["cpu"]
    assert resolve_backend(None, "cpu") == "cpu"
    assert resolve_backend("auto", "cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"unknown .* 'flash'.*available on cpu: \['cpu'\]"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ConfigError, match="'flash_attn' .*cannot run on cpu.*CUDA"):
        resolve_backend("flash_attn", "cpu")
    monkeypatch.setenv("HSAP_ATTN_BACKEND", "te")
    with pytest.raises(ConfigError, match="from HSAP_ATTN_BACKEND"):
        resolve_backend(None, "cpu")
    assert resolve_backend("cpu", "cpu") == "cpu"  # the argument wins over the environment
    monkeypatch.setenv("HSAP_ATTN_BACKEND", "CPU")
    assert resolve_backend(None, "cpu") == "cpu"


def test_read_env_parses_and_rejects_bad_values():
    assert read_env({}) == EnvSettings(attn_backend=None, p2p_timeout_s=300.0, debug=False)
    env = read_env({"HSAP_ATTN_BACKEND": " Flash_Attn ", "HSAP_P2P_TIMEOUT_S": "2.5",
                    "HSAP_DEBUG": "yes"})  # fmt: skip
    assert env == EnvSettings(attn_backend="flash_attn", p2p_timeout_s=2.5, debug=True)
    with pytest.raises(ConfigError, match="HSAP_P2P_TIMEOUT_S='soon'"):
        read_env({"HSAP_P2P_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match=r"HSAP_P2P_TIMEOUT_S='0' must be a finite number of seconds in \(0, "):
        read_env({"HSAP_P2P_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="HSAP_DEBUG='maybe'"):
        read_env({"HSAP_DEBUG": "maybe"})
    assert {v.name for v in ENV_VARS} == {"HSAP_ATTN_BACKEND", "HSAP_P2P_TIMEOUT_S", "HSAP_DEBUG", "HSAP_FUSED_MERGE"}


def test_torch_cuda_adapter_call_shapes_on_meta():
    """Without a GPU, the meta kernels of aten._flash_attention_forward/_backward still check
    that the adapter's call matches the op schema and handles the [h, tq] LSE and padding."""
    kernels._LSE_LAYOUT.pop("torch_cuda", None)
    m = dict(dtype=torch.bfloat16, device="meta")
    q, k, v = torch.empty(10, 4, 20, **m), torch.empty(12, 2, 20, **m), torch.empty(12, 2, 12, **m)
    cu_q = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse, state = kernels._torch_forward(q, k, v, cu_q, cu_q, 6, 6, True, 0.2)
    assert state is None
    assert out.shape == (10, 4, 12) and lse.shape == (10, 4) and lse.dtype == torch.float32
    assert kernels._LSE_LAYOUT["torch_cuda"] == "ht"
    dq, dk, dv = kernels._torch_backward(out, q, k, v, out, lse, cu_q, cu_q, 6, 6, True, 0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # with dropout: the op's philox seed and offset come back and go into the backward call
    out, lse, state = kernels._torch_forward(q, k, v, cu_q, cu_q, 6, 6, True, 0.2, dropout_p=0.1)
    assert isinstance(state, tuple) and len(state) == 2
    dq, dk, dv = kernels._torch_backward(out, q, k, v, out, lse, cu_q, cu_q, 6, 6, True, 0.2, dropout_p=0.1, rng_state=state)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# The flash-attn and Transformer Engine adapters against the recorded signatures of real
# releases (fake modules with those signatures): tests/runtime/test_kernel_signatures.py.

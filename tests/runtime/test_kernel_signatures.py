"""The kernel adapters' argument binding against the *recorded* signatures of real releases.

Transformer Engine 1.13 / 2.14 / 2.18 / 2.20.2 and flash-attn 2.5.9 / 2.6.3 / 2.7.4 / 2.8.3
(``tests/fixtures/kernel_signatures``). Each fake function has exactly the recorded signature
and emulates what the C++ side does with what it is given: it refuses a layout or format other
than packed THD — TE ≥ 2.15 shapes O and dQKV from ``o_format`` / ``dqkv_layout`` (``sbhd`` by
default), so an adapter that leaves them at their defaults fails here — checks dtypes, masks
and head sizes, and computes with the float64 reference (``tests/reference.py``). The adapter's
outputs are then compared with the reference, so a wrong LSE layout, a dropped +inf row or a
misbound argument fails. Tolerances as in ``test_kernels``: float64 inputs, the LSE in float32
(the kernels' own LSE dtype) -> 1e-5 of max(1, |ref|).
"""

from __future__ import annotations

import enum
import sys
import types
import warnings

import pytest
import torch

from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime import kernel_signatures, kernels
from megatron_hsap.runtime.kernel_signatures import TE_THD_FORMATS, bind, te_support_reason
from tests.fixtures.signatures import VERSIONS, fake_callable, load
from tests.reference import reference_varlen, varlen_positions

LENS_Q = [5, 0, 1, 17, 9, 3]  # as test_kernels: equal, no queries, 1×1, lq < lk, lq > lk, no keys
LENS_K = [5, 3, 1, 30, 4, 0]
TOL = 1e-5
_DROPOUT_P = 0.25  # the probability the dropout plumbing tests pass (the fakes compute without it)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(h, hkv, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(LENS_Q), sum(LENS_K)
    shapes = ((tq, h, d), (tk, hkv, d), (tk, hkv, dv), (tq, h, dv))
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _close(actual, expected, what):
    scale = max(1.0, expected.abs().max().item())
    err = (actual.double() - expected).abs().max().item()
    assert err <= TOL * scale, f"{what}: max error {err:.3g} > {TOL} × {scale:.3g}"


def _dense_backward(dout, q, k, v, out, lse_th, cu_q, cu_k, causal, scale):
    """Dense float64 gradients given an LSE ``[tq, h]`` (+inf rows give P = 0), GQA folded."""
    q_pos, k_pos, q_doc, k_doc = varlen_positions(cu_q.tolist(), cu_k.tolist(), causal)
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    allowed = (q_doc[:, None] == k_doc[None]) & (k_pos[None] <= q_pos[:, None])
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    p = torch.exp(s - lse_th.t()[:, :, None]) * allowed
    dvv = torch.einsum("hqk,qhd->khd", p, dout)
    ds = p * (torch.einsum("qhd,khd->hqk", dout, vv) - (dout * out).sum(-1).t()[:, :, None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    fold = lambda x: x.reshape(x.shape[0], -1, g, x.shape[-1]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dvv)


def _check_adapter(forward, backward, causal, h=4, hkv=2, d=12, dv=6, scale=0.4):
    """Forward and backward through an adapter vs the reference (GQA, d != dv, d % 8 != 0)."""
    q, k, v, dout = _inputs(h, hkv, d, dv, seed=3)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K), causal, scale)
    out, lse, state = forward(q, k, v, *args)
    assert state is None  # no dropout: no rng state to carry
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_varlen(*leaves, cu_q.tolist(), cu_k.tolist(), causal, scale)
    _close(out, ref_out.detach(), "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys must be -inf"
    fin = torch.isfinite(ref_lse)
    _close(lse[fin], ref_lse.detach()[fin], "lse")
    ref_out.backward(dout)
    grads = backward(dout, q, k, v, out, lse, *args)
    for got, leaf, name in zip(grads, leaves, ("dq", "dk", "dv")):
        _close(got, leaf.grad, name)


def _check_dropout_plumbing(forward, backward):
    """With dropout the adapter passes ``p`` to both kernels and hands the forward's rng state to
    the backward (the fakes assert it comes back); without a state the backward refuses."""
    q, k, v, dout = _inputs(4, 2, 8, 8, seed=5)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K), True, 0.4)
    out, lse, state = forward(q, k, v, *args, (-1, -1), _DROPOUT_P)
    assert state is not None
    backward(dout, q, k, v, out, lse, *args, (-1, -1), _DROPOUT_P, state)


# ----------------------------------------------------------------------------- Transformer Engine
_TE_DTYPE = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float64: "kFloat64"}
_BACKENDS = {"F16_arbitrary_seqlen": "F16_arbitrary_seqlen", "FP8": "FP8", "No_Backend": "No_Backend"}


def _v(version: str) -> tuple[int, int]:
    return tuple(int(p) for p in version.split(".")[:2])  # type: ignore[return-value]


def _expect_thd_call(a: dict, backward: bool, backends) -> None:
    """What the C++ side needs from a THD call, given the complete (defaulted) arguments."""
    assert a["qkv_layout"] == "thd_thd_thd", a["qkv_layout"]
    if "o_format" in a:  # TE >= 2.15: O is shaped from o_format, default "sbhd"
        assert a["o_format"] == "thd", f"o_format={a['o_format']!r}: O would be shaped as that layout"
    if backward and "do_format" in a:
        assert a["do_format"] == "thd" and a["dqkv_layout"] == "thd_thd_thd", (a["do_format"], a["dqkv_layout"])
    dtype = a["q"].dtype
    if "qkv_dtype" in a:  # TE 1.x: the TE enum
        assert a["qkv_dtype"] == _TE_DTYPE[dtype]
    if "fake_dtype" in a:  # TE 2.x: the torch dtype
        assert a["fake_dtype"] is dtype
    if backward and "dqkv_dtype" in a:  # TE <= 2.14
        assert a["dqkv_dtype"] == _TE_DTYPE[dtype]
    assert a["fused_attention_backend"] == backends["F16_arbitrary_seqlen"] and a["attn_bias_type"] == "no_bias"
    assert a["dropout"] in (0.0, _DROPOUT_P) and not a.get("return_max_logit", False)
    causal = a["attn_mask_type"] == "padding_causal_bottom_right"
    assert causal or a["attn_mask_type"] == "padding", a["attn_mask_type"]
    assert tuple(a["window_size"]) == ((-1, 0) if causal else (-1, -1))
    if a.get("bottom_right_diagonal") is not None:
        assert a["bottom_right_diagonal"] is causal
    for x in (a["q"], a["k"], a["v"]):
        assert x.is_contiguous() and x.shape[-1] % 8 == 0, x.shape  # cuDNN: head sizes of 8
    assert a["cu_seqlens_q"].dtype == torch.int32 and a["cu_seqlens_q_padded"] is a["cu_seqlens_q"]


def _fake_te(version: str, stats_layout: str) -> types.ModuleType:
    """``fused_attn`` of one recorded release; Stats ``[tq, h, 1]`` ("th1", newer cuDNN) or
    ``[b, h, max_q, 1]`` ("bhs1", older cuDNN); cuDNN leaves rows without keys unspecified."""
    sigs = load("te", version)
    # a dict of the pybind enum until 2.19, an IntEnum from 2.20 (looked up by name either way)
    backends = _BACKENDS if _v(version) < (2, 20) else enum.IntEnum("FusedAttnBackend", ["No_Backend", "F16_arbitrary_seqlen", "FP8"])

    def fwd(a):
        _expect_thd_call(a, backward=False, backends=backends)
        causal = a["attn_mask_type"] != "padding"
        q, k, v, cu_q, cu_k = a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_kv"]
        out, lse = reference_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal, a["attn_scale"])
        out = out.masked_fill(torch.isneginf(lse)[..., None], 7.0)  # garbage where no key
        lse = lse.masked_fill(torch.isneginf(lse), -3.0).float()
        if stats_layout == "th1":
            stats = lse[..., None]
        else:
            stats = torch.zeros(cu_q.numel() - 1, q.shape[1], a["max_seqlen_q"], 1)
            for i, (s, e) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
                stats[i, :, : e - s, 0] = lse[s:e].t()
        rng = torch.tensor([a["dropout"] * 1000, 7], dtype=torch.int64)  # (a stand-in philox seed/offset)
        return out.to(q.dtype), [stats, rng]

    def bwd(a):
        _expect_thd_call(a, backward=True, backends=backends)
        stats, rng = a["aux_ctx_tensors"]
        assert rng.dtype == torch.int64 and rng.numel() == 2
        if a["dropout"] > 0:  # the forward's state comes back: the mask is redrawn
            assert rng.tolist() == [a["dropout"] * 1000, 7], rng
        cu_q = a["cu_seqlens_q"]
        if stats_layout == "th1":
            assert stats.shape == (a["q"].shape[0], a["q"].shape[1], 1), stats.shape
            lse = stats[..., 0]
        else:
            assert stats.shape[:3] == (cu_q.numel() - 1, a["q"].shape[1], a["max_seqlen_q"])
            bounds = zip(cu_q.tolist(), cu_q.tolist()[1:])
            lse = torch.cat([stats[i, :, : e - s, 0].t() for i, (s, e) in enumerate(bounds)])
        assert a["o"].shape[-1] == a["d_o"].shape[-1] == a["v"].shape[-1]
        causal = a["attn_mask_type"] != "padding"
        grads = _dense_backward(a["d_o"], a["q"], a["k"], a["v"], a["o"], lse.double(), cu_q,
                                a["cu_seqlens_kv"], causal, a["attn_scale"])  # fmt: skip
        return [*grads, None]  # TE returns dbias (and dsoftmax_offset) after dq, dk, dv

    mod = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    mod.fused_attn_fwd = fake_callable(sigs["fused_attn_fwd"], fwd)
    mod.fused_attn_bwd = fake_callable(sigs["fused_attn_bwd"], bwd)
    mod.FusedAttnBackend = backends
    mod.QKVLayout = {"thd_thd_thd": 0, "sbh3d": 1}
    mod.AttnMaskType = {"padding": 0, "padding_causal": 1, "padding_causal_bottom_right": 2}
    if _v(version) >= (2, 20):  # tables looked up by name must keep working if they turn into enums
        mod.QKVLayout = enum.IntEnum("QKVLayout", ["sbh3d", "thd_thd_thd"])
        mod.AttnMaskType = enum.IntEnum("AttnMaskType", ["padding", "padding_causal", "padding_causal_bottom_right"])
    return mod


@pytest.fixture
def install_te(monkeypatch):
    def install(mod):
        consts = types.ModuleType("transformer_engine.pytorch.constants")
        consts.TE_DType = _TE_DTYPE
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cpp_extensions.fused_attn", mod)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.constants", consts)
        kernels._import_te.cache_clear()
        kernels._LSE_LAYOUT.pop("te", None)

    yield install
    kernels._import_te.cache_clear()
    kernels._LSE_LAYOUT.pop("te", None)
    kernels._unavailable_reason.cache_clear()


@pytest.mark.parametrize("stats_layout", ["th1", "bhs1"])
@pytest.mark.parametrize("version", VERSIONS["te"])
def test_te_adapter_on_recorded_signatures(install_te, version, stats_layout):
    install_te(_fake_te(version, stats_layout))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every optional parameter is vetted
        for causal in (True, False):
            _check_adapter(kernels._te_forward, kernels._te_backward, causal)
            kernels._LSE_LAYOUT.pop("te")  # backward before any forward: the probe learns it
            _check_adapter(kernels._te_forward, kernels._te_backward, causal)
        _check_dropout_plumbing(kernels._te_forward, kernels._te_backward)


@pytest.mark.parametrize("version", VERSIONS["te"])
def test_te_binding_per_release(install_te, version):
    """Exactly the names each release takes: THD formats from 2.15, ``dqkv_dtype`` until 2.14,
    ``qkv_dtype`` in 1.x; every parameter that is not vetted at its default is passed."""
    mod = _fake_te(version, "th1")
    install_te(mod)
    x = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = _cu([4])
    values = kernels._te_values(x, x, x, cu, cu, 4, 4, True, 0.5)
    values.update(o=x, d_o=x, aux_ctx_tensors=[])
    fwd = bind(mod.fused_attn_fwd, values, "fwd", vetted=kernel_signatures.TE_VETTED_DEFAULTS)
    bwd = bind(mod.fused_attn_bwd, values, "bwd", vetted=kernel_signatures.TE_VETTED_DEFAULTS)
    major_minor = _v(version)
    assert fwd["qkv_layout"] == bwd["qkv_layout"] == "thd_thd_thd"
    if major_minor >= (2, 15):
        assert fwd["o_format"] == bwd["o_format"] == bwd["do_format"] == "thd"
        assert bwd["dqkv_layout"] == "thd_thd_thd" and "dqkv_dtype" not in bwd
    else:
        assert not {"o_format", "do_format", "dqkv_layout"} & (fwd.keys() | bwd.keys())
        assert bwd["dqkv_dtype"] == "kBFloat16"
    if major_minor >= (2, 0):
        assert fwd["fake_dtype"] is torch.bfloat16 and "qkv_dtype" not in fwd
    else:
        assert fwd["qkv_dtype"] == "kBFloat16" and "fake_dtype" not in fwd
    assert fwd["attn_mask_type"] == "padding_causal_bottom_right" and fwd["window_size"] == (-1, 0)
    for fn, bound in ((mod.fused_attn_fwd, fwd), (mod.fused_attn_bwd, bwd)):
        names = {n for n, _ in kernel_signatures.parameters(fn)}
        assert names - bound.keys() <= kernel_signatures.TE_VETTED_DEFAULTS


def test_te_2_18_formats_are_what_the_fake_refuses_without(install_te):
    """The fake is not lenient: the 2.18 call without the THD formats (the pre-fix adapter) fails."""
    mod = _fake_te("2.18", "th1")
    install_te(mod)
    x = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = _cu([4])
    values = {k: v for k, v in kernels._te_values(x, x, x, cu, cu, 4, 4, True, 0.5).items()
              if k not in TE_THD_FORMATS or k == "qkv_layout"}  # fmt: skip
    with pytest.raises(AssertionError, match="o_format='sbhd'"):
        mod.fused_attn_fwd(**bind(mod.fused_attn_fwd, values, "fwd", vetted=kernel_signatures.TE_VETTED_DEFAULTS | TE_THD_FORMATS.keys()))


def test_unvetted_optional_parameter_warns_and_unknown_required_fails():
    params = load("te", "2.18")["fused_attn_fwd"]
    newer = fake_callable([*params, ("lse_format", "'sbhd'")], lambda a: a)
    x = torch.zeros(1)
    values = dict.fromkeys((n for n, d in params if d is None), x)
    known = frozenset(n for n, _ in params)  # everything 2.18 has counts as vetted here
    with pytest.warns(RuntimeWarning, match=r"\['lse_format'\].*gpu_check"):
        kwargs = bind(newer, values, "te-next fused_attn_fwd", vetted=known)
    assert "lse_format" not in kwargs  # left at its default, loudly
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        bind(newer, values, "te-next fused_attn_fwd (vetted)", vetted=known | {"lse_format"})
    required = fake_callable([*params[:3], ("brand_new", None)], lambda a: a)
    with pytest.raises(ConfigError, match="required parameter 'brand_new'.*HSAP_ATTN_BACKEND"):
        bind(required, values, "te-next fused_attn_fwd")


def test_te_support_reason_names_the_version_to_install():
    assert te_support_reason(_fake_te("2.18", "th1")) is None
    assert te_support_reason(_fake_te("2.20.2", "th1")) is None  # its tables as enums, by name
    old = _fake_te("1.13", "th1")
    old.AttnMaskType = {"padding": 0, "padding_causal": 1}  # TE < 1.9
    assert ">= 1.9" in te_support_reason(old)
    del old.fused_attn_bwd
    assert "no fused_attn_bwd" in te_support_reason(old)


@pytest.fixture
def fake_cuda(monkeypatch):
    """resolve_backend's view of a CUDA machine (an SM90 GPU) on this CPU-only one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("HSAP_ATTN_BACKEND", raising=False)
    kernels._unavailable_reason.cache_clear()
    yield
    kernels._unavailable_reason.cache_clear()


def test_start_up_message_when_a_requested_backend_cannot_load(fake_cuda, install_te, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    kernels._import_flash_attn.cache_clear()
    with pytest.raises(ConfigError, match=r"'flash_attn' \(from argument\).*import failed.*--no-build-isolation"):
        kernels.resolve_backend("flash_attn", "cuda")
    old = _fake_te("1.13", "th1")
    old.AttnMaskType = {"padding": 0}
    install_te(old)
    kernels._unavailable_reason.cache_clear()
    monkeypatch.setenv("HSAP_ATTN_BACKEND", "te")
    with pytest.raises(ConfigError, match=r"'te' \(from HSAP_ATTN_BACKEND\).*>= 1.9"):
        kernels.resolve_backend(None, "cuda")
    install_te(_fake_te("2.18", "th1"))
    kernels._unavailable_reason.cache_clear()
    assert kernels.resolve_backend(None, "cuda") == "te"
    monkeypatch.delenv("HSAP_ATTN_BACKEND")
    assert kernels.resolve_backend(None, "cuda") == "te"  # auto: flash-attn missing -> TE
    kernels._import_flash_attn.cache_clear()


# ----------------------------------------------------------------------------- flash-attn
def _fa_conventions(version: str) -> tuple[int, str]:
    """(forward tuple length, LSE layout) of a release, from its source: <= 2.6 returns
    ``(out, q, k, v, out_padded, lse, S_dmask, rng_state)``, >= 2.7 ``(out, lse, S_dmask,
    rng_state)``; varlen LSE ``[b, h, max_q]`` before 2.6, ``[h, total_q]`` from 2.6."""
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    return (8 if major_minor < (2, 7) else 4), ("bhs" if major_minor < (2, 6) else "ht")


def _fake_flash_attn(version: str) -> types.ModuleType:
    sigs = load("flash_attn", version)
    n_out, layout = _fa_conventions(version)

    def common(a):
        q, k, v = a["q"], a["k"], a["v"]
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0  # FA2: one size
        assert a["cu_seqlens_q"].dtype == a["cu_seqlens_k"].dtype == torch.int32
        assert a["dropout_p"] in (0.0, _DROPOUT_P) and a["alibi_slopes"] is None and a.get("softcap", 0.0) == 0.0
        window = a["window_size"] if "window_size" in a else (a["window_size_left"], a["window_size_right"])
        assert tuple(window) == (-1, -1)

    def fwd(a):
        common(a)
        assert not a["return_softmax"] and a["block_table"] is None
        cu_q = a["cu_seqlens_q"]
        out, lse = reference_varlen(a["q"], a["k"], a["v"], cu_q.tolist(), a["cu_seqlens_k"].tolist(),
                                    a["causal"], a["softmax_scale"])  # fmt: skip
        lse = lse.masked_fill(torch.isneginf(lse), float("inf")).float()  # FA's mark: +inf
        if layout == "ht":
            raw = lse.t().contiguous()
        else:
            raw = torch.zeros(cu_q.numel() - 1, a["q"].shape[1], a["max_seqlen_q"])
            for i, (s, e) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
                raw[i, :, : e - s] = lse[s:e].t()
        out = out.to(a["q"].dtype)
        rng = torch.tensor([int(a["dropout_p"] * 1000), 3]) if a["dropout_p"] > 0 else None  # FA: (seed, offset)
        return (out, raw, None, rng) if n_out == 4 else (out, a["q"], a["k"], a["v"], out, raw, None, rng)

    def bwd(a):
        common(a)
        if a["dropout_p"] > 0:
            assert a["rng_state"].tolist() == [int(a["dropout_p"] * 1000), 3], a["rng_state"]
        raw, cu_q = a["softmax_lse"], a["cu_seqlens_q"]
        if layout == "ht":
            lse = raw.t()
        else:
            lse = torch.cat([raw[i, :, : e - s].t() for i, (s, e) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:]))])
        grads = _dense_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], lse.double(), cu_q,
                                a["cu_seqlens_k"], a["causal"], a["softmax_scale"])  # fmt: skip
        for buf, grad in zip((a["dq"], a["dk"], a["dv"]), grads):
            buf.copy_(grad)  # in place, like FA2

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_varlen_forward = fake_callable(sigs["_flash_attn_varlen_forward"], fwd)
    mod._flash_attn_varlen_backward = fake_callable(sigs["_flash_attn_varlen_backward"], bwd)
    return mod


@pytest.fixture
def install_flash_attn(monkeypatch):
    def install(mod):
        pkg = types.ModuleType("flash_attn")
        pkg.flash_attn_interface = mod
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
        kernels._import_flash_attn.cache_clear()
        kernels._LSE_LAYOUT.pop("flash_attn", None)

    yield install
    kernels._import_flash_attn.cache_clear()
    kernels._LSE_LAYOUT.pop("flash_attn", None)


@pytest.mark.parametrize("version", VERSIONS["flash_attn"])
def test_flash_attn_adapter_on_recorded_signatures(install_flash_attn, version):
    """Argument binding, tuple shape, LSE layout, +inf rows, head-size padding and GQA of the
    flash-attn glue, per recorded release."""
    install_flash_attn(_fake_flash_attn(version))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for causal in (True, False):
            _check_adapter(kernels._fa_forward, kernels._fa_backward, causal)
            kernels._LSE_LAYOUT.pop("flash_attn")
            _check_adapter(kernels._fa_forward, kernels._fa_backward, causal)
        _check_dropout_plumbing(kernels._fa_forward, kernels._fa_backward)
    assert kernels._LSE_LAYOUT["flash_attn"] == _fa_conventions(version)[1]


def test_flash_attn_unknown_required_parameter_fails_loudly(install_flash_attn):
    params = load("flash_attn", "2.8.3")["_flash_attn_varlen_forward"]
    mod = types.ModuleType("flash_attn.flash_attn_interface")
    required = [n for n, d in params if d is None]  # brand_new_flag goes after them (no default)
    mod._flash_attn_varlen_forward = fake_callable(
        [*params[: len(required)], ("brand_new_flag", None), *params[len(required) :]], lambda a: None
    )
    mod._flash_attn_varlen_backward = mod._flash_attn_varlen_forward
    install_flash_attn(mod)
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    cu = _cu([4])
    with pytest.raises(ConfigError, match="brand_new_flag"):
        kernels._fa_forward(q, q, q, cu, cu, 4, 4, True, 1.0)

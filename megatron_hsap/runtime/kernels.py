"""The one kernel-adapter module: varlen attention forward/backward over four backends.

Every difference between kernels (argument names and tuple shapes across flash-attn
versions, LSE layouts, head-size padding, the marker of rows that see no key) is absorbed
here, so the executor calls :func:`attn_forward` / :func:`attn_backward` and nothing else.

Backends (GPU ones imported lazily, only when selected):

``flash_attn``   flash-attn 2 ``_flash_attn_varlen_forward/_backward``. Keyword arguments are
                 bound from the installed function's own signature (2.0 … 2.7+ renamed and
                 added parameters; tested against the recorded 2.5.9 / 2.6.3 / 2.7.4 / 2.8.3
                 signatures); the LSE comes back ``[b, h, max_q]`` (< 2.6) or ``[h, tq]``.
``te``           Transformer Engine fused attention (cuDNN), every tensor THD: ``qkv_layout``,
                 and on TE ≥ 2.15 ``o_format`` / ``do_format`` / ``dqkv_layout`` too (their
                 ``sbhd`` defaults would shape O and dQKV wrongly). Bound the same way, from
                 TE 1.9 (bottom-right causal mask) to 2.18+; the binding is tested against the
                 recorded 1.13 / 2.14 / 2.18 signatures, the kernel itself only by
                 ``scripts/gpu_check.sh`` on a GPU.
``torch_cuda``   PyTorch's vendored FlashAttention-2, ``aten._flash_attention_forward/_backward``
                 with ``cum_seq_q/k``. Findings (PyTorch source + its meta kernels): the varlen
                 path calls FA2's ``mha_varlen_fwd`` directly, so causal is bottom-right aligned
                 (FA ≥ 2.1; ``torch.nn.attention.bias.causal_lower_right`` relies on exactly
                 this), GQA is native (``num_heads % num_heads_k == 0``, no kv expansion
                 needed), the LSE is ``[h, tq]`` (``[b, h, max_q]`` before the unpadded-LSE
                 update — both handled), q/k/v need equal head sizes (we zero-pad) that are
                 multiples of 8, dtypes fp16/bf16 only, SM80+.
``cpu``          :mod:`megatron_hsap.runtime.cpu_attention`, pure PyTorch; runs on any device
                 and any float dtype; the numerical reference.

Attention dropout (``runtime/dropout.py``): the GPU backends draw each call's mask from the CUDA
generator and return its state, which the backward call over the same blocks takes back
(:func:`attn_forward_dropout`); the ``cpu`` backend keys its mask on global coordinates instead.

FlashAttention marks a row that sees no key with ``lse = +inf``; the contract here is
``-inf`` (what the LSE merge expects), so forward converts, and backward hands the kernel
``+inf`` for such rows so their ``P = exp(s - lse)`` is exactly 0.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError, RuntimeMismatchError
from megatron_hsap.runtime import cpu_attention
from megatron_hsap.runtime.dropout import Dropout
from megatron_hsap.runtime.kernel_layouts import lse_from_th, lse_to_th, no_key_rows
from megatron_hsap.runtime.env import read_env
from megatron_hsap.runtime.kernel_signatures import (
    FA_VETTED_DEFAULTS,
    TE_THD_FORMATS,
    TE_VETTED_DEFAULTS,
    bind,
    te_support_reason,
)

__all__ = ["BACKENDS", "attn_forward", "attn_forward_dropout", "attn_backward", "available_backends", "resolve_backend"]

BACKENDS: tuple[str, ...] = ("flash_attn", "te", "torch_cuda", "cpu")
_AUTO_CUDA_ORDER: tuple[str, ...] = ("flash_attn", "te", "torch_cuda")
_INF = float("inf")
# What to do when a GPU backend does not import (shown at start-up by resolve_backend).
_INSTALL_HINT = {
    "flash_attn": "install it with `pip install --no-build-isolation flash-attn` (or a prebuilt "
    "wheel; scripts/install_gpu.sh, README 'Running on GPUs')",
    "te": "install it with `pip install --no-build-isolation 'transformer-engine[pytorch]'` "
    "(scripts/install_gpu.sh, README 'Running on GPUs')",
}


# ----------------------------------------------------------------------------- selection
@functools.cache
def _import_flash_attn() -> tuple[Callable[..., Any], Callable[..., Any]]:
    mod = importlib.import_module("flash_attn.flash_attn_interface")
    return mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward


_TE_MODULE = "transformer_engine.pytorch.cpp_extensions.fused_attn"


@functools.cache
def _import_te() -> tuple[Callable[..., Any], Callable[..., Any], Any, Any]:
    fa = importlib.import_module(_TE_MODULE)
    consts = importlib.import_module("transformer_engine.pytorch.constants")
    return fa.fused_attn_fwd, fa.fused_attn_bwd, fa.FusedAttnBackend, consts.TE_DType


def _sm80_reason(device: torch.device) -> str | None:
    if torch.version.hip is None and torch.cuda.get_device_capability(device)[0] < 8:
        return "needs an Ampere (SM80) or newer GPU"
    return None


@functools.cache
def _unavailable_reason(name: str, device_key: str) -> str | None:
    """Why backend ``name`` cannot run on ``device_key`` (None: it can). Cached: imports once."""
    device = torch.device(device_key)
    if name == "cpu":
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device, got {device_key!r}"
    if name == "torch_cuda":
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return "this PyTorch has no aten._flash_attention_forward"
        if not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
            return "this PyTorch build has no flash attention kernels"
    else:
        try:
            if name == "flash_attn":
                _import_flash_attn()
            else:
                reason = te_support_reason(importlib.import_module(_TE_MODULE))
                if reason is not None:
                    return reason
                _import_te()
        except Exception as exc:  # a broken install (ABI mismatch) must not break auto-selection
            return f"import failed ({type(exc).__name__}: {exc}); {_INSTALL_HINT[name]}"
    return _sm80_reason(device)


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device``, in auto-selection order (``cpu`` always last)."""
    key = str(torch.device(device))
    return [b for b in BACKENDS if _unavailable_reason(b, key) is None]


def resolve_backend(name: str | None, device: torch.device | str) -> str:
    """Pick a backend: ``name`` argument > ``HSAP_ATTN_BACKEND`` > auto.

    Auto picks flash_attn > te > torch_cuda on CUDA and ``cpu`` elsewhere. Reads the
    environment, so call it at construction time and pass the result as ``backend=``.
    Raises ``ConfigError`` for an unknown or unavailable name, listing what is available.
    """
    device = torch.device(device)
    source = "argument"
    if name is None:
        name, source = read_env().attn_backend, "HSAP_ATTN_BACKEND"
    name = None if name is None else name.strip().lower()
    if name is not None and name != "auto":
        if name not in BACKENDS:
            raise ConfigError(
                f"unknown attention backend {name!r} (from {source}); known: {list(BACKENDS)}, "
                f"available on {device}: {available_backends(device)}"
            )
        reason = _unavailable_reason(name, str(device))
        if reason is not None:
            raise ConfigError(
                f"attention backend {name!r} (from {source}) cannot run on {device}: {reason}; "
                f"available: {available_backends(device)}"
            )
        return name
    if device.type != "cuda":
        return "cpu"
    for candidate in _AUTO_CUDA_ORDER:  # lazily: TE is only imported when flash-attn is absent
        if _unavailable_reason(candidate, str(device)) is None:
            return candidate
    raise ConfigError(
        f"no GPU attention backend can run on {device}: "
        + "; ".join(f"{b}: {_unavailable_reason(b, str(device))}" for b in _AUTO_CUDA_ORDER)
        + ". Install flash-attn, or set HSAP_ATTN_BACKEND=cpu for the (slow) pure-PyTorch one"
    )


@functools.cache
def _resolved(name: str | None, device_key: str) -> str:
    # backend=None on a hot path: resolve (and read the environment) once per device.
    return resolve_backend(name, device_key)


# ----------------------------------------------------------------------------- helpers
def _check_shapes(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise BatchError(f"q, k, v must be [t, heads, dim], got {q.shape=} {k.shape=} {v.shape=}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise BatchError(f"shape mismatch: {q.shape=} {k.shape=} {v.shape=}")
    if q.shape[1] % k.shape[1]:
        raise BatchError(f"query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape:
        raise BatchError(
            f"cu_seqlens_q/k must be 1-D of equal length, got {cu_q.shape} and {cu_k.shape}"
        )


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _pad_last(x: Tensor, size: int) -> Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


# LSE layout each GPU backend returned (learnt from its first forward, or a tiny probe).
_LSE_LAYOUT: dict[str, str] = {}


def _lse_layout(backend: str, device: torch.device) -> str:
    if backend not in _LSE_LAYOUT:  # backward before any forward: probe with 2 one-token seqs
        x = torch.zeros((2, 1, 8), dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        _GPU_FORWARD[backend](x, x, x, cu, cu, 2, 1, False, 1.0)
    return _LSE_LAYOUT[backend]


def _gpu_seqlens(cu_q: Tensor, cu_k: Tensor, max_q: int) -> tuple[Tensor, Tensor, int]:
    """int32 contiguous cu_seqlens, and ``max_seqlen_q`` raised to >= 2: with 1 (and GQA) FA2's
    varlen forward switches to a decode path that assumes exactly one query per sequence and
    returns its LSE in another layout; an upper bound is always a legal ``max_seqlen_q``."""
    as32 = lambda cu: cu.to(torch.int32).contiguous()  # noqa: E731
    return as32(cu_q), as32(cu_k), max(max_q, 2)


def _half_inputs(q: Tensor, name: str) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"attention backend {name!r} supports fp16/bf16 only, got {q.dtype}: "
            "cast the activations or use backend='cpu' (HSAP_ATTN_BACKEND=cpu)"
        )


# ----------------------------------------------------------------------------- flash-attn
_FA_FIXED: dict[str, Any] = dict(
    dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1,
    softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
    seqused_k=None, zero_tensors=False, deterministic=False, rng_state=None,
)  # fmt: skip


def _window_values(window: tuple[int, int]) -> dict[str, Any]:
    """flash-attn's sliding window under each name a release has used (``window_size`` ≥ 2.3,
    ``window_size_left/right`` in the 2.7 internals); ``bind`` keeps the installed ones."""
    return dict(window_size=tuple(window), window_size_left=window[0], window_size_right=window[1])


def _fa_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0):
    fwd, _ = _import_flash_attn()
    dv, dp = v.shape[-1], _round8(max(q.shape[-1], v.shape[-1]))  # FA2: one head size, 8 | d
    values = dict(
        _FA_FIXED, q=_pad_last(q, dp).contiguous(), k=_pad_last(k, dp).contiguous(),
        v=_pad_last(v, dp).contiguous(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
        **_window_values(window), dropout_p=dropout_p,
    )  # fmt: skip
    res = fwd(**bind(fwd, values, "flash_attn._flash_attn_varlen_forward", vetted=FA_VETTED_DEFAULTS))
    # <= 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state); >= 2.7: (out, lse, S, rng)
    out, raw = res[0], res[5] if len(res) == 8 else res[1]
    _LSE_LAYOUT["flash_attn"] = "ht" if raw.dim() == 2 else "bhs"
    lse = lse_to_th(raw, _LSE_LAYOUT["flash_attn"], cu_q, q.shape[0])
    # rng_state (philox seed and offset of this call's dropout mask) is the last element in both
    return out[..., :dv].contiguous(), lse.masked_fill_(lse == _INF, -_INF), res[-1] if dropout_p > 0 else None


def _fa_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0,
                 rng_state=None):
    _, bwd = _import_flash_attn()
    d, dv, dp = q.shape[-1], v.shape[-1], _round8(max(q.shape[-1], v.shape[-1]))
    qp, kp, vp = (_pad_last(x, dp).contiguous() for x in (q, k, v))
    raw = lse_from_th(lse.masked_fill(lse == -_INF, _INF), _lse_layout("flash_attn", q.device),
                       cu_q, max_q)  # fmt: skip
    dq, dk, dvv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    values = dict(
        _FA_FIXED, dout=_pad_last(dout, dp).contiguous(), q=qp, k=kp, v=vp,
        out=_pad_last(out, dp).contiguous(), softmax_lse=raw, dq=dq, dk=dk, dv=dvv,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, **_window_values(window), dropout_p=dropout_p, rng_state=rng_state,
    )  # fmt: skip
    bwd(**bind(bwd, values, "flash_attn._flash_attn_varlen_backward", vetted=FA_VETTED_DEFAULTS))
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


# ----------------------------------------------------------------------------- torch_cuda
def _torch_window(window: tuple[int, int]) -> dict[str, int]:
    """aten's ``window_size_left/right`` keywords (torch ≥ 2.5), only when a window is set."""
    return {} if tuple(window) == (-1, -1) else dict(window_size_left=window[0], window_size_right=window[1])


def _torch_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0):
    dv, dp = v.shape[-1], _round8(max(q.shape[-1], v.shape[-1]))
    res = torch.ops.aten._flash_attention_forward(
        _pad_last(q, dp).contiguous(), _pad_last(k, dp).contiguous(),
        _pad_last(v, dp).contiguous(), cu_q, cu_k, max_q, max_k, dropout_p, causal, False, scale=scale,
        **_torch_window(window),
    )  # fmt: skip
    out, raw = res[0], res[1]
    _LSE_LAYOUT["torch_cuda"] = "ht" if raw.dim() == 2 else "bhs"
    lse = lse_to_th(raw, _LSE_LAYOUT["torch_cuda"], cu_q, q.shape[0])
    # (out, logsumexp, philox seed, philox offset, debug mask): the seed and offset redraw the mask
    state = (res[2], res[3]) if dropout_p > 0 else None
    return out[..., :dv].contiguous(), lse.masked_fill_(lse == _INF, -_INF), state


def _torch_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0,
                    rng_state=None):
    d, dv, dp = q.shape[-1], v.shape[-1], _round8(max(q.shape[-1], v.shape[-1]))
    raw = lse_from_th(lse.masked_fill(lse == -_INF, _INF), _lse_layout("torch_cuda", q.device),
                       cu_q, max_q)  # fmt: skip
    if rng_state is None:  # rng state: unused without dropout
        seed_dtype = getattr(torch, "uint64", torch.int64)
        rng_state = (torch.zeros(2, dtype=seed_dtype, device=q.device), torch.zeros((), dtype=seed_dtype, device=q.device))
    seed, offset = rng_state
    dq, dk, dvv = torch.ops.aten._flash_attention_backward(
        *(_pad_last(x, dp).contiguous() for x in (dout, q, k, v, out)), raw, cu_q, cu_k,
        max_q, max_k, dropout_p, causal, seed, offset, scale=scale, **_torch_window(window),
    )  # fmt: skip
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


# ----------------------------------------------------------------------------- TE
def _te_values(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0) -> dict[str, Any]:
    """Every argument the TE adapter means, under every name a release has used:
    ``qkv_dtype`` (1.x) / ``fake_dtype`` (2.x), ``dqkv_dtype`` (≤ 2.14), the THD formats of O,
    dO and dQKV (≥ 2.15), ``bottom_right_diagonal`` (≥ 2.12). :func:`bind` keeps those the
    installed function names. A sliding ``window`` (flash-attn's convention, bottom-right
    aligned like our blocks) goes in ``window_size`` with ``bottom_right_diagonal=True``."""
    _, _, backends, te_dtype = _import_te()
    mask = "padding_causal_bottom_right" if causal else "padding"
    windowed = tuple(window) != (-1, -1)
    if windowed:
        window_size = (window[0], 0 if causal else window[1])
    else:
        window_size = (-1, 0) if causal else (-1, -1)
    return dict(
        TE_THD_FORMATS, is_training=True, max_seqlen_q=max_q, max_seqlen_kv=max_k,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k,
        q=q, k=k, v=v, fake_dtype=q.dtype, qkv_dtype=te_dtype[q.dtype],
        dqkv_dtype=te_dtype[q.dtype], fused_attention_backend=backends["F16_arbitrary_seqlen"],
        attn_scale=scale, dropout=dropout_p, fast_zero_fill=True, attn_bias_type="no_bias",
        attn_mask_type=mask, window_size=window_size,
        bottom_right_diagonal=causal or windowed, return_max_logit=False, deterministic=False,
    )  # fmt: skip


def _te_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0):
    fwd = _import_te()[0]
    d, dv = q.shape[-1], v.shape[-1]
    qp, kp = _pad_last(q, _round8(d)).contiguous(), _pad_last(k, _round8(d)).contiguous()
    vp = _pad_last(v, _round8(dv)).contiguous()
    values = _te_values(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal, scale, window, dropout_p)
    out, aux = fwd(**bind(fwd, values, "transformer_engine fused_attn_fwd", vetted=TE_VETTED_DEFAULTS))
    stats = aux[0]  # softmax stats (natural-log LSE): [b, h, max_q, 1] or packed [tq, h, 1]
    _LSE_LAYOUT["te"] = "bhs1" if stats.dim() == 4 else "th1"
    lse = lse_to_th(stats, _LSE_LAYOUT["te"], cu_q, q.shape[0])
    empty = no_key_rows(cu_q, cu_k, q.shape[0], causal)  # cuDNN's value there is unspecified
    out = out[..., :dv].masked_fill(empty[:, None, None], 0.0)
    # aux = [softmax stats, rng_state (philox seed, offset), ...]: the state redraws the mask in backward
    return out, lse.masked_fill_(empty[:, None], -_INF), aux[1] if dropout_p > 0 else None


def _te_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1), dropout_p=0.0,
                 rng_state=None):
    bwd = _import_te()[1]
    d, dv = q.shape[-1], v.shape[-1]
    qp, kp = _pad_last(q, _round8(d)).contiguous(), _pad_last(k, _round8(d)).contiguous()
    vp = _pad_last(v, _round8(dv)).contiguous()
    stats = lse_from_th(lse.masked_fill(lse == -_INF, _INF), _lse_layout("te", q.device),
                         cu_q, max_q)  # fmt: skip
    if rng_state is None:  # unused without dropout
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    values = _te_values(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal, scale, window, dropout_p)
    values.update(o=_pad_last(out, _round8(dv)).contiguous(),
                  d_o=_pad_last(dout, _round8(dv)).contiguous(), aux_ctx_tensors=[stats, rng_state])
    grads = bwd(**bind(bwd, values, "transformer_engine fused_attn_bwd", vetted=TE_VETTED_DEFAULTS))
    dq, dk, dvv = grads[:3]  # [dq, dk, dv, (dbias, dsoftmax_offset)]
    empty = no_key_rows(cu_q, cu_k, q.shape[0], causal)
    return dq[..., :d].masked_fill(empty[:, None, None], 0.0), dk[..., :d], dvv[..., :dv]


_GPU_FORWARD = {"flash_attn": _fa_forward, "torch_cuda": _torch_forward, "te": _te_forward}
_GPU_BACKWARD = {"flash_attn": _fa_backward, "torch_cuda": _torch_backward, "te": _te_backward}


# ----------------------------------------------------------------------------- public API
def attn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    backend: str | None = None, window: tuple[int, int] = (-1, -1),
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Varlen attention forward.

    ``q [tq, h, d]``, ``k [tk, hkv, d]``, ``v [tk, hkv, dv]`` (``h % hkv == 0``); ``cu_seqlens_*``
    int32/int64 ``[n+1]`` on the device, ``cu_seqlens_q[-1] == tq``. Causal is bottom-right
    aligned per sequence (query ``i`` of lengths ``(lq, lk)`` sees key ``j`` iff
    ``j <= i + lk - lq``). Returns ``out [tq, h, dv]`` in ``q.dtype`` and ``lse [tq, h]`` float32
    (float64 for float64 inputs on ``cpu``); rows that see no key get ``out 0``, ``lse -inf``.
    ``backend=None`` resolves once per device (argument > ``HSAP_ATTN_BACKEND`` > auto).
    ``window=(left, right)``: flash-attn's sliding window with the same alignment (query ``i``
    sees keys ``i + lk - lq - left .. i + lk - lq + right``; -1 unbounded), as every plan item
    gives it (``ComputeItem.kernel_window``; ``(-1, -1)``: none).
    """
    out, lse, _ = attn_forward_dropout(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                                       softmax_scale=softmax_scale, dropout=None, backend=backend, window=window)
    return out, lse


def attn_forward_dropout(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, dropout: Dropout | None,
    q_pos: Tensor | None = None, k_pos: Tensor | None = None,
    backend: str | None = None, window: tuple[int, int] = (-1, -1),
) -> tuple[Tensor, Tensor, Any]:  # fmt: skip
    """:func:`attn_forward` with attention dropout ``dropout.p`` (None: none): ``(out, lse,
    rng_state)``. ``lse`` is the undropped one (what the merge needs); ``rng_state`` is what
    :func:`attn_backward` takes to redraw the mask (the GPU kernels' philox seed and offset; None
    for ``cpu``, whose mask is keyed on ``dropout.seed``, global heads from ``dropout.head_offset``,
    and the rows' global tokens ``q_pos [tq]`` / ``k_pos [tk]`` int64 on the device)."""
    _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)
    name = _resolved(backend, str(q.device))
    tq, h, dv = q.shape[0], q.shape[1], v.shape[2]
    if tq == 0 or k.shape[0] == 0:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros((tq, h, dv))
        return out, torch.full((tq, h), -_INF, dtype=lse_dtype, device=q.device), None
    if name == "cpu":
        out, lse = cpu_attention.varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale, window=window,
            dropout=dropout, q_pos=q_pos, k_pos=k_pos,
        )  # fmt: skip
        return out, lse, None
    _half_inputs(q, name)
    cu_q, cu_k, max_q = _gpu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    p = 0.0 if dropout is None else dropout.p
    return _GPU_FORWARD[name](q, k, v, cu_q, cu_k, max_q, max_seqlen_k, causal, softmax_scale, tuple(window), p)


def attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, softmax_scale: float, delta: Tensor | None = None, backend: str | None = None,
    window: tuple[int, int] = (-1, -1), dropout: Dropout | None = None, rng_state: Any = None,
    q_pos: Tensor | None = None, k_pos: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Varlen attention backward of one kv block, against the *final* merged result.

    ``dout``/``out [tq, h, dv]`` and ``lse [tq, h]`` fp32 are those of the final merged output
    of these rows, so partial gradients of several kv blocks sum exactly to the full gradient.
    ``delta [tq, h]`` fp32 = rowsum(dout ∘ out) (computed here when None; the GPU kernels
    always derive it from ``dout`` and ``out`` themselves, so those must be the final ones).
    Returns ``dq [tq, h, d]``, ``dk [tk, hkv, d]``, ``dv [tk, hkv, dv]`` in float32 (float64 for
    float64 inputs): partial gradients for the caller to accumulate. With ``dropout``: the
    forward's ``rng_state`` (GPU) or ``q_pos`` / ``k_pos`` (``cpu``), which redraw its mask
    (:func:`attn_forward_dropout`).
    """
    _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)
    name = _resolved(backend, str(q.device))
    gdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q.shape[0] == 0 or k.shape[0] == 0:
        return (torch.zeros(q.shape, dtype=gdt, device=q.device),
                torch.zeros(k.shape, dtype=gdt, device=q.device),
                torch.zeros(v.shape, dtype=gdt, device=q.device))  # fmt: skip
    if name == "cpu":
        if delta is None:
            delta = (dout.to(gdt) * out.to(gdt)).sum(dim=-1)
        return cpu_attention.varlen_backward(
            dout, q, k, v, lse, delta, cu_seqlens_q, cu_seqlens_k,
            causal=causal, softmax_scale=softmax_scale, window=window, dropout=dropout, q_pos=q_pos, k_pos=k_pos,
        )  # fmt: skip
    _half_inputs(q, name)
    cu_q, cu_k, max_q = _gpu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    dout, out = dout.to(q.dtype), out.to(q.dtype)  # kernels want q's dtype (out may be fp32)
    p = 0.0 if dropout is None else dropout.p
    if p > 0 and rng_state is None:
        raise RuntimeMismatchError(f"attention backend {name!r}: a dropout backward needs its forward's rng_state")
    grads = _GPU_BACKWARD[name](
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_seqlen_k, causal, softmax_scale, tuple(window), p, rng_state
    )
    return tuple(g.float() for g in grads)  # type: ignore[return-value]

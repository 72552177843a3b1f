"""Keyword arguments for third-party kernels, bound by the installed function's own signature.

flash-attn and Transformer Engine rename, add and drop parameters between releases; the adapters
in :mod:`megatron_hsap.runtime.kernels` describe every value they mean (``values``) and
:func:`bind` passes the ones the installed function names (docs/design.md §2.2). Two failure
modes are caught here rather than on the GPU:

* a *required* parameter the adapter does not know: an unsupported release -> ``ConfigError``;
* an *optional* parameter the adapter does not know and whose default it has not vetted: a
  warning naming it. Transformer Engine 2.15 added ``o_format`` / ``do_format`` /
  ``dqkv_layout`` with ``sbhd`` defaults; an adapter passing only ``qkv_layout="thd_thd_thd"``
  made the C++ side shape O and dQ/dK/dV as ``sbhd`` (an out-of-bounds write). Such a parameter
  must never again slip by silently.

The signatures of the releases the adapters are written against are recorded (names and
defaults only) in ``tests/fixtures/kernel_signatures/`` and the binding is tested against them:
Transformer Engine 1.13, 2.14 (= 2.12 – 2.14.1), 2.18 (= 2.15 – 2.17.1) and 2.20.2, the
PyPI release of late 2026 (same signature as 2.18; its ``FusedAttnBackend`` became an
``IntEnum``, still indexed by name) — ``transformer_engine/pytorch/cpp_extensions/
fused_attn.py`` — and flash-attn 2.5.9, 2.6.3, 2.7.4, 2.8.3 (``flash_attn/flash_attn_interface.py``).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from megatron_hsap.errors import ConfigError

__all__ = ["TE_THD_FORMATS", "TE_VETTED_DEFAULTS", "FA_VETTED_DEFAULTS", "parameters", "bind", "te_support_reason"]

# Every tensor of the TE call is packed THD: Q, K, V (qkv_layout), O (o_format), dO (do_format)
# and dQ, dK, dV (dqkv_layout, TE >= 2.15). TE's own THD context parallelism passes exactly
# these (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, v2.18:
# o_format = qkv_format, ctx.dqkv_layout = qkv_layout).
TE_THD_FORMATS: dict[str, str] = {
    "qkv_layout": "thd_thd_thd",
    "o_format": "thd",
    "do_format": "thd",
    "dqkv_layout": "thd_thd_thd",
}

# Optional parameters whose defaults are what we want (no bias, no paging, no FP8 scaling,
# vanilla softmax, the default generator, no CUDA-graph capture, formats of FP8 scale
# inverses). Read from the recorded releases; anything else optional gets a warning.
TE_VETTED_DEFAULTS = frozenset({
    "attn_bias", "page_table_k", "page_table_v", "s_quantizer", "o_quantizer", "dp_quantizer",
    "dqkv_quantizer", "softmax_type", "rng_gen", "softmax_offset", "cuda_graph",
    "qkv_scale_inv_format", "do_scale_inv_format",
    # TE 1.x FP8 scaling tensors and their offsets into the FP8 meta tensors
    "d_scale_qkv", "d_scale_qkv_offset", "d_scale_s", "d_scale_s_offset", "q_scale_s",
    "q_scale_s_offset", "q_scale_o", "q_scale_o_offset", "amax_s", "amax_s_offset", "amax_o",
    "amax_o_offset", "d_scale_o", "d_scale_do", "d_scale_dp", "q_scale_dp", "q_scale_dqkv",
    "amax_dp", "amax_dqkv",
})  # fmt: skip
FA_VETTED_DEFAULTS = frozenset()  # the flash-attn adapter sets every parameter it knows


@functools.cache
def parameters(fn: Callable[..., Any]) -> tuple[tuple[str, bool], ...]:
    """``(name, required)`` of ``fn``'s named parameters (cached: ``inspect`` is slow)."""
    target = getattr(fn, "_init_fn", fn)  # torch.library.custom_op hides the signature
    return tuple(
        (p.name, p.default is p.empty)
        for p in inspect.signature(target).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


_WARNED: set[tuple[str, tuple[str, ...]]] = set()


def bind(
    fn: Callable[..., Any], values: Mapping[str, Any], what: str, *, vetted: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Keyword arguments for ``fn`` from ``values``, by the function's own parameter names.

    Absorbs renames/additions across versions (``window_size`` tuple vs ``window_size_left`` /
    ``_right``, ``qkv_dtype`` vs ``fake_dtype``, ``o_format``, ...). A required parameter not in
    ``values`` raises ``ConfigError``; an optional one neither in ``values`` nor in ``vetted``
    warns once per function (its default is used, unchecked).
    """
    kwargs: dict[str, Any] = {}
    unvetted = []
    for name, required in parameters(fn):
        if name in values:
            kwargs[name] = values[name]
        elif required:
            raise ConfigError(
                f"{what} has a required parameter {name!r} this adapter does not know "
                "(unsupported version): pin a tested version (README 'Running on GPUs') or choose "
                "another backend via HSAP_ATTN_BACKEND"
            )
        elif name not in vetted:
            unvetted.append(name)
    key = (what, tuple(unvetted))
    if unvetted and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"{what} has optional parameters this adapter leaves at defaults it has not vetted: "
            f"{unvetted}. A new release may have changed their meaning; run `bash scripts/gpu_check.sh` "
            "on this installation or pin a tested version (README 'Running on GPUs')",
            RuntimeWarning,
            stacklevel=3,
        )
    return kwargs


def _has_name(table: Any, name: str) -> bool:
    """``table[name]`` exists: TE's tables are dicts, some became enums (``FusedAttnBackend`` in
    2.20), and ``name in EnumClass`` compares values, not names."""
    try:
        table[name]
    except (KeyError, TypeError):
        return False
    return True


def te_support_reason(fused_attn: Any) -> str | None:
    """Why the imported ``transformer_engine.pytorch.cpp_extensions.fused_attn`` module cannot
    serve the THD adapter (None: it can). Needs the separate-q/k/v functions, the
    ``thd_thd_thd`` layout and the bottom-right causal mask (TE >= 1.9)."""
    for name in ("fused_attn_fwd", "fused_attn_bwd"):
        if not callable(getattr(fused_attn, name, None)):
            return f"this Transformer Engine has no {name}; install transformer-engine[pytorch] >= 1.9"
    if not _has_name(getattr(fused_attn, "QKVLayout", {}), "thd_thd_thd") or not _has_name(
        getattr(fused_attn, "AttnMaskType", {}), "padding_causal_bottom_right"
    ):
        return (
            "this Transformer Engine lacks the THD layout or the bottom-right causal mask "
            "(added in 1.9); install transformer-engine[pytorch] >= 1.9"
        )
    names = {n for n, _ in parameters(fused_attn.fused_attn_fwd)}
    if not names & {"qkv_dtype", "fake_dtype"}:
        return "fused_attn_fwd takes neither qkv_dtype (TE 1.x) nor fake_dtype (TE 2.x): unsupported version"
    return None

"""CPU stand-ins for the flash-linear-attention (``fla``) kernels megatron-core's ``GatedDeltaNet``
trains with (tests and the CPU demo only; never imported on the GPU path, where the real ``fla`` runs).

``GatedDeltaNet`` imports ``fla.modules.convolution.causal_conv1d``, ``fla.modules.l2norm.l2norm``
and ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` at import time and refuses to build without
them. :func:`install` registers an ``fla`` package of the three: the convolution is
:func:`~megatron_hsap.megatron.cpu.mamba_kernels.causal_conv1d` (taps inside each document of
``cu_seqlens``), and the delta rule is megatron-core's own plain-torch
``torch_chunk_gated_delta_rule`` (its deterministic path, from Hugging Face's Qwen3-Next) run on each
document of ``cu_seqlens`` alone — it takes no ``cu_seqlens`` itself.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.mamba_kernels import causal_conv1d as _conv_in_documents
from megatron_hsap.megatron.cpu.stand_in_packages import register_packages

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "install", "l2norm"]


def _seq_idx(cu_seqlens: Tensor | None, length: int) -> Tensor | None:
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(torch.long)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff(), output_size=length).unsqueeze(0)


def causal_conv1d(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, residual: Tensor | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False, activation: str | None = None,
                  cu_seqlens: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
    """``fla.modules.convolution.causal_conv1d``: ``x`` ``[b, s, d]``, ``weight`` ``[d, w]``; the
    convolution restarts at every document of ``cu_seqlens``. Returns ``(y, None)``."""
    if initial_state is not None or output_final_state or residual is not None:
        raise ConfigError("the CPU stand-in of fla's causal_conv1d takes no states or residual")
    out = _conv_in_documents(x, weight, bias, _seq_idx(cu_seqlens, x.shape[1]))
    return (F.silu(out) if activation in ("silu", "swish") else out), None


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> Tensor:
    """``fla.modules.l2norm.l2norm``: ``x / sqrt(Σ x² + eps)`` along ``dim``, computed in float32."""
    y = x.float() * torch.rsqrt(x.float().square().sum(dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                           **_: Any) -> tuple[Tensor, None]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``[b, s, h, d]`` q / k / v, ``[b, s, h]``
    g / beta): megatron-core's ``torch_chunk_gated_delta_rule`` on each document of ``cu_seqlens``.
    Returns ``(o, None)``."""
    # (the package's name: megatron-core 0.19.2 defines it in common.py, Megatron-LM's main in gdn.py)
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    if initial_state is not None or output_final_state or (scale is not None and scale != q.shape[-1] ** -0.5):
        raise ConfigError("the CPU stand-in of fla's chunk_gated_delta_rule takes no states and the default scale only")
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = [torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=1), None


def install() -> None:
    """Register the stand-in ``fla`` package (idempotent); a real one is left alone. megatron-core's
    gated delta net modules read the kernels at import; imported before, they are run again."""
    if not register_packages(("fla",), {
        "fla.modules.convolution": {"causal_conv1d": causal_conv1d},
        "fla.modules.l2norm": {"l2norm": l2norm},
        "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
    }):
        return
    common = sys.modules.get("megatron.core.ssm.gated_delta_net.common")
    if common is not None and not common.HAVE_FLA:
        # (classes made from them before read the same module namespaces, now complete)
        importlib.reload(common)
        for name in ("megatron.core.ssm.gated_delta_net.gdn",):
            if name in sys.modules:
                importlib.reload(sys.modules[name])

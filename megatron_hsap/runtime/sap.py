"""``SAPAttention``: the SAP plan over the inter group as a ``torch.autograd.Function`` (docs/design.md §2.2).

Forward runs this rank's forward program (:class:`~megatron_hsap.runtime.executor.Executor`) and
returns the merged output in the activation dtype; it keeps q, k, v, that output and the fp32 LSE
for backward, which runs the backward program (partials of dq/dkv accumulate in fp32 and are cast
to the input dtypes once, at the end).

Use :func:`megatron_hsap.runtime.hsap.hsap_attn_func` (validation, group defaults, Ulysses when
``P_intra > 1``); this Function assumes its inputs were checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_hsap.runtime.executor import Executor

__all__ = ["SAPAttention", "sap_forward", "sap_backward"]


def sap_forward(ex: Executor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``q [t, h, d]``, ``k [t, hkv, d]``, ``v [t, hkv, dv]`` (one inter chunk) -> ``out [t, h, dv]``
    in ``q.dtype`` and ``lse [t, h]`` float32."""
    out, lse = ex.forward(q, k, v, scale)
    return out.to(q.dtype), lse


def sap_backward(ex: Executor, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients ``dq``, ``dk``, ``dv`` in the dtypes of ``q``, ``k``, ``v``."""
    dq, dk, dv = ex.backward(do, q, k, v, out, lse, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class SAPAttention(torch.autograd.Function):
    """``SAPAttention.apply(q, k, v, executor, softmax_scale) -> out``; inter group only."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ex: Executor, scale: float) -> Tensor:
        out, lse = sap_forward(ex, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ex, ctx.scale = ex, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = sap_backward(ctx.ex, dout, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None

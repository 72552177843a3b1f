"""``SAPAttention``: the SAP plan over the inter group as a ``torch.autograd.Function`` (docs/design.md §2.2).

Forward runs this rank's forward program (:class:`~megatron_hsap.runtime.executor.Executor`) and
returns the merged output in the activation dtype; it keeps q, k, v, that output and the fp32 LSE
for backward, which runs the backward program (partials of dq/dkv accumulate in fp32 and are cast
to the input dtypes once, at the end). Attention sinks (``sinks [h]``) are merged once into the
final fp32 result (:func:`~megatron_hsap.runtime.merge.merge_sinks`); the backward program then runs
on the sink-corrected output and LSE, and the sink gradient of this rank's rows is returned as is
(no reduction: Megatron's DP×CP gradient all-reduce sums the ranks' contributions). With attention
dropout (``runtime/dropout.py``) the forward's kernel rng states are kept for the backward.

Use :func:`megatron_hsap.runtime.hsap.hsap_attn_func` (validation, group defaults, Ulysses when
``P_intra > 1``); this Function assumes its inputs were checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_hsap.runtime.dropout import CallStates, Dropout
from megatron_hsap.runtime.executor import Executor
from megatron_hsap.runtime.max_logits import Maxima
from megatron_hsap.runtime.merge import merge_sinks, sink_grad

__all__ = ["SAPAttention", "sap_forward", "sap_backward"]


def sap_forward(ex: Executor, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None = None,
                dropout: Dropout | None = None, max_logits: Tensor | None = None) -> tuple[Tensor, Tensor, CallStates | None]:  # fmt: skip
    """``q [t, h, d]``, ``k [t, hkv, d]``, ``v [t, hkv, dv]`` (one inter chunk), optional sink
    logits ``sinks [h]`` -> ``out [t, h, dv]`` in ``q.dtype`` and ``lse [t, h]`` float32 (both
    with the sinks merged in), and with ``dropout`` the calls' rng states for the backward.
    ``max_logits [h]`` float32: raised in place to this rank's pairs' largest scaled logit per
    head (sinks excluded, as Transformer Engine's ``return_max_logit``)."""
    states = None
    if dropout is None:
        out, lse = ex.forward(q, k, v, scale, max_logits)  # float32, every partial of every row merged
    else:
        out, lse, states = ex.forward_dropout(q, k, v, scale, dropout, max_logits)
    if sinks is not None:
        merge_sinks(out, lse, sinks, fused=ex.fused_merge)
    return out.to(q.dtype), lse, states


def sap_backward(ex: Executor, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 scale: float, states: CallStates | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients ``dq``, ``dk``, ``dv`` in the dtypes of ``q``, ``k``, ``v``."""
    dq, dk, dv = ex.backward(do, q, k, v, out, lse, scale, states)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class SAPAttention(torch.autograd.Function):
    """``SAPAttention.apply(q, k, v, executor, softmax_scale, sinks, dropout, maxima) -> out``; inter
    group only (``sinks``: ``[h]`` tensor or None; its gradient covers this rank's rows only;
    ``dropout``: a ``runtime.dropout.Dropout`` or None; ``maxima``: a ``runtime.max_logits.Maxima``
    or None)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ex: Executor, scale: float, sinks: Tensor | None = None,
                dropout: Dropout | None = None, maxima: Maxima | None = None) -> Tensor:  # fmt: skip
        out, lse, states = sap_forward(ex, q, k, v, scale, sinks, dropout, None if maxima is None else maxima.out)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ex, ctx.scale, ctx.states = ex, scale, states
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = sap_backward(ctx.ex, dout, q, k, v, out, lse, ctx.scale, ctx.states)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[5] else None
        return dq, dk, dv, None, None, dsinks, None, None

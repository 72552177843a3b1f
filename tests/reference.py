"""Float64 dense-mask attention: the independent reference every numerical test compares to.

Deliberately simple and written without looking at the kernels: build the full boolean mask
from per-token positions and document ids, run softmax attention in float64, and let autograd
provide the backward. Only for small sizes (it materialises ``[h, tq, tk]``).

The mask rule is the whole specification: query ``i`` may attend key ``j`` iff they belong to
the same document and ``k_pos[j] <= q_pos[i]`` — and, with a sliding window ``left`` (flash-attn's
``window_size=(left, 0)``), ``k_pos[j] >= q_pos[i] - left``. Every layout the project uses is expressed
through positions and document ids:

* packed document-causal batch: positions inside each document (``reference_packed``);
* varlen kernel call with bottom-right causal alignment, or a dense rectangle
  (``reference_varlen``): per sequence of lengths ``(lq, lk)``, keys at ``0..lk-1`` and queries
  at ``lk-lq .. lk-1`` (causal) or all at ``lk`` (no mask inside the sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "reference_attention",
    "reference_packed",
    "reference_varlen",
    "positions_from_cu_seqlens",
    "varlen_positions",
]


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    q_doc: Tensor,
    k_doc: Tensor,
    softmax_scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Dense-mask attention in float64, differentiable with autograd.

    Args:
        q: ``[tq, h, d]``; k: ``[tk, hkv, d]``; v: ``[tk, hkv, dv]`` with ``h % hkv == 0``
            (query head ``i`` uses kv head ``i // (h // hkv)``). Any float dtype; the math is
            float64 and gradients flow back to the given tensors.
        q_pos, k_pos: ``[tq]``, ``[tk]`` integer positions.
        q_doc, k_doc: ``[tq]``, ``[tk]`` integer document ids.
        softmax_scale: multiplies ``q · k`` before the softmax.
        window_left: sliding window (keys at most this far back); None or -1: none.
    Returns:
        ``out [tq, h, dv]`` float64 and ``lse [tq, h]`` float64 (natural log). Rows that may
        attend no key get ``out = 0`` and ``lse = -inf`` (and zero gradient).
    """
    tq, h, _ = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"{h=} is not a multiple of {hkv=}")
    group = h // hkv
    q64, k64, v64 = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    k64 = k64.repeat_interleave(group, dim=1)  # [tk, h, d]
    v64 = v64.repeat_interleave(group, dim=1)  # [tk, h, dv]

    allowed = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])  # [tq, tk]
    if window_left is not None and window_left >= 0:
        allowed &= k_pos[None, :] >= q_pos[:, None] - window_left
    has_key = allowed.any(dim=1)  # [tq]

    scores = torch.einsum("qhd,khd->hqk", q64, k64) * softmax_scale  # [h, tq, tk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Rows without any key: use finite dummy scores so softmax/logsumexp stay NaN-free, then
    # zero their output (and so their gradient) below.
    scores = torch.where(has_key[None, :, None], scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * allowed[None].to(torch.float64)
    out = torch.einsum("hqk,khd->qhd", probs, v64)
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [tq, h]
    lse = lse.masked_fill(~has_key[:, None], float("-inf"))
    return out, lse


def positions_from_cu_seqlens(cu_seqlens: Tensor | list[int]) -> tuple[Tensor, Tensor]:
    """``(pos, doc)`` of every token of a packed stream: position inside its document, doc id."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(int(cu[-1])) - cu[:-1][doc]
    return pos, doc


def reference_packed(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | list[int], softmax_scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Document-causal attention of a whole packed batch (q, k, v share ``cu_seqlens``), under a
    sliding window of ``window_left`` earlier keys when given."""
    pos, doc = positions_from_cu_seqlens(cu_seqlens)
    dev = q.device
    pos, doc = pos.to(dev), doc.to(dev)
    return reference_attention(q, k, v, pos, pos, doc, doc, softmax_scale, window_left)


def varlen_positions(
    cu_seqlens_q: Tensor | list[int], cu_seqlens_k: Tensor | list[int], causal: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q_pos, k_pos, q_doc, k_doc)`` encoding a varlen kernel call's mask.

    Sequence ``i`` has ``lq`` queries and ``lk`` keys; keys sit at positions ``0..lk-1``.
    Causal (bottom-right aligned): query ``r`` sits at ``r + lk - lq``, so it sees key ``j`` iff
    ``j <= r + lk - lq``. Not causal: every query sits at ``lk`` and sees all ``lk`` keys.
    """
    cq = torch.as_tensor(cu_seqlens_q, dtype=torch.int64).cpu()
    ck = torch.as_tensor(cu_seqlens_k, dtype=torch.int64).cpu()
    if len(cq) != len(ck):
        raise ValueError(f"{len(cq)=} != {len(ck)=}")
    k_pos, k_doc = positions_from_cu_seqlens(ck)
    q_rel, q_doc = positions_from_cu_seqlens(cq)
    lq = (cq[1:] - cq[:-1])[q_doc]
    lk = (ck[1:] - ck[:-1])[q_doc]
    q_pos = q_rel + lk - lq if causal else lk.clone()
    return q_pos, k_pos, q_doc, k_doc


def reference_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | list[int],
    cu_seqlens_k: Tensor | list[int],
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """Reference of one varlen kernel call (see :func:`varlen_positions` for the mask)."""
    dev = q.device
    q_pos, k_pos, q_doc, k_doc = (
        t.to(dev) for t in varlen_positions(cu_seqlens_q, cu_seqlens_k, causal)
    )
    return reference_attention(q, k, v, q_pos, k_pos, q_doc, k_doc, softmax_scale)

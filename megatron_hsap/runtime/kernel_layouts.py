"""The GPU kernels' LSE layouts and the rows that see no key (``runtime/kernels.py``'s conventions).

Kernels return the log-sum-exp in one of four layouts — ``"ht"`` ``[h, tq]`` (flash-attn >= 2.6,
PyTorch's FA2), ``"th1"`` ``[tq, h, 1]`` (TE on newer cuDNN), ``"bhs"`` ``[b, h, max_q]`` (flash-attn
< 2.6) and ``"bhs1"`` ``[b, h, max_q, 1]`` (TE on older cuDNN) — and the adapters' contract is
``[tq, h]`` float32; these functions convert both ways, on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_index", "lse_to_th", "lse_from_th", "no_key_rows"]


def token_index(cu: Tensor, t: int) -> tuple[Tensor, Tensor]:
    """Per token: sequence id and offset inside it (``cu[-1] == t`` assumed), on device."""
    tokens = torch.arange(t, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu[1:].contiguous(), tokens, right=True)
    seq = seq.clamp_(max=cu.numel() - 2)
    return seq, (tokens - cu[seq]).long()


def lse_to_th(raw: Tensor, layout: str, cu_q: Tensor, tq: int) -> Tensor:
    """A kernel's LSE in ``layout`` -> ``[tq, h]`` float32."""
    if layout == "ht":  # [h, tq]
        return raw.t().float().contiguous()
    if layout == "th1":  # [tq, h, 1]
        return raw.squeeze(-1).float()
    seq, off = token_index(cu_q, tq)  # "bhs" [b, h, max_q] or "bhs1" [b, h, max_q, 1]
    padded = raw.squeeze(-1) if layout == "bhs1" else raw
    return padded[seq, :, off].float()


def lse_from_th(lse: Tensor, layout: str, cu_q: Tensor, max_q: int) -> Tensor:
    """``[tq, h]`` -> the kernel's layout (inverse of :func:`lse_to_th`)."""
    lse = lse.float()
    if layout == "ht":
        return lse.t().contiguous()
    if layout == "th1":
        return lse.unsqueeze(-1).contiguous()
    seq, off = token_index(cu_q, lse.shape[0])
    padded = lse.new_zeros((cu_q.numel() - 1, lse.shape[1], max_q))
    padded[seq, :, off] = lse
    return padded.unsqueeze(-1) if layout == "bhs1" else padded


def no_key_rows(cu_q: Tensor, cu_k: Tensor, tq: int, causal: bool) -> Tensor:
    """``[tq]`` bool: rows that see no key (empty kv sequence, or before the causal diagonal)."""
    seq, off = token_index(cu_q, tq)
    lq = (cu_q[1:] - cu_q[:-1]).long()[seq]
    lk = (cu_k[1:] - cu_k[:-1]).long()[seq]
    return (lk == 0) | (off + lk - lq < 0) if causal else lk == 0

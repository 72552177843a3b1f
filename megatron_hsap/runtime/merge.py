"""The one LSE merge: combine two partial attention results over disjoint key sets.

Derivation (the standard one, e.g. FlashAttention-2 §3.1 and ring-attention write-ups): a row's
attention over keys ``A ∪ B`` with partial results ``(o_a, lse_a)`` and ``(o_b, lse_b)``,
where ``o_x = Σ_{j∈x} e^{s_j} v_j / e^{lse_x}`` and ``lse_x = log Σ_{j∈x} e^{s_j}``, is

    lse = log(e^{lse_a} + e^{lse_b}) = max + log1p(e^{min - max})
    o   = e^{lse_a - lse} · o_a + e^{lse_b - lse} · o_b

Every exponent above is ≤ 0, so nothing overflows however large the logits (|lse| ~ 1e4 in
bf16 training is common); an empty side (``lse = -inf``) gets weight exactly 0, and two empty
sides stay empty (``lse = -inf``, ``o`` unchanged, i.e. 0) without producing NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_into"]


def merge_into(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """Merge one partial result into an accumulator, in place.

    Args:
        out_acc: ``[n, h, dv]`` float32 (or float64) accumulator, updated in place.
        lse_acc: ``[n, h]`` same dtype, may hold ``-inf`` (nothing merged yet), updated in place.
        out_part: ``[n, h, dv]`` any float dtype (a kernel's output).
        lse_part: ``[n, h]`` float32, may hold ``-inf`` (row attended no key of this part).
    """
    lse_part = lse_part.to(lse_acc.dtype)
    hi = torch.maximum(lse_acc, lse_part)
    lo = torch.minimum(lse_acc, lse_part)
    # Both sides empty: hi = -inf; shift by 0 instead so lo - hi is -inf, not NaN.
    hi_safe = torch.where(hi == float("-inf"), torch.zeros_like(hi), hi)
    lse_new = hi + torch.log1p(torch.exp(lo - hi_safe))
    lse_new_safe = torch.where(lse_new == float("-inf"), torch.zeros_like(lse_new), lse_new)
    w_acc = torch.exp(lse_acc - lse_new_safe).unsqueeze(-1)  # in [0, 1]
    w_part = torch.exp(lse_part - lse_new_safe).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out_part, w_part)  # mixed dtypes promote to out_acc's
    lse_acc.copy_(lse_new)

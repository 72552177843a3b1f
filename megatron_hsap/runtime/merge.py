"""The one LSE merge: combine partial attention results over disjoint key sets (and attention sinks).

Derivation (the standard one, e.g. FlashAttention-2 §3.1 and ring-attention write-ups): a row's
attention over keys ``A ∪ B`` with partial results ``(o_a, lse_a)`` and ``(o_b, lse_b)``,
where ``o_x = Σ_{j∈x} e^{s_j} v_j / e^{lse_x}`` and ``lse_x = log Σ_{j∈x} e^{s_j}``, is

    lse = log(e^{lse_a} + e^{lse_b}) = max + log1p(e^{min - max})
    o   = e^{lse_a - lse} · o_a + e^{lse_b - lse} · o_b

Every exponent above is ≤ 0, so nothing overflows however large the logits (|lse| ~ 1e4 in
bf16 training is common); an empty side (``lse = -inf``) gets weight exactly 0, and two empty
sides stay empty (``lse = -inf``, ``o`` unchanged, i.e. 0) without producing NaN.

Two implementations of the same formulas: the eager torch one below (a dozen small kernels, 18 HBM
bytes per output element; every CPU tensor, fp64 accumulators) and ONE Triton launch
(``runtime/fused_merge.py``, 10 bytes), taken with ``fused=True`` on CUDA tensors. Callers decide
``fused`` once, at construction, with :func:`use_fused_merge` (``HSAP_FUSED_MERGE``, Triton present).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from megatron_hsap.errors import RuntimeMismatchError
from megatron_hsap.runtime.env import EnvSettings

__all__ = ["check_sinks", "merge_into", "merge_sinks", "sink_grad", "use_fused_merge"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_fused_merge(device: torch.device | str, env: EnvSettings) -> bool:
    """Whether merges on ``device`` take the fused Triton kernel: a CUDA device, Triton importable
    (looked up, not imported) and ``HSAP_FUSED_MERGE`` not ``0``. Call it at construction."""
    return torch.device(device).type == "cuda" and env.fused_merge and importlib.util.find_spec("triton") is not None


def _kernel_takes(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor) -> bool:
    # the kernel's contract; anything else (fp64 accumulators, CPU tensors) takes the eager path
    return (out_acc.is_cuda and out_acc.dtype == lse_acc.dtype == torch.float32
            and out_part.dtype in _FUSED_DTYPES)  # fmt: skip


def merge_into(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor, *, fused: bool = False) -> None:
    """Merge one partial result into an accumulator, in place.

    Args:
        out_acc: ``[n, h, dv]`` float32 (or float64) accumulator, updated in place.
        lse_acc: ``[n, h]`` same dtype, may hold ``-inf`` (nothing merged yet), updated in place.
        out_part: ``[n, h, dv]`` any float dtype (a kernel's output).
        lse_part: ``[n, h]`` float32, may hold ``-inf`` (row attended no key of this part).
        fused: one Triton launch instead of the eager kernels, for fp32 accumulators on CUDA
            (:func:`use_fused_merge`); CPU tensors always run eager (bit-identical to before).
    """
    if fused and _kernel_takes(out_acc, lse_acc, out_part):
        from megatron_hsap.runtime.fused_merge import fused_merge_into  # lazy: Triton only when used

        fused_merge_into(out_acc, lse_acc, out_part, lse_part.float())
        return
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


# --------------------------------------------------------------------------- attention sinks
#
# A sink (GPT-OSS; megatron-core's softmax_type "learnable" / "off-by-one") is one more column of a
# row's softmax with logit ``s`` (per query head) and value 0:  o' = Σ_j e^{s_j} v_j / (e^{lse} + e^{s}).
# It is exactly one more partial with ``(o, lse) = (0, s)``, merged ONCE, after every partial of the
# row has met (merging it into each partial would count it once per partial):
#
#     lse' = logaddexp(lse, s),    o' = e^{lse - lse'} · o.
#
# Backward: the usual softmax backward over all columns, with the final (o', lse'). Columns j of
# real keys give exactly the sink-free formulas with (o', lse') in place of (o, lse) — so the
# executor's backward runs unchanged on (o', lse') — and the sink column, whose value is 0 (dP = 0),
# gives  ds = Σ_rows p_sink · (0 - D) = -Σ_rows e^{s - lse'} · rowsum(dO ∘ o').


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor, *, fused: bool = False) -> None:
    """Merge per-head sink logits into final results, in place (call once per row, after all merges).

    Args:
        out: ``[n, h, dv]`` float32 final output of the keys (updated to ``o'``).
        lse: ``[n, h]`` float32 final LSE of the keys, may be ``-inf`` (updated to ``lse'``).
        sinks: ``[h]`` sink logits of these ``h`` heads (any float dtype; ``-inf`` = no sink).
        fused: as in :func:`merge_into` (the same kernel, the part's output read as 0).
    """
    if fused and _kernel_takes(out, lse, out):
        from megatron_hsap.runtime.fused_merge import fused_merge_sinks

        fused_merge_sinks(out, lse, sinks)
        return
    sink = sinks.detach().to(device=lse.device, dtype=lse.dtype).expand_as(lse)
    merge_into(out, lse, torch.zeros((), dtype=out.dtype, device=out.device).expand_as(out), sink)


def sink_grad(do: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Gradient of the sink logits from this rank's rows: ``-Σ_rows e^{s - lse'} · rowsum(dO ∘ o')``.

    Args:
        do: ``[n, h, dv]`` gradient of the output; out: ``[n, h, dv]`` the final ``o'``;
        lse: ``[n, h]`` float32 final ``lse'`` (finite wherever a sink is finite).
        sinks: ``[h]`` the sink logits.
    Returns:
        ``[h]`` in ``sinks.dtype``: only these rows' contribution (no reduction across ranks).
    """
    delta = (do.float() * out.float()).sum(dim=-1)  # [n, h]
    s = sinks.detach().to(device=lse.device, dtype=torch.float32)
    lse = lse.float()
    # p_sink = e^{s - lse'} in [0, 1]; a row with neither keys nor sink (lse' = -inf) gets 0, not NaN
    p_sink = torch.where(lse == float("-inf"), torch.zeros_like(lse), torch.exp(s - lse))  # [n, h]
    return (-(p_sink * delta).sum(dim=0)).to(sinks.dtype)


def check_sinks(sinks: object, q: Tensor) -> None:
    """``sinks`` must be a float ``[H]`` tensor on q's device (values are not read: no host sync)."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise RuntimeMismatchError(f"sinks must be a torch.Tensor of shape [{q.shape[1]}] (one logit per q head) or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise RuntimeMismatchError(
            f"sinks has shape {tuple(sinks.shape)} but q has {q.shape[1]} heads; pass one sink logit per "
            "query head of this rank ([H], megatron-core's softmax_offset of this TP rank)"
        )
    if not sinks.is_floating_point():
        raise RuntimeMismatchError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise RuntimeMismatchError(f"sinks are on {sinks.device} but q is on {q.device}; move them to q's device")

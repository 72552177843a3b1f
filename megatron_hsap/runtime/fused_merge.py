"""The LSE merge of ``runtime/merge.py`` as ONE Triton kernel (docs/design.md §2.2, "Merges").

Imported lazily, and only by :func:`~megatron_hsap.runtime.merge.merge_into` /
:func:`~megatron_hsap.runtime.merge.merge_sinks` when they are asked for the fused path on CUDA
tensors: importing ``megatron_hsap`` never imports Triton, and CPU-only users need not have it.

Why: the eager merge is a dozen small kernels on ``[n, h]`` plus ``out.mul_(w).addcmul_(part, w)``,
18 HBM bytes per output element; this kernel reads the fp32 accumulator (4), the part (2 in
bf16/fp16) and writes the accumulator (4): 10 bytes, what Transformer Engine's
``thd_out_correction`` and LightSeq's Triton rescale move (``plan/hardware.py`` MERGE_FWD_BYTES).
The sinks merge is the same kernel with ``HAS_PART=False`` (the part's output is 0: 8 bytes).

Semantics are exactly ``merge_into``'s (its docstring has the derivation): every exponent ≤ 0,
an empty side (``lse = -inf``) weighs exactly 0, two empty sides stay ``-inf`` with the output
unchanged, no NaN from ``-inf - -inf``. Any strides work (they are kernel arguments; the executor
passes row slices of contiguous accumulators and pool views), indices are int64.

``TRITON_INTERPRET=1`` must be set before this module is imported (Triton 3.x reads it when
``triton.jit`` decorates); the tests import it that way to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_hsap.errors import RuntimeMismatchError

__all__ = ["fused_merge_into", "fused_merge_sinks", "PART_DTYPES"]

PART_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEMS_PER_PROGRAM = 4096  # [BLOCK_R, BLOCK_D] tile: 16 KiB of fp32 accumulator per program


@triton.jit
def _log1p(x):
    """``log(1 + x)`` accurate for tiny ``x`` (Kahan's trick; ``x`` in [0, 1] here): Triton has no
    portable log1p, and ``log(1 + x)`` alone loses ``x < 6e-8`` entirely."""
    u = 1.0 + x
    exact = u == 1.0
    return tl.where(exact, x, tl.log(u) * (x / tl.where(exact, 1.0, u - 1.0)))  # no 0/0 computed


@triton.jit
def _merge_kernel(o_acc, lse_acc, o_part, lse_part, rows, heads, dv,
                  s_oa_n, s_oa_h, s_oa_d, s_la_n, s_la_h, s_op_n, s_op_h, s_op_d, s_lp_n, s_lp_h,
                  HAS_PART: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # one program: BLOCK_R (row, head) pairs of the flattened [n * h], every dv column of them
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows * heads
    i = r // heads  # token row
    j = r % heads  # head
    a = tl.load(lse_acc + i * s_la_n + j * s_la_h, mask=live, other=float("-inf"))
    b = tl.load(lse_part + i * s_lp_n + j * s_lp_h, mask=live, other=float("-inf")).to(tl.float32)
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)  # both empty: lo - hi is -inf, not NaN
    new = hi + _log1p(tl.exp(lo - hi_safe))
    new_safe = tl.where(new == float("-inf"), 0.0, new)
    w_a = tl.exp(a - new_safe)[:, None]  # in [0, 1]; an empty side exactly 0
    w_b = tl.exp(b - new_safe)[:, None]
    tl.store(lse_acc + i * s_la_n + j * s_la_h, new, mask=live)
    base_a = (i * s_oa_n + j * s_oa_h)[:, None]
    base_p = (i * s_op_n + j * s_op_h)[:, None]
    for d0 in range(0, dv, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = live[:, None] & (d < dv)[None, :]
        oa = tl.load(o_acc + base_a + d[None, :] * s_oa_d, mask=m, other=0.0)
        res = oa * w_a
        if HAS_PART:
            op = tl.load(o_part + base_p + d[None, :] * s_op_d, mask=m, other=0.0).to(tl.float32)
            res = res + op * w_b
        tl.store(o_acc + base_a + d[None, :] * s_oa_d, res, mask=m)


def _launch(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor | None, lse_part: Tensor, lse_strides: tuple[int, int]) -> None:
    n, h, dv = out_acc.shape
    if n * h == 0 or dv == 0:
        return
    block_d = min(triton.next_power_of_2(dv), 256)
    block_r = max(1, min(64, _ELEMS_PER_PROGRAM // block_d))
    part = out_part if out_part is not None else out_acc  # unread when HAS_PART is False
    grid = (triton.cdiv(n * h, block_r),)
    _merge_kernel[grid](out_acc, lse_acc, part, lse_part, n, h, dv, *out_acc.stride(), *lse_acc.stride(),
                        *part.stride(), *lse_strides, HAS_PART=out_part is not None, BLOCK_R=block_r,
                        BLOCK_D=block_d)  # fmt: skip


def _check_acc(out_acc: Tensor, lse_acc: Tensor) -> None:
    if out_acc.dim() != 3 or lse_acc.shape != out_acc.shape[:2]:
        raise RuntimeMismatchError(f"fused merge: out_acc {tuple(out_acc.shape)} must be [n, h, dv] and lse_acc "
                                   f"{tuple(lse_acc.shape)} [n, h]")  # fmt: skip
    if out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32:
        raise RuntimeMismatchError(f"fused merge: accumulators must be float32, got {out_acc.dtype} / {lse_acc.dtype}; "
                                   "pass fused=False for other dtypes")  # fmt: skip


def fused_merge_into(out_acc: Tensor, lse_acc: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """``merge_into`` in one launch: ``out_acc [n, h, dv]`` / ``lse_acc [n, h]`` float32 updated in
    place with ``out_part [n, h, dv]`` (fp32 / bf16 / fp16) and ``lse_part [n, h]`` float32; any
    strides, all on one device. Raises ``RuntimeMismatchError`` on other shapes or dtypes."""
    _check_acc(out_acc, lse_acc)
    if out_part.shape != out_acc.shape or lse_part.shape != lse_acc.shape:
        raise RuntimeMismatchError(f"fused merge: part {tuple(out_part.shape)} / {tuple(lse_part.shape)} does not match "
                                   f"the accumulator {tuple(out_acc.shape)} / {tuple(lse_acc.shape)}")  # fmt: skip
    if out_part.dtype not in PART_DTYPES or lse_part.dtype != torch.float32:
        raise RuntimeMismatchError(f"fused merge: part dtypes {out_part.dtype} / {lse_part.dtype} unsupported; "
                                   "out_part must be fp32, bf16 or fp16 and lse_part fp32")  # fmt: skip
    if len({t.device for t in (out_acc, lse_acc, out_part, lse_part)}) != 1:
        raise RuntimeMismatchError("fused merge: accumulators and part must be on one device")
    _launch(out_acc, lse_acc, out_part, lse_part, lse_part.stride())


def fused_merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> None:
    """``merge_sinks`` in one launch: the sink is a part of output 0 and LSE ``sinks[h]`` (read
    with row stride 0). ``out [n, h, dv]`` / ``lse [n, h]`` float32; ``sinks [h]`` any float dtype."""
    _check_acc(out, lse)
    s = sinks.detach().to(device=lse.device, dtype=torch.float32).contiguous()
    if s.shape != (lse.shape[1],):
        raise RuntimeMismatchError(f"fused merge: sinks {tuple(sinks.shape)} must be [h] with h = {lse.shape[1]}")
    _launch(out, lse, None, s, (0, 1))

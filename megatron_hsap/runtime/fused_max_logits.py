"""``varlen_max_logits`` (``runtime/max_logits.py``) as ONE Triton kernel per kernel call.

Imported lazily, and only by the executor when it was built for a CUDA device with Triton
importable (``max_logits.use_fused_max_logits``): importing ``megatron_hsap`` never imports Triton.

Why: the eager pass launches a handful of kernels per score tile (a ``bmm``, a mask, two maxima)
and tiles per sequence; a call over many short documents — fineweb at 1M tokens over 64 inter
ranks: ~60 tiles per rank and layer — then costs hundreds of launches for a few matrix products.
Here program ``(s, m, h)`` scores rows ``[m·BLOCK_M, (m+1)·BLOCK_M)`` of the call's sequence ``s``
against the keys its band allows, for q head ``h`` (kv head ``h // group``), and stores the
largest; the host takes the max over programs. Same definition as the eager pass: ``scale · q·k``
over visible pairs (flash-attn's band, bottom-right aligned: causal, and a call's window
``(left, right)``, both from ``cpu_attention._band``), fp32 products of the inputs (``tl.dot``
with ``ieee`` precision for fp32 inputs: no TF32; bf16 / fp16 inputs multiply natively on a GPU,
their products exact in the fp32 accumulator, and are upcast first under Triton's interpreter,
which multiplies no bf16).

``TRITON_INTERPRET=1`` must be set before this module is imported (Triton reads it when
``triton.jit`` decorates); the tests import it that way to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_hsap.runtime.cpu_attention import _band

__all__ = ["fused_varlen_max_logits"]


@triton.jit
def _larger(a, b):
    """The reduction's combine function (``tl.max`` is a library ``triton.jit`` function, which
    Triton's interpreter runs only when Triton itself was imported under ``TRITON_INTERPRET``)."""
    return tl.maximum(a, b)


@triton.jit
def _max_logits_kernel(q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, out_ptr, sq_t, sq_h, sk_t, sk_h, scale, lo_rel, hi_rel, n_heads,
                       group, n_mtiles, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    seq = tl.program_id(0)
    mt = tl.program_id(1)
    head = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + seq).to(tl.int64)
    lq = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q0
    k0 = tl.load(cu_k_ptr + seq).to(tl.int64)
    lk = tl.load(cu_k_ptr + seq + 1).to(tl.int64) - k0
    off = lk - lq  # bottom-right alignment: row i sees key j iff off + lo_rel <= j - i <= off + hi_rel
    a = mt * BLOCK_M
    rows = a + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < lq
    qv = tl.load(q_ptr + (q0 + rows)[:, None] * sq_t + head * sq_h + dims[None, :],
                 mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)  # fmt: skip
    last = tl.minimum(a + BLOCK_M, lq) - 1  # the tile's last real row
    kstart = tl.full((), 0, tl.int64)
    kend = lk
    if HAS_LO:
        kstart = tl.maximum(a + off + lo_rel, 0)
    if HAS_HI:
        kend = tl.minimum(last + off + hi_rel + 1, lk)
    kend = tl.where(a < lq, kend, kstart)  # (a tile past the sequence scores nothing)
    kvh = head // group
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in range(kstart, kend, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        col_ok = cols < kend
        kt = tl.load(k_ptr + (k0 + cols)[:, None] * sk_t + kvh * sk_h + dims[None, :],
                     mask=col_ok[:, None] & (dims[None, :] < D), other=0.0)  # fmt: skip
        if IEEE:  # fp32 inputs (no TF32), or any inputs upcast first (Triton's interpreter)
            s = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:  # bf16 / fp16 products are exact in the fp32 accumulator
            s = tl.dot(qv, tl.trans(kt))
        ok = row_ok[:, None] & col_ok[None, :]
        diff = cols[None, :] - rows[:, None]
        if HAS_HI:
            ok = ok & (diff <= off + hi_rel)
        if HAS_LO:
            ok = ok & (diff >= off + lo_rel)
        best = tl.maximum(best, tl.reduce(tl.where(ok, s * scale, float("-inf")), 1, _larger))
    tl.store(out_ptr + (seq * n_mtiles + mt) * n_heads + head, tl.reduce(best, 0, _larger))


def fused_varlen_max_logits(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, *, causal: bool,
                            softmax_scale: float, window: tuple[int, int] = (-1, -1)) -> Tensor:  # fmt: skip
    """``max_logits.varlen_max_logits`` of one call in one launch: ``q [tq, h, d]``, ``k [tk, hkv, d]``,
    ``cu_q`` / ``cu_k`` the call's int32 ``cu_seqlens`` on q's device, ``max_q`` its longest q
    sequence -> ``[h]`` float32 (``-inf`` for a head that sees no key)."""
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    lo, hi = _band(0, causal, window)  # (relative to the sequence's offset, as the eager pass's band)
    h, d = q.shape[1], q.shape[2]
    n_seq = cu_q.numel() - 1
    block_d = max(16, triton.next_power_of_2(d))
    block_m, block_n = 64, (64 if block_d <= 128 else 32)
    n_mtiles = max(1, triton.cdiv(max_q, block_m))
    out = torch.full((n_seq * n_mtiles, h), float("-inf"), dtype=torch.float32, device=q.device)
    if n_seq > 0:
        _max_logits_kernel[(n_seq, n_mtiles, h)](
            q, k, cu_q, cu_k, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(softmax_scale),
            0 if lo is None else lo, 0 if hi is None else hi, h, h // k.shape[1], n_mtiles, HAS_LO=lo is not None,
            HAS_HI=hi is not None,
            IEEE=q.dtype == torch.float32 or not q.is_cuda, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n)  # fmt: skip
    return out.amax(dim=0)

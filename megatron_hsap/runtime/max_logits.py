"""Max attention logits per head (qk-clip / MuonClip, ``--qk-clip``, ``--log-max-attention-logit``).

megatron-core's qk-clip reads ``core_attention.current_max_attn_logits``: per q head of the TP rank,
the largest ``softmax_scale · q·k`` over every pair the layer attends (masked pairs and attention
sinks excluded), which Transformer Engine's attention returns (``return_max_logit``, TE >= 2.9; its
unfused backend: ``amax`` of the scaled, masked scores before the sink column); its optimizer step
then takes the MAX over the DP×CP group (``megatron/core/optimizer/qk_clip.py``).

Under SAP every visible pair is computed exactly once in the inter group, and under Ulysses each
intra rank computes its head slice, so a rank's MAX over the pairs of its own kernel calls, with
``-inf`` for heads it does not compute, gives the global value after that MAX reduction. The pass
here is kernel-agnostic: after each forward call the executor recomputes the call's scores tile by
tile with the same masks as the ``cpu`` kernel (``cpu_attention``: bottom-right causal, windows),
in fp32, and keeps their maximum — one more ``q·kᵀ`` over the call's visible pairs (about a
seventh of attention's forward + backward matrix products); no kernel output changes. On a CUDA
device with Triton that pass is one launch per call (``runtime/fused_max_logits.py``; the eager
tiles cost a few launches each, hundreds per layer over many short documents).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_hsap.errors import RuntimeMismatchError
from megatron_hsap.runtime.cpu_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, _band, _rows, _tile_mask, row_tiles

if TYPE_CHECKING:
    from megatron_hsap.runtime.env import EnvSettings
    from megatron_hsap.runtime.prepared import PreparedCall

__all__ = ["Maxima", "call_max_logits", "check_max_logits", "use_fused_max_logits", "varlen_max_logits", "tile_sizes"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Maxima:
    """The accumulator ``out [H]`` float32 handed through ``SAPAttention`` / ``HSAPAttention``
    (wrapped: ``autograd.Function.apply`` would track a tensor argument that forward writes)."""

    out: Tensor


def tile_sizes(device: torch.device) -> tuple[int, int]:
    """(q rows, kv columns) per score tile: the ``cpu`` kernel's on a CPU; larger on a GPU, where
    each tile is a launch (512 × 2048 fp32 scores for 8 heads: 32 MiB)."""
    return (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K) if device.type == "cpu" else (512, 2048)


def varlen_max_logits(q: Tensor, k: Tensor, q_lengths: tuple[int, ...], kv_lengths: tuple[int, ...], *, causal: bool,
                      softmax_scale: float, window: tuple[int, int] = (-1, -1)) -> Tensor:  # fmt: skip
    """``[h]`` float32: per q head, the largest ``softmax_scale · q_i·k_j`` over the visible pairs of
    a varlen call (``q [tq, h, d]``, ``k [tk, hkv, d]``, GQA by ``h // hkv``; sequence ``s`` is
    ``q_lengths[s]`` rows against ``kv_lengths[s]`` keys, host ints, causal bottom-right aligned);
    ``-inf`` for a head that sees no key."""
    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv
    block_q, block_k = tile_sizes(q.device)
    best = torch.full((hkv, g), _NEG_INF, dtype=torch.float32, device=q.device)
    q0 = k0 = 0
    for lq, lk in zip(q_lengths, kv_lengths):
        if lq > 0 and lk > 0:
            lo, hi = _band(lk - lq, causal, window)
            ks = k[k0 : k0 + lk].float().transpose(0, 1)  # [hkv, lk, d]
            for a, b, kstart, kend in row_tiles(lq, lk, lo, hi, block_q):
                n = b - a
                qt = _rows(q, q0 + a, q0 + b, hkv, torch.float32) * softmax_scale  # [hkv, n·g, d]
                for c in range(kstart, kend, block_k):
                    e = min(c + block_k, kend)
                    s = torch.bmm(qt, ks[:, c:e].transpose(1, 2)).view(hkv, n, g, e - c)
                    mask = _tile_mask(a, b, c, e, lo, hi, q.device)
                    if mask is not None:
                        s.masked_fill_(mask.unsqueeze(1), _NEG_INF)
                    torch.maximum(best, s.amax(dim=(1, 3)), out=best)
        q0 += lq
        k0 += lk
    return best.reshape(h)


def use_fused_max_logits(device: torch.device, env: EnvSettings) -> bool:
    """Whether the pass takes one Triton launch per kernel call (``runtime/fused_max_logits.py``):
    a CUDA device, Triton importable (looked up, not imported), ``HSAP_FUSED_MERGE`` not ``0``."""
    return torch.device(device).type == "cuda" and env.fused_merge and importlib.util.find_spec("triton") is not None


def call_max_logits(q: Tensor, k: Tensor, call: PreparedCall, softmax_scale: float, fused: bool) -> Tensor:
    """``[h]`` float32 maxima of one prepared kernel call (its q rows and kv rows as the kernel got
    them): the Triton kernel over the call's device ``cu_seqlens`` when ``fused``, else
    :func:`varlen_max_logits` over its host lengths."""
    if fused:
        from megatron_hsap.runtime.fused_max_logits import fused_varlen_max_logits  # lazy: Triton only when used

        return fused_varlen_max_logits(q, k, call.cu_q, call.cu_k, call.max_q, causal=call.causal,
                                       softmax_scale=softmax_scale, window=call.window)  # fmt: skip
    return varlen_max_logits(q, k, call.call.q_lengths, call.call.kv_lengths, causal=call.causal,
                             softmax_scale=softmax_scale, window=call.window)  # fmt: skip


def check_max_logits(max_logits: object, q: Tensor) -> None:
    """``max_logits`` (``hsap_attn_func``'s accumulator) must be a float32 ``[H]`` tensor on q's
    device; checked before any collective."""
    if max_logits is None:
        return
    if not isinstance(max_logits, Tensor):
        raise RuntimeMismatchError(f"max_logits must be a torch.Tensor of shape [{q.shape[1]}] or None, got {type(max_logits).__name__}")
    if tuple(max_logits.shape) != (q.shape[1],) or max_logits.dtype != torch.float32 or max_logits.device != q.device:
        raise RuntimeMismatchError(
            f"max_logits is a {max_logits.dtype} tensor of shape {tuple(max_logits.shape)} on {max_logits.device}; "
            f"pass torch.full([{q.shape[1]}], -inf, dtype=torch.float32, device=q.device) (one entry per q head "
            "of this rank), updated in place"
        )

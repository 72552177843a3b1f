"""Pure-PyTorch tiled varlen attention, forward and backward: the ``"cpu"`` backend.

It runs on any device (it is only PyTorch ops) and is the numerical reference the GPU
adapters are checked against on a GPU. Memory stays bounded by the tile size: each
sequence of ``cu_seqlens`` is processed in ``block_q × block_k`` tiles with a
flash-style online softmax (forward) and ``P`` recomputed from the given ``lse`` per tile
(backward); no ``T × T`` or per-document ``n × n`` tensor is ever built.

Conventions (shared with :mod:`megatron_hsap.runtime.kernels`):

* ``q [tq, h, d]``, ``k [tk, hkv, d]``, ``v [tk, hkv, dv]``; ``h % hkv == 0`` (GQA/MQA: query
  head ``i`` uses kv head ``i // (h // hkv)``); ``dv`` may differ from ``d``.
* causal is bottom-right aligned per sequence: with lengths ``(lq, lk)`` query ``i`` sees key
  ``j`` iff ``j <= i + lk - lq``. Rows that see no key get ``out = 0`` and ``lse = -inf``.
* ``window=(left, right)`` (flash-attn's sliding window, same alignment; -1: unbounded side)
  further restricts query ``i`` to keys ``i + lk - lq - left <= j <= i + lk - lq + right``; only
  the key tiles inside the band are computed (work per block, never ``T × T``).
* math in float64 for float64 inputs, else float32 (bf16/fp16 inputs are upcast per tile).
* ``dropout`` (:class:`~megatron_hsap.runtime.dropout.Dropout`): each probability kept by
  :func:`~megatron_hsap.runtime.dropout.keep_mask` of its global q head, q token (``q_pos``) and
  k token (``k_pos``), scaled by ``1/(1-p)``; the LSE stays the undropped one (as flash-attn's),
  and backward redraws the same mask from the same coordinates.

GQA is handled by folding the ``g = h // hkv`` query heads of one kv head into the rows of a
batched matmul (``[hkv, rows·g, d] @ [hkv, d, keys]``), so kv is never repeated in memory and
``dk``/``dv`` come out already summed over the group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_hsap.runtime.dropout import Dropout, keep_mask

__all__ = ["DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K", "varlen_forward", "varlen_backward"]

# Tile sizes: a 128 × 512 fp32 score tile for 8 heads is 2 MiB. On one core (8K causal doc,
# h 8, d 64) it ran within noise of 256 × 1024 (~6.5M pairs/s forward+backward, CPU time)
# at a quarter of the temporary memory; 64 × 256 was ~15% slower.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512

_NEG_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequences(cu_q: Tensor, cu_k: Tensor) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(q_start, lq, k_start, lk)`` per non-empty sequence (host lists, one sync)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq > 0 and lk > 0:
            yield cq[i], lq, ck[i], lk


def _band(offset: int, causal: bool, window: tuple[int, int]) -> tuple[int | None, int | None]:
    """``(lo, hi)``: row ``i`` sees key ``j`` iff ``lo <= j - i <= hi`` (None: unbounded)."""
    left, right = window
    hi = offset if causal else None
    if right >= 0:
        hi = offset + right if hi is None else min(hi, offset + right)
    lo = offset - left if left >= 0 else None
    return lo, hi


def _key_span(a: int, b: int, lk: int, lo: int | None, hi: int | None) -> tuple[int, int]:
    """``[start, end)`` of the keys any of the rows ``[a, b)`` may see (empty: start >= end)."""
    start = 0 if lo is None else max(0, a + lo)
    end = lk if hi is None else max(0, min(lk, b - 1 + hi + 1))
    return start, end


def row_tiles(lq: int, lk: int, lo: int | None, hi: int | None, block_q: int) -> Iterator[tuple[int, int, int, int]]:
    """``(a, b, kstart, kend)``: the row tiles ``[a, b)`` of one sequence (``lq`` rows, ``lk`` keys,
    band ``(lo, hi)`` of :func:`_band`) and the keys ``[kstart, kend)`` any of their rows may see;
    tiles that see no key are skipped."""
    for a in range(0, lq, block_q):
        b = min(a + block_q, lq)
        kstart, kend = _key_span(a, b, lk, lo, hi)
        if kstart < kend:
            yield a, b, kstart, kend


def _tile_mask(a: int, b: int, c: int, e: int, lo: int | None, hi: int | None, device: torch.device) -> Tensor | None:
    """``[b - a, e - c]`` bool, True where key ``j`` lies outside row ``i``'s band; None when the
    whole tile lies inside it."""
    above = hi is not None and (e - 1) - a > hi  # some key after some row's diagonal
    below = lo is not None and c - (b - 1) < lo  # some key older than some row's window
    if not (above or below):
        return None
    rows = torch.arange(a, b, device=device).unsqueeze(1)
    cols = torch.arange(c, e, device=device).unsqueeze(0)
    diff = cols - rows
    mask = torch.zeros((b - a, e - c), dtype=torch.bool, device=device)
    if above:
        mask |= diff > hi
    if below:
        mask |= diff < lo
    return mask


def _rows(x: Tensor, start: int, stop: int, hkv: int, dtype: torch.dtype) -> Tensor:
    """Token rows ``[start, stop)`` of ``[t, h, f]`` as ``[hkv, (stop-start)·g, f]`` (a copy)."""
    n, h, f = stop - start, x.shape[1], x.shape[2]
    y = x[start:stop].to(dtype).reshape(n, hkv, h // hkv, f).transpose(0, 1)
    return y.reshape(hkv, n * (h // hkv), f)


def _rows_vec(x: Tensor, start: int, stop: int, hkv: int, dtype: torch.dtype) -> Tensor:
    """Token rows ``[start, stop)`` of ``[t, h]`` as ``[hkv, (stop-start)·g]``."""
    n, h = stop - start, x.shape[1]
    return x[start:stop].to(dtype).reshape(n, hkv, h // hkv).transpose(0, 1).reshape(hkv, -1)


def _unrows(y: Tensor, n: int, h: int) -> Tensor:
    """Inverse of :func:`_rows`: ``[hkv, n·g, f]`` -> ``[n, h, f]``; ``[hkv, n·g]`` -> ``[n, h]``."""
    hkv = y.shape[0]
    tail = y.shape[2:]
    return y.reshape(hkv, n, h // hkv, *tail).transpose(0, 1).reshape(n, h, *tail)


class _Masks:
    """The dropout keep-masks of one call's tiles, ``[hkv, n·g, m]`` in the tiles' row order, scaled
    by ``1/(1-p)`` (None without dropout)."""

    __slots__ = ("drop", "heads", "q_pos", "k_pos", "hkv", "g", "scale", "dtype")

    def __init__(self, drop: Dropout | None, h: int, hkv: int, q: Tensor, k: Tensor, q_pos: Tensor | None,
                 k_pos: Tensor | None, dtype: torch.dtype) -> None:
        self.drop = drop if drop is not None and drop.p > 0 else None
        if self.drop is None:
            return
        dev = q.device
        self.heads = torch.arange(h, device=dev) + self.drop.head_offset
        self.q_pos = torch.arange(q.shape[0], device=dev) if q_pos is None else q_pos.to(dev)
        self.k_pos = torch.arange(k.shape[0], device=dev) if k_pos is None else k_pos.to(dev)
        self.hkv, self.g, self.scale, self.dtype = hkv, h // hkv, 1.0 / (1.0 - self.drop.p), dtype

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
        """Call rows ``[r0, r1)`` × call keys ``[c0, c1)``: ``[hkv, n·g, c1-c0]`` of 0 or ``1/(1-p)``."""
        if self.drop is None:
            return None
        keep = keep_mask(self.drop.seed, self.drop.p, self.heads, self.q_pos[r0:r1], self.k_pos[c0:c1])  # [h, n, m]
        n, m = r1 - r0, c1 - c0
        keep = keep.view(self.hkv, self.g, n, m).transpose(1, 2).reshape(self.hkv, n * self.g, m)
        return keep.to(self.dtype) * self.scale


def varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    dropout: Dropout | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Varlen attention forward.

    Returns ``out [tq, h, dv]`` in ``q.dtype`` and ``lse [tq, h]`` (natural log; float32, or
    float64 for float64 inputs). Rows not covered by ``cu_seqlens_q`` or seeing no key get
    ``out = 0``, ``lse = -inf``. ``dropout``: see the module docstring; ``q_pos [tq]`` / ``k_pos
    [tk]`` the rows' global token indices (default: their row numbers).
    """
    tq, h, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = h // hkv
    cdt = _compute_dtype(q.dtype)
    masks = _Masks(dropout, h, hkv, q, k, q_pos, k_pos, cdt)
    out = torch.zeros((tq, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.full((tq, h), _NEG_INF, dtype=cdt, device=q.device)

    for q0, lq, k0, lk in _sequences(cu_seqlens_q, cu_seqlens_k):
        lo, hi = _band(lk - lq, causal, window)
        ks = k[k0 : k0 + lk].to(cdt).transpose(0, 1).contiguous()  # [hkv, lk, d]
        vs = v[k0 : k0 + lk].to(cdt).transpose(0, 1).contiguous()  # [hkv, lk, dv]
        for a, b, kstart, kend in row_tiles(lq, lk, lo, hi, block_q):  # (rows seeing no key: stay 0 / -inf)
            n = b - a
            qt = _rows(q, q0 + a, q0 + b, hkv, cdt) * softmax_scale  # [hkv, n·g, d]
            m = torch.full((hkv, n * g), _NEG_INF, dtype=cdt, device=q.device)
            l = torch.zeros((hkv, n * g), dtype=cdt, device=q.device)
            acc = torch.zeros((hkv, n * g, dv), dtype=cdt, device=q.device)
            for c in range(kstart, kend, block_k):
                e = min(c + block_k, kend)
                s = torch.bmm(qt, ks[:, c:e].transpose(1, 2))  # [hkv, n·g, e-c]
                mask = _tile_mask(a, b, c, e, lo, hi, q.device)
                if mask is not None:  # tile crosses the diagonal or the window's edge
                    s.view(hkv, n, g, e - c).masked_fill_(mask.unsqueeze(1), _NEG_INF)
                m_new = torch.maximum(m, s.amax(dim=-1))
                # A row that has seen only masked keys keeps m = -inf; shift it by 0 instead.
                m_use = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                p = s.sub_(m_use.unsqueeze(-1)).exp_()
                alpha = torch.exp(m - m_use)
                l.mul_(alpha).add_(p.sum(dim=-1))  # the undropped normaliser: the LSE a kernel returns
                keep = masks.tile(q0 + a, q0 + b, k0 + c, k0 + e)
                acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p if keep is None else p * keep, vs[:, c:e])
                m = m_new
            seen = l > 0
            acc.div_(torch.where(seen, l, torch.ones_like(l)).unsqueeze(-1))
            lse_t = torch.where(seen, m + torch.log(l), torch.full_like(l, _NEG_INF))
            out[q0 + a : q0 + b] = _unrows(acc, n, h)
            lse[q0 + a : q0 + b] = _unrows(lse_t, n, h)
    if cdt != torch.float64:
        lse = lse.float()
    return out, lse


def varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    dropout: Dropout | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen attention backward with the *given* ``lse`` and ``delta`` (those of the final,
    merged output of these rows), so the partial gradients of disjoint key blocks sum to the
    full gradient.

    Args:
        dout: ``[tq, h, dv]``; lse, delta: ``[tq, h]`` (``delta = rowsum(dout ∘ out_final)``).
        dropout / q_pos / k_pos: as the forward got them (the same masks are redrawn).
    Returns:
        ``dq [tq, h, d]``, ``dk [tk, hkv, d]``, ``dv [tk, hkv, dv]`` in float32 (float64 for
        float64 inputs).
    """
    tq, h, d = q.shape
    tk, hkv, dv = v.shape
    g = h // hkv
    cdt = _compute_dtype(q.dtype)
    dq = torch.zeros((tq, h, d), dtype=cdt, device=q.device)
    dk = torch.zeros((tk, hkv, d), dtype=cdt, device=q.device)
    dvv = torch.zeros((tk, hkv, dv), dtype=cdt, device=q.device)
    masks = _Masks(dropout, h, hkv, q, k, q_pos, k_pos, cdt)

    for q0, lq, k0, lk in _sequences(cu_seqlens_q, cu_seqlens_k):
        lo, hi = _band(lk - lq, causal, window)
        ks = k[k0 : k0 + lk].to(cdt).transpose(0, 1).contiguous()  # [hkv, lk, d]
        vs = v[k0 : k0 + lk].to(cdt).transpose(0, 1).contiguous()  # [hkv, lk, dv]
        dks = torch.zeros_like(ks)
        dvs = torch.zeros_like(vs)
        for a, b, kstart, kend in row_tiles(lq, lk, lo, hi, block_q):
            n = b - a
            qt = _rows(q, q0 + a, q0 + b, hkv, cdt)  # [hkv, n·g, d]
            qts = qt * softmax_scale
            dot = _rows(dout, q0 + a, q0 + b, hkv, cdt)  # [hkv, n·g, dv]
            lse_t = _rows_vec(lse, q0 + a, q0 + b, hkv, cdt)
            # A row with final lse = -inf saw no key anywhere: +inf makes its P exactly 0.
            lse_t = lse_t.masked_fill(lse_t == _NEG_INF, float("inf")).unsqueeze(-1)
            delta_t = _rows_vec(delta, q0 + a, q0 + b, hkv, cdt).unsqueeze(-1)
            dqt = torch.zeros_like(qt)
            for c in range(kstart, kend, block_k):
                e = min(c + block_k, kend)
                kt, vt = ks[:, c:e], vs[:, c:e]
                s = torch.bmm(qts, kt.transpose(1, 2))  # [hkv, n·g, e-c]
                mask = _tile_mask(a, b, c, e, lo, hi, q.device)
                if mask is not None:
                    s.view(hkv, n, g, e - c).masked_fill_(mask.unsqueeze(1), _NEG_INF)
                p = s.sub_(lse_t).exp_()  # P from the final lse
                keep = masks.tile(q0 + a, q0 + b, k0 + c, k0 + e)
                dvs[:, c:e].baddbmm_((p if keep is None else p * keep).transpose(1, 2), dot)
                dp = torch.bmm(dot, vt.transpose(1, 2))
                if keep is not None:
                    dp.mul_(keep)  # dP through the mask; δ = rowsum(dO∘O) is unchanged by dropout
                ds = dp.sub_(delta_t).mul_(p)  # dS = P∘(dP-δ)
                dqt.baddbmm_(ds, kt)
                dks[:, c:e].baddbmm_(ds.transpose(1, 2), qt)
            dq[q0 + a : q0 + b] = _unrows(dqt.mul_(softmax_scale), n, h)
        dk[k0 : k0 + lk] = dks.mul_(softmax_scale).transpose(0, 1)
        dvv[k0 : k0 + lk] = dvs.transpose(0, 1)
    return dq, dk, dvv

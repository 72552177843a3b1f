"""Executed Llama-3-style all-gather-KV baseline (docs/design.md §4), on the same kernels as HSAP.

Contiguous layout (T padded to a multiple of P at the end, rank r holds ``[rL, (r+1)L)`` — the
same layout as HSAP's contiguous plans, owner computes, no balancing). Forward: all-gather K and V,
then one varlen call: each of my document pieces attends its document's keys up to its last row
(bottom-right causal). Backward: all-gather K and V again (as TE's all-gather CP does), one varlen
backward, then a reduce-scatter of dK and dV in the activation dtype. Compute waits for the
collectives (no overlap).

Bytes "sent" for a collective are its ring-algorithm volume: an all-gather sends (P−1)·L rows per
rank, a reduce-scatter (P−1)·L rows (what NCCL's ring moves; gloo's own algorithm may differ).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.runtime.executor import PhaseStats
from megatron_hsap.runtime.kernels import attn_backward, attn_forward

__all__ = ["AllGatherKVAttention", "contiguous_indices"]

_F32 = torch.float32
# torch >= 2.13 renamed the tensor collectives (the old names warn); use whichever exists
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def contiguous_indices(cu_seqlens: object, world: int, rank: int) -> np.ndarray:
    """Global ids rank ``rank`` holds: ``[rL, (r+1)L)`` with ``L = ceil(T/P)`` (ids ≥ T: padding)."""
    total = normalize_cu_seqlens(cu_seqlens)[-1]
    chunk = -(-total // world)
    return np.arange(rank * chunk, (rank + 1) * chunk, dtype=np.int64)


class AllGatherKVAttention:
    """All-gather KV over ``group`` for one batch; ``stats[phase]`` as the HSAP executor's."""

    def __init__(self, cu_seqlens: object, group: dist.ProcessGroup | None, device: torch.device | str,
                 *, backend: str | None = "cpu") -> None:  # fmt: skip
        cu = list(normalize_cu_seqlens(cu_seqlens))
        self.group, self.backend, self.device = group, backend, torch.device(device)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        total = cu[-1]
        self.chunk = -(-total // self.world)
        padded = self.chunk * self.world
        if padded > total:
            cu.append(padded)  # the tail padding is one extra document
        lo, hi = self.rank * self.chunk, (self.rank + 1) * self.chunk
        lq, lk = [], []
        for a, b in zip(cu[:-1], cu[1:]):
            qa, qb = max(a, lo), min(b, hi)
            if qb > qa:
                lq.append(qb - qa)
                lk.append(qb - a)  # keys of the document up to my last row
        self.kv_start = max(a for a in cu[:-1] if a <= lo) if lo < padded else lo
        self.kv_stop = hi
        to = lambda xs: torch.tensor(np.concatenate(([0], np.cumsum(xs))), dtype=torch.int32, device=self.device)  # noqa: E731
        self.cu_q, self.cu_k = to(lq), to(lk)
        self.max_q, self.max_k = max(lq), max(lk)
        if self.cu_k[-1].item() != self.kv_stop - self.kv_start:
            raise ConfigError("internal: all-gather key ranges are not contiguous")
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}

    def _gather(self, x: Tensor, st: PhaseStats) -> Tensor:
        full = torch.empty((x.shape[0] * self.world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        t0 = time.perf_counter()
        _all_gather(full, x.contiguous(), group=self.group)
        st.comm_s += time.perf_counter() - t0
        nbytes = x.numel() * x.element_size() * (self.world - 1)
        st.bytes_sent += nbytes
        st.bytes_recv += nbytes
        return full

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """``q [L, h, d]``, ``k``/``v [L, hkv, d|dv]`` -> ``out [L, h, dv]`` fp32, ``lse [L, h]``."""
        t0 = time.perf_counter()
        st = self.stats[Phase.FWD]
        kf, vf = self._gather(k, st), self._gather(v, st)
        c0 = time.perf_counter()
        sl = slice(self.kv_start, self.kv_stop)
        out, lse = attn_forward(q, kf[sl], vf[sl], cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                                max_seqlen_q=self.max_q, max_seqlen_k=self.max_k, causal=True,
                                softmax_scale=scale, backend=self.backend)  # fmt: skip
        st.compute_s += time.perf_counter() - c0
        st.calls += 1
        st.wall_s += time.perf_counter() - t0
        return out.float(), lse

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        t0 = time.perf_counter()
        st = self.stats[Phase.BWD]
        kf, vf = self._gather(k, st), self._gather(v, st)
        c0 = time.perf_counter()
        sl = slice(self.kv_start, self.kv_stop)
        do, out = do.to(q.dtype), out.to(q.dtype)
        delta = (do.float() * out.float()).sum(dim=-1)
        dq, dk_part, dv_part = attn_backward(do, q, kf[sl], vf[sl], out, lse, cu_seqlens_q=self.cu_q,
                                             cu_seqlens_k=self.cu_k, max_seqlen_q=self.max_q,
                                             max_seqlen_k=self.max_k, causal=True, softmax_scale=scale,
                                             delta=delta, backend=self.backend)  # fmt: skip
        dk_full = torch.zeros(kf.shape, dtype=k.dtype, device=k.device)  # activation dtype, as TE
        dv_full = torch.zeros(vf.shape, dtype=v.dtype, device=v.device)
        dk_full[sl] = dk_part.to(k.dtype)
        dv_full[sl] = dv_part.to(v.dtype)
        st.compute_s += time.perf_counter() - c0
        grads = []
        for full, like in ((dk_full, k), (dv_full, v)):
            mine = torch.empty_like(like)
            r0 = time.perf_counter()
            _reduce_scatter(mine, full, group=self.group)
            st.comm_s += time.perf_counter() - r0
            nbytes = like.numel() * like.element_size() * (self.world - 1)
            st.bytes_sent += nbytes
            st.bytes_recv += nbytes
            grads.append(mine.float())
        st.calls += 1
        st.wall_s += time.perf_counter() - t0
        return dq, grads[0], grads[1]

    def reset_stats(self) -> None:
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}

"""Executed baselines in Transformer Engine's style, on the same kernels as HSAP (docs/design.md §4):

* **THD ring** (``AttnFuncWithCPAndKVP2P``, ``cp_comm_type="p2p"``): every document padded to a
  multiple of 2·P and cut into 2P chunks; rank r holds chunks r and 2P−1−r of every document
  (zigzag). Forward: P steps; at step i rank r holds the KV of rank r−i and computes its q chunks
  against those kv chunks (chunk b < a: dense rectangle, b = a: causal diagonal, b > a: nothing)
  while the whole local KV moves one hop (P−1 rounds). Backward: the KV ring again, with dKV
  following one step behind (TE's schedule: (P−1) KV and (P−1) dKV hops; dKV in the activation
  dtype, as TE allocates it like KV). Received KV is double-buffered — *leaner* than TE, which
  keeps every step's KV, output and LSE until the forward ends.
* **a2a+p2p** (TE's hierarchical CP): Ulysses all-to-all inside the intra group, then the THD
  ring over the inter group on the head slice; document-blind (documents padded to 2·P_inter·P_intra).

Every P2P round goes through :class:`~megatron_hsap.runtime.p2p.P2PChannel` (same timeout, same
byte counting as HSAP's executor); outputs are merged in fp32 with the same LSE merge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.runtime.env import read_env
from megatron_hsap.runtime.executor import PhaseStats
from megatron_hsap.runtime.kernels import attn_backward, attn_forward
from megatron_hsap.runtime.merge import merge_into, use_fused_merge
from megatron_hsap.runtime.p2p import P2PChannel, Transfer, warm_up
from megatron_hsap.runtime.ulysses import expand_kv_for_intra, heads_to_seq, seq_to_heads, sum_kv_grad_for_intra

__all__ = ["ZigzagLayout", "RingAttention", "A2AP2PAttention"]

_F32 = torch.float32


@dataclass(frozen=True, slots=True)
class ZigzagLayout:
    """TE's THD layout for a ring of ``ring`` ranks whose rows are then split over ``intra`` ranks.

    ``chunk[d]`` = tokens per chunk of document d (its length padded to a multiple of
    2·ring·intra, over 2·ring). Ring rank r holds, per document in order, chunk r then chunk
    2·ring−1−r; intra rank j holds the j-th of ``intra`` equal slices of those rows.
    """

    cu: tuple[int, ...]
    ring: int
    intra: int
    chunk: tuple[int, ...]

    @classmethod
    def build(cls, cu_seqlens: object, ring: int, intra: int = 1) -> "ZigzagLayout":
        cu = normalize_cu_seqlens(cu_seqlens)
        lengths = np.diff(np.asarray(cu, dtype=np.int64))
        lengths = lengths[lengths > 0]
        mult = 2 * ring * intra
        padded = -(-lengths // mult) * mult
        return cls(cu=cu, ring=ring, intra=intra, chunk=tuple(int(x) for x in padded // (2 * ring)))

    @property
    def ring_tokens(self) -> int:
        """Rows each ring rank holds (its node's rows, after the intra all-to-all)."""
        return 2 * sum(self.chunk)

    @property
    def local_tokens(self) -> int:
        return self.ring_tokens // self.intra

    @property
    def pad_tokens(self) -> int:
        return self.ring_tokens * self.ring - self.cu[-1]

    def ring_token_indices(self, r: int) -> np.ndarray:
        """Global token ids of ring rank ``r``'s rows in local order; -1 marks per-document padding."""
        starts = [a for a, b in zip(self.cu[:-1], self.cu[1:]) if b > a]
        ends = [b for a, b in zip(self.cu[:-1], self.cu[1:]) if b > a]
        out = []
        for a, b, c in zip(starts, ends, self.chunk):
            for chunk in (r, 2 * self.ring - 1 - r):
                ids = np.arange(a + chunk * c, a + (chunk + 1) * c, dtype=np.int64)
                out.append(np.where(ids < b, ids, -1))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def local_token_indices(self, cp_rank: int) -> np.ndarray:
        """Ids of CP rank ``cp_rank = i·intra + j`` (ring rank i, intra rank j); -1 = padding."""
        i, j = divmod(cp_rank, self.intra)
        n = self.local_tokens
        return self.ring_token_indices(i)[j * n : (j + 1) * n]


def _pair_seqlens(chunk: tuple[int, ...], s: int, u: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """cu_seqlens pairing q slot ``s`` with kv slot ``u`` of every document over the whole local
    rows ``[d0 s0, d0 s1, d1 s0, ...]``: sequences with no q or no kv rows skip the others."""
    lq, lk = [], []
    for c in chunk:
        pattern = {(0, 0): [(c, c), (c, 0), (0, c)], (0, 1): [(0, c), (c, c), (c, 0)],
                   (1, 0): [(c, 0), (c, c), (0, c)], (1, 1): [(c, 0), (0, c), (c, c)]}[(s, u)]  # fmt: skip
        for a, b in pattern:
            lq.append(a)
            lk.append(b)
    cq = torch.tensor(np.concatenate(([0], np.cumsum(lq))), dtype=torch.int32, device=device)
    ck = torch.tensor(np.concatenate(([0], np.cumsum(lk))), dtype=torch.int32, device=device)
    return cq, ck, max(chunk, default=1)


def _recv_buffers(k: Tensor, v: Tensor, ring: int) -> list[tuple[Tensor, Tensor]]:
    """Two (k, v) receive buffers used alternately: step i receives into buffer i % 2 while it
    computes on (and forwards) what arrived at step i − 1."""
    return [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, ring - 1))]


class RingAttention:
    """The THD ring over ``group`` for one ``ZigzagLayout`` (its ``ring`` = the group size)."""

    def __init__(self, layout: ZigzagLayout, group: dist.ProcessGroup | None, device: torch.device | str,
                 *, backend: str | None = "cpu") -> None:  # fmt: skip
        self.layout, self.group, self.device = layout, group, torch.device(device)
        size = dist.get_world_size(group) if layout.ring > 1 else 1
        if size != layout.ring:
            raise ConfigError(f"ring layout for {layout.ring} ranks but the group has {size}")
        self.rank = dist.get_rank(group) if layout.ring > 1 else 0
        self.backend = backend
        env = read_env()
        self.timeout_s = env.p2p_timeout_s
        self.fused_merge = use_fused_merge(self.device, env)  # TE fuses its correction too (thd_out_correction)
        self.seqlens = {(s, u): _pair_seqlens(layout.chunk, s, u, self.device) for s in (0, 1) for u in (0, 1)}
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}

    def _pairs(self, src: int) -> list[tuple[tuple[Tensor, Tensor, int], bool]]:
        """(seqlens, causal) of the (q slot, kv slot) pairs that attend at this step."""
        p, r = self.layout.ring, self.rank
        q_chunks, kv_chunks = (r, 2 * p - 1 - r), (src, 2 * p - 1 - src)
        out = []
        for s in (0, 1):
            for u in (0, 1):
                if kv_chunks[u] <= q_chunks[s]:
                    out.append((self.seqlens[(s, u)], kv_chunks[u] == q_chunks[s]))
        return out

    def _peers(self) -> tuple[int, int]:
        p = self.layout.ring
        return (self.rank + 1) % p, (self.rank - 1) % p

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Local rows ``q [t, h, d]``, ``k``/``v [t, hkv, d|dv]`` -> fp32 ``out [t, h, dv]``, ``lse [t, h]``."""
        t0 = time.perf_counter()
        p, (nxt, prv) = self.layout.ring, self._peers()
        if p > 1:
            warm_up(self.group, q.device)
        chan = P2PChannel(self.group, timeout_s=self.timeout_s, phase=Phase.FWD)
        out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=_F32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=_F32, device=q.device)
        cur = (k.contiguous(), v.contiguous())
        bufs = _recv_buffers(k, v, p)  # never receive into the caller's k, v
        compute = 0.0
        for i in range(p):
            if i < p - 1:
                spare = bufs[i % 2]
                chan.post(i, [Transfer(True, cur[0], nxt, "k"), Transfer(True, cur[1], nxt, "v"),
                              Transfer(False, spare[0], prv, "k"), Transfer(False, spare[1], prv, "v")])  # fmt: skip
            c0 = time.perf_counter()
            for (cq, ck, mx), causal in self._pairs((self.rank - i) % p):
                o, l = attn_forward(q, cur[0], cur[1], cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mx,
                                    max_seqlen_k=mx, causal=causal, softmax_scale=scale, backend=self.backend)  # fmt: skip
                merge_into(out, lse, o, l, fused=self.fused_merge)
            compute += time.perf_counter() - c0
            if i < p - 1:
                chan.wait(i)
                cur = spare
        chan.close()
        self._record(Phase.FWD, chan, compute, t0)
        return out, lse

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """fp32 ``dq``, ``dk``, ``dv`` of the local rows (``out`` the final output, ``lse`` fp32)."""
        t0 = time.perf_counter()
        p, (nxt, prv) = self.layout.ring, self._peers()
        chan = P2PChannel(self.group, timeout_s=self.timeout_s, phase=Phase.BWD)
        do, out = do.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        delta = (do.float() * out.float()).sum(dim=-1)
        dq = torch.zeros(q.shape, dtype=_F32, device=q.device)
        cur = (k.contiguous(), v.contiguous())
        bufs = _recv_buffers(k, v, p)
        own = carry = incoming = None
        compute = 0.0
        for i in range(p):
            ops = []
            if i < p - 1:
                spare = bufs[i % 2]
                ops += [Transfer(True, cur[0], nxt, "k"), Transfer(True, cur[1], nxt, "v"),
                        Transfer(False, spare[0], prv, "k"), Transfer(False, spare[1], prv, "v")]  # fmt: skip
            if i >= 2:  # dKV of the previous step moves on; the one for my current KV arrives
                incoming = (torch.empty_like(k), torch.empty_like(v))
                ops += [Transfer(True, carry[0], nxt, "dk"), Transfer(True, carry[1], nxt, "dv"),
                        Transfer(False, incoming[0], prv, "dk"), Transfer(False, incoming[1], prv, "dv")]  # fmt: skip
            if ops:
                chan.post(i, ops)
            c0 = time.perf_counter()
            part_k = torch.zeros(k.shape, dtype=_F32, device=q.device)
            part_v = torch.zeros(v.shape, dtype=_F32, device=q.device)
            for (cq, ck, mx), causal in self._pairs((self.rank - i) % p):
                gq, gk, gv = attn_backward(do, q, cur[0], cur[1], out, lse, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                           max_seqlen_q=mx, max_seqlen_k=mx, causal=causal, softmax_scale=scale,
                                           delta=delta, backend=self.backend)  # fmt: skip
                dq += gq
                part_k += gk
                part_v += gv
            compute += time.perf_counter() - c0
            if ops:
                chan.wait(i)
            if i == 0:
                own = (part_k, part_v)
            else:
                if i >= 2:
                    part_k += incoming[0].float()
                    part_v += incoming[1].float()
                carry = (part_k.to(k.dtype), part_v.to(v.dtype))  # TE sends dKV like KV
            if i < p - 1:
                cur = spare
        dk, dv = own
        if p > 1:  # the last hop: every dKV reaches its owner
            final = (torch.empty_like(k), torch.empty_like(v))
            chan.post(p, [Transfer(True, carry[0], nxt, "dk"), Transfer(True, carry[1], nxt, "dv"),
                          Transfer(False, final[0], prv, "dk"), Transfer(False, final[1], prv, "dv")])  # fmt: skip
            chan.wait(p)
            dk, dv = dk + final[0].float(), dv + final[1].float()
        chan.close()
        self._record(Phase.BWD, chan, compute, t0)
        return dq, dk, dv

    def _record(self, phase: Phase, chan: P2PChannel, compute: float, t0: float) -> None:
        st = self.stats[phase]
        st.calls += 1
        st.bytes_sent += chan.bytes_sent
        st.bytes_recv += chan.bytes_recv
        st.compute_s += compute
        st.comm_s += chan.comm_s
        st.wall_s += time.perf_counter() - t0

    def reset_stats(self) -> None:
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}


class A2AP2PAttention:
    """TE-style a2a+p2p: Ulysses over ``intra``, the THD ring over ``inter`` on the head slice.

    ``a2a_bytes_sent[phase]`` counts the intra bytes (same volume as Ulysses' all-to-all)."""

    def __init__(self, layout: ZigzagLayout, intra: dist.ProcessGroup | None, inter: dist.ProcessGroup | None,
                 device: torch.device | str, *, backend: str | None = "cpu") -> None:  # fmt: skip
        self.layout, self.intra = layout, intra
        self.ring = RingAttention(layout, inter, device, backend=backend)
        self.a2a_bytes_sent = {Phase.FWD: 0, Phase.BWD: 0}
        self.a2a_s = 0.0

    def _a2a(self, x: Tensor, phase: Phase, to_heads: bool) -> Tensor:
        p = self.layout.intra
        if p == 1:
            return x
        t0 = time.perf_counter()
        self.a2a_bytes_sent[phase] += x.numel() * x.element_size() * (p - 1) // p
        out = seq_to_heads(x.contiguous(), self.intra) if to_heads else heads_to_seq(x.contiguous(), self.intra)
        self.a2a_s += time.perf_counter() - t0
        return out

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, tuple]:
        """Local ``[t, H, d]`` rows -> ``out [t, H, dv]`` (activation dtype) and what backward needs."""
        p = self.layout.intra
        qh = self._a2a(q, Phase.FWD, True)
        kh = self._a2a(expand_kv_for_intra(k, p), Phase.FWD, True)
        vh = self._a2a(expand_kv_for_intra(v, p), Phase.FWD, True)
        oh, lse = self.ring.forward(qh, kh, vh, scale)
        oh = oh.to(q.dtype)
        return self._a2a(oh, Phase.FWD, False), (qh, kh, vh, oh, lse, k.shape[1])

    def backward(self, do: Tensor, saved: tuple, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        qh, kh, vh, oh, lse, hkv = saved
        doh = self._a2a(do.to(oh.dtype), Phase.BWD, True)
        dq, dk, dv = self.ring.backward(doh, qh, kh, vh, oh, lse, scale)
        dq = self._a2a(dq.to(qh.dtype), Phase.BWD, False)
        dk = sum_kv_grad_for_intra(self._a2a(dk.to(kh.dtype), Phase.BWD, False).float(), hkv)
        dv = sum_kv_grad_for_intra(self._a2a(dv.to(vh.dtype), Phase.BWD, False).float(), hkv)
        return dq, dk, dv

    def reset_stats(self) -> None:
        self.ring.reset_stats()
        self.a2a_bytes_sent = {Phase.FWD: 0, Phase.BWD: 0}
        self.a2a_s = 0.0

"""The methods the CPU attention benchmark runs, behind one small interface.

Each method owns its layout (which rows a rank holds), runs one forward + backward per
:meth:`Method.step`, and reports what that step moved and spent, per link class: ``inter``
(the P2P / ring group across nodes) and ``intra`` (the all-to-all group inside a node), with
``predicted`` bytes from an independent source (the plan for SAP/HSAP/Ulysses, ``ulysses_bytes``
for the all-to-all, the planner's baseline pricing for the ring and all-gather KV) so the
benchmark can assert that what was counted is what was expected, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from megatron_hsap.bench.allgather_baseline import AllGatherKVAttention
from megatron_hsap.bench.ring_baseline import A2AP2PAttention, RingAttention, ZigzagLayout
from megatron_hsap.baselines.flat import price_baseline
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import A100, LinkClass
from megatron_hsap.plan.ir import Phase

__all__ = ["Counters", "Method", "HSAPMethod", "RingMethod", "AllGatherMethod", "A2AP2PMethod"]


@dataclass(frozen=True, slots=True)
class Counters:
    """One step of one rank: bytes sent per link class, host seconds computing / communicating."""

    inter_bytes: int
    intra_bytes: int
    compute_s: float
    comm_s: float


class Method:
    """Interface: ``name``, ``topology`` (intra, inter), ``local_tokens``, ``step``, ``counters``."""

    name = ""
    topology = (1, 1)
    local_tokens = 0
    persistent_bytes = 0  # buffers allocated once outside a step (HSAP's receive pool)

    def step(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> None:
        raise NotImplementedError

    def counters(self) -> Counters:
        raise NotImplementedError

    def predicted(self) -> tuple[int | None, int | None]:
        """(inter, intra) bytes this rank should send per step; None when not predicted."""
        return None, None

    def predicted_peak(self) -> int | None:
        """Bytes the method's own model says it holds at its peak (HSAP: ``plan.peak_bytes``)."""
        return None


class HSAPMethod(Method):
    """``hsap_attn_func`` with autograd: SAP (1×P), HSAP (P_intra×P_inter) or Ulysses (P×1)."""

    def __init__(self, plan: Any, intra: Any, inter: Any, cp_rank: int) -> None:
        from megatron_hsap.runtime.hsap import runner_for

        self.plan, self.intra, self.inter = plan, intra, inter
        self.topology = (plan.intra_size, plan.inter_size)
        self.name = "sap" if plan.intra_size == 1 else ("ulysses" if plan.inter_size == 1 else "hsap")
        self.local_tokens = plan.local_tokens
        self.runner = runner_for(plan, intra_group=intra, inter_group=inter, device="cpu")
        self.persistent_bytes = plan.pool_capacity if plan.inter_size > 1 else 0
        self.cp_rank = cp_rank

    def step(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> None:
        from megatron_hsap.runtime import hsap_attn_func

        self.runner.reset_stats()
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = hsap_attn_func(*leaves, self.plan, intra_group=self.intra, inter_group=self.inter, softmax_scale=scale)
        out.backward(do)

    def counters(self) -> Counters:
        st = self.runner.executor.stats
        a2a = self.runner.a2a_bytes_sent
        return Counters(
            inter_bytes=sum(s.bytes_sent for s in st.values()),
            intra_bytes=a2a[Phase.FWD] + a2a[Phase.BWD],
            compute_s=sum(s.compute_s for s in st.values()),
            comm_s=sum(s.comm_s for s in st.values()) + sum(self.runner.a2a_s.values()),
        )

    def predicted(self) -> tuple[int | None, int | None]:
        from megatron_hsap.runtime.ulysses import ulysses_bytes

        o = self.plan.options
        inter = int(self.plan.stats().bytes_sent_per_rank[self.cp_rank // o.intra_size])
        intra = 0
        if o.intra_size > 1:
            intra = ulysses_bytes(self.local_tokens, o.num_heads, o.num_kv_heads or o.num_heads, o.head_dim,
                                  o.intra_size, head_dim_v=o.head_dim_v, dtype_bytes=o.dtype_bytes)["total"]  # fmt: skip
        return inter, intra

    def predicted_peak(self) -> int | None:
        return int(self.plan.peak_bytes(dtype_bytes=4)["total"])


def _shape(heads: int, kv_heads: int, dim: int, dtype_bytes: int) -> HeadShape:
    return HeadShape(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, head_dim_v=dim, dtype_bytes=dtype_bytes)


class RingMethod(Method):
    """TE-style THD ring over the whole CP group (documents padded to 2·P, zigzag)."""

    name = "te_thd_ring"

    def __init__(self, cu: np.ndarray, group: Any, world: int, rank: int, heads: tuple[int, int, int, int]) -> None:
        self.layout = ZigzagLayout.build(cu, world)
        self.ring = RingAttention(self.layout, group, "cpu")
        self.topology = (1, world)
        self.local_tokens = self.layout.local_tokens
        self.cu, self.rank, self.heads = cu, rank, heads

    def step(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> None:
        self.ring.reset_stats()
        out, lse = self.ring.forward(q, k, v, scale)
        self.ring.backward(do, q, k, v, out.to(q.dtype), lse, scale)

    def counters(self) -> Counters:
        st = self.ring.stats.values()
        return Counters(sum(s.bytes_sent for s in st), 0, sum(s.compute_s for s in st), sum(s.comm_s for s in st))

    def predicted(self) -> tuple[int | None, int | None]:
        cost = price_baseline("te_thd_ring", self.cu, world=self.layout.ring, shape=_shape(*self.heads),
                              hardware=A100, link=LinkClass.NVLINK)  # fmt: skip
        return int(round(cost.bytes_sent[self.rank])), 0


class AllGatherMethod(Method):
    """Llama-3-style all-gather KV on the contiguous layout."""

    name = "allgather_kv"

    def __init__(self, cu: np.ndarray, group: Any, world: int, rank: int, heads: tuple[int, int, int, int]) -> None:
        self.ag = AllGatherKVAttention(cu, group, "cpu")
        self.topology = (1, world)
        self.local_tokens = self.ag.chunk
        self.cu, self.rank, self.heads, self.world = cu, rank, heads, world

    def step(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> None:
        self.ag.reset_stats()
        out, lse = self.ag.forward(q, k, v, scale)
        self.ag.backward(do, q, k, v, out.to(q.dtype), lse, scale)

    def counters(self) -> Counters:
        st = self.ag.stats.values()
        return Counters(sum(s.bytes_sent for s in st), 0, sum(s.compute_s for s in st), sum(s.comm_s for s in st))

    def predicted(self) -> tuple[int | None, int | None]:
        cost = price_baseline("allgather_kv", self.cu, world=self.world, shape=_shape(*self.heads),
                              hardware=A100, link=LinkClass.NVLINK)  # fmt: skip
        return int(round(cost.bytes_sent[self.rank])), 0


class A2AP2PMethod(Method):
    """TE-style a2a+p2p: Ulysses inside the intra group, document-blind THD ring across groups."""

    name = "te_a2a_p2p"

    def __init__(self, cu: np.ndarray, intra: Any, inter: Any, topology: tuple[int, int], cp_rank: int,
                 heads: tuple[int, int, int, int]) -> None:  # fmt: skip
        from megatron_hsap.runtime.ulysses import ulysses_bytes

        p_intra, p_inter = topology
        self.layout = ZigzagLayout.build(cu, p_inter, p_intra)
        self.method = A2AP2PAttention(self.layout, intra, inter, "cpu")
        self.topology = topology
        self.local_tokens = self.layout.local_tokens
        h, hkv, d, b = heads
        self._intra_pred = ulysses_bytes(self.local_tokens, h, hkv, d, p_intra, dtype_bytes=b)["total"] if p_intra > 1 else 0
        # the ring moves the node's whole padded KV of this rank's kv heads: (P−1) KV + (P−1) dKV hops
        from megatron_hsap.runtime.ulysses import kv_heads_for_intra

        kv_local = kv_heads_for_intra(hkv, p_intra) // p_intra
        kv_bytes = self.layout.ring_tokens * kv_local * 2 * d * b
        self._inter_pred = 3 * (p_inter - 1) * kv_bytes

    def step(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> None:
        self.method.reset_stats()
        out, saved = self.method.forward(q, k, v, scale)
        self.method.backward(do, saved, scale)

    def counters(self) -> Counters:
        st = self.method.ring.stats.values()
        a2a = self.method.a2a_bytes_sent
        return Counters(sum(s.bytes_sent for s in st), a2a[Phase.FWD] + a2a[Phase.BWD],
                        sum(s.compute_s for s in st), sum(s.comm_s for s in st) + self.method.a2a_s)  # fmt: skip

    def predicted(self) -> tuple[int | None, int | None]:
        return self._inter_pred, self._intra_pred

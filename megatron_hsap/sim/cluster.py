"""The modelled cluster: GPUs in nodes, NVLink inside a node, InfiniBand between nodes.

CP rank ``r = i·P_intra + j`` (docs/design.md §1: ``i`` inter index, ``j`` intra index) runs on GPU
``r·TP`` of a contiguous allocation, so node ``= r·TP // gpus_per_node``. Each GPU has one
NVLink port and one NIC (DGX A100/H100: one HDR/NDR NIC per GPU), each full duplex: the
simulator's network keeps a send and a receive capacity per GPU and link class.

Collectives whose members run identical programs (the all-to-alls of Ulysses, USP and HSAP's
intra group: every member enters at the same time) are priced in closed form here; the fluid
network of ``engine.py`` gives the same answer for them, and point-to-point traffic, whose
timing depends on the peers, is always simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import LinkClass, net_channels_per_peer, net_flow_bw
from megatron_hsap.sim.config import SimHardware

__all__ = ["Cluster"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """``P_intra × P_inter`` CP ranks (topology written intra×inter) on ``hw``."""

    hw: SimHardware
    intra_size: int = 1
    inter_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("intra_size", "inter_size", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.intra_size * self.tp_size > self.hw.gpus_per_node and self.intra_size > 1:
            raise ConfigError(
                f"intra_size={self.intra_size} × tp_size={self.tp_size} exceeds one node "
                f"({self.hw.gpus_per_node} GPUs): the intra group must sit inside a node"
            )

    @property
    def cp_size(self) -> int:
        return self.intra_size * self.inter_size

    @property
    def topology(self) -> str:
        return f"{self.intra_size}x{self.inter_size}"

    def cp_rank(self, inter: int, intra: int = 0) -> int:
        return inter * self.intra_size + intra

    def node(self, cp_rank: int) -> int:
        return (cp_rank * self.tp_size) // self.hw.gpus_per_node

    def link(self, a: int, b: int) -> LinkClass:
        """Link class between CP ranks ``a`` and ``b``."""
        return LinkClass.NVLINK if self.node(a) == self.node(b) else LinkClass.INFINIBAND

    def inter_group(self, intra: int = 0) -> list[int]:
        """CP ranks of inter group ``intra`` (strided: ``i·P_intra + intra``)."""
        return [self.cp_rank(i, intra) for i in range(self.inter_size)]

    def intra_group(self, inter: int = 0) -> list[int]:
        return [self.cp_rank(inter, j) for j in range(self.intra_size)]

    @property
    def worst_link(self) -> LinkClass:
        """InfiniBand when the CP group spans nodes (the planner's link class, docs/design.md §4)."""
        last = self.cp_size - 1
        return self.link(0, last)

    # ------------------------------------------------------------------ NCCL's channel and latency model
    def net_channels_per_peer(self, comm_size: int) -> int:
        """NCCL channels a point-to-point stream to a *network* peer runs on in a communicator of
        ``comm_size`` ranks (the rule and its source: ``plan/hardware.net_channels_per_peer``)."""
        return net_channels_per_peer(comm_size, self.hw.p2p_channels)

    def p2p_cap(self, a: int, b: int, comm_size: int) -> float:
        """Ceiling of one point-to-point transfer between CP ranks ``a`` and ``b`` in a
        communicator of ``comm_size`` ranks: none over NVLink; across nodes, its channels times
        what one channel drives (``p2p_channel_net_bw``: NCCL's ``P2P_PER_CHANNEL_NET_BW``,
        14 GB/s), at most the NIC — ``plan/hardware.net_flow_bw``, the planner's cap too."""
        if self.link(a, b) is LinkClass.NVLINK:
            return float("inf")
        return net_flow_bw(comm_size, self.hw.ib_bw, self.hw.p2p_channel_net_bw, self.hw.p2p_channels)

    def ring_latency(self, members: list[int]) -> float:
        """NCCL's ring all-gather / reduce-scatter latency (``src/graph/tuning.cc``, Simple
        protocol): ``baseLat + (nsteps − nInterSteps) · intraLat + nInterSteps · interLat`` with
        ``nsteps = m − 1`` and ``nInterSteps = nodes − 1`` — it grows with the rank count."""
        m = len(members)
        nodes = len({self.node(r) for r in members})
        inter = nodes - 1 if nodes > 1 else 0
        hw = self.hw
        if hw.nccl_base_latency == hw.nccl_nvlink_step_latency == hw.nccl_net_step_latency == 0.0:
            return hw.latency(self._span(members))  # no NCCL table: one latency of the worst link
        return hw.nccl_base_latency + (m - 1 - inter) * hw.nccl_nvlink_step_latency + inter * hw.nccl_net_step_latency

    def all_to_all_rounds(self, members: list[int]) -> int:
        """Rounds of NCCL's grouped send/recv all-to-all: ``p2pnChannels / channels per peer``
        peers progress at once, each round pays one link latency."""
        m = len(members)
        if self._span(members) is LinkClass.NVLINK:
            return 1
        at_once = max(1, self.hw.p2p_channels // self.net_channels_per_peer(m))
        return -(-(m - 1) // at_once)

    # ------------------------------------------------------------------ closed-form collectives
    def all_to_all_time(self, members: list[int], bytes_per_peer: float, copies: bool = True) -> float:
        """Symmetric all-to-all: every member sends ``bytes_per_peer`` to every other member and
        receives as much. NVLink and NIC traffic flow in parallel; one latency of the worst link.
        Plus the layout copies around it: the ``t h d -> h t d`` rearrange before and the inverse
        after are each a ``.contiguous()`` read + write of the whole tensor (MagiAttention
        ``exps/dist_attn/baselines/utils_cp.py`` ``_varlen_all2all_before/after_attn``, DeepSpeed's
        ``_SeqAllToAll``, our ``runtime/ulysses.py``): 4 × the tensor's bytes through HBM
        (``copies=False``: the transfer alone, for schedules that overlap the copies)."""
        if len(members) <= 1 or bytes_per_peer <= 0:
            return 0.0
        copy_s = 4 * bytes_per_peer * len(members) / self.hw.hbm_bw if copies else 0.0
        worst = 0.0
        for a in members:
            nvl = sum(1 for b in members if b != a and self.link(a, b) is LinkClass.NVLINK)
            ib = len(members) - 1 - nvl
            # a2a_efficiency: NCCL's all-to-all over NVLink against the NVLink figure (an all-gather /
            # all-reduce bus bandwidth); the NIC figure is already NDR's achieved large-message rate
            worst = max(worst, nvl * bytes_per_peer / (self.hw.nvlink_bw * self.hw.a2a_efficiency), ib * bytes_per_peer / self.hw.ib_bw)
        return worst + self.all_to_all_rounds(members) * self.hw.latency(self._span(members)) + copy_s

    def ring_collective_time(self, members: list[int], bytes_per_rank: float) -> float:
        """All-gather (or reduce-scatter) of ``bytes_per_rank`` per member, NCCL's ring algorithm:
        each member moves ``(m-1)·bytes_per_rank`` over NVLink; across nodes the rings run one
        channel per rail (one NIC per GPU), so each remote chunk enters a node once and the
        ``g`` NICs of a node share ``(m-g)·bytes_per_rank`` (g = members per node) — the reason
        NCCL's multi-node all-gather bus bandwidth is ≈ g × the NIC rate, not one NIC's."""
        m = len(members)
        if m <= 1 or bytes_per_rank <= 0:
            return 0.0
        link = self._span(members)
        t = (m - 1) * bytes_per_rank / self.hw.nvlink_bw
        if link is LinkClass.INFINIBAND:
            g = m / len({self.node(r) for r in members})
            t = max(t if g > 1 else 0.0, (m - g) * bytes_per_rank / (g * self.hw.ib_bw))
        return t / self.hw.collective_efficiency + self.ring_latency(members)

    def _span(self, members: list[int]) -> LinkClass:
        nodes = {self.node(r) for r in members}
        return LinkClass.NVLINK if len(nodes) == 1 else LinkClass.INFINIBAND

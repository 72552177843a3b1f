"""Kv prices between inter ranks that share a node, for the ``balanced`` layout (``plan/balanced.py``).

With P_intra 1 and P_inter 16 / 64 (Table 2's SP 16, MagiAttention's 4x16) several inter ranks sit on
one node: kv between them moves over NVLink, several times cheaper than the NIC. The layout's
``k``-way split of a heavy document then also tries ``k`` ranks of one node (``within``) and
prices each piece's kv by where its peers' pieces are (``traffic``). docs/design.md §2.1
**Layout choice**.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

__all__ = ["NodePrices"]

_NODE_SPLIT_MAX = 2  # NodePrices prices documents of up to this many nodes' ranks' worth of work per node


class NodePrices:
    """Which inter ranks share a node (``CostRates.node``) and the kv price between two of them:
    ``local_cost`` pairs per kv token over NVLink, ``token_cost`` over the network. A document
    split over ranks of one node moves its kv over NVLink, several times cheaper than the NIC —
    as Megatron's dynamic CP keeps a long sample's ring inside a node (Table 2 SP 16 128K).

    Only documents heavier than a rank's share and at most ``_NODE_SPLIT_MAX`` nodes' ranks' worth
    of work (``prices``) are priced so. Lighter ones: the layout's cost has no term for the kernel
    calls and merges of many small pieces, and priced at NVLink they were split over 5-8 ranks of a
    node to fill rooms (plan_layouts grid, 74 IB batches at P_inter 16 / 64, 2026-12-03, against the
    node-blind layout's estimate: every document priced so, 12 batches slower by 2-14%, geomean
    0.955; as shipped, 9 slower by 3-9%, 32 faster by 1-47%, geomean 0.931). Heavier ones: spread
    over several nodes, a share's kv comes from more nodes the more ranks take it, so the flat
    network price (above the estimate's at this size, README "Why the imbalance stays above 1.05") kept a 126K-token document
    (50 ranks' worth of work, slimpajama 1M over 64 ranks) on 16 ranks instead of 50: estimated
    154.6 -> 196.9 ms."""

    __slots__ = ("node", "node_l", "groups", "local_cost", "token_cost", "most")

    def __init__(self, node: tuple[int, ...], local_cost: float, token_cost: float) -> None:
        self.node = np.asarray(node, dtype=np.int64)
        self.node_l = list(node)
        self.groups = sorted(set(node))
        self.local_cost, self.token_cost = local_cost, token_cost
        self.most = max(node.count(g) for g in self.groups)  # the most inter ranks on one node

    def prices(self, work: float, cap: float) -> bool:
        """Whether a document of ``work`` pairs is priced per node: heavier than one rank's share
        ``cap``, at most ``_NODE_SPLIT_MAX`` nodes' ranks' worth (the class docstring)."""
        return cap < work <= cap * self.most * _NODE_SPLIT_MAX

    def within(self, fit: np.ndarray, k: int) -> list[np.ndarray]:
        """Per node, its first ``k`` ranks of ``fit`` (ranks with room, by key) when it has ``k``."""
        if k > self.most:
            return []
        on = self.node[fit]
        out = []
        for g in self.groups:
            sel = fit[on == g]
            if len(sel) >= k:
                out.append(sel[:k])
        return out

    def traffic(self, ranks: list[int], share: float) -> list[float]:
        """[k] pairs each of ``ranks`` pays to receive the kv of the other ranks' ``share``-token
        pieces of one document: NVLink price from its own node, network price from the others.
        (Python floats: k is small, and the layout's inner loop reads them one by one.)"""
        on = [self.node_l[r] for r in ranks]
        count = Counter(on)
        k = len(ranks)
        return [share * ((count[g] - 1) * self.local_cost + (k - count[g]) * self.token_cost) for g in on]

    @classmethod
    def of(cls, node: tuple[int, ...], local_cost: float | None, token_cost: float) -> "NodePrices | None":
        """None (one price for every pair) unless some node holds two or more inter ranks."""
        if local_cost is None or not node or len(set(node)) == len(node):
            return None
        return cls(node, local_cost, token_cost)

"""Schedules of the collective-based baselines: document-aware all-gather KV with per-document
zigzag, and Megatron's hybrid / dynamic CP (per-sample CP group size).

* ``allgather_zigzag_schedule`` (MagiAttention ``exps/dist_attn/baselines/ring_attn.py``
  ``FA3RingAGAttnFunc``; TE ``AttnFuncWithCPAndKVAllGather``; Llama 3): every document padded to
  2P and split in 2P chunks, rank r holds chunks r and 2P−1−r. Forward: a blocking all-gather of
  K and V (two collectives), the reorder of the gathered KV from zigzag to contiguous (an HBM
  copy), then one varlen call per q half (front chunks against the keys up to them, back chunks
  likewise), real tokens only, and the merge-free write of the two halves. Backward: the same
  gathers and reorder, zeroing the full-length dK/dV buffers, two backward calls, the reorder
  back and a reduce-scatter of dK and dV (activation dtype).
* ``hybrid_cp_schedule`` (Megatron-LM ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``
  ``BalancedCPScheduler``, as MagiAttention runs it in ``exps/dist_attn/baselines/hybrid_dcp.py``):
  each sample gets a CP group of ``g = 2^⌈log2(l / 8K)⌉`` ranks (``baselines.registry.
  hybrid_group_sizes``); samples are placed largest first (``baselines.hierarchical.hybrid_stages``,
  the rule the flat price uses too) into *groups* (micro-batch stages)
  where each rank holds at most 8K tokens; a sample with ``g > 1`` runs TE's THD p2p ring
  (``RingAttnP2P``, FA3 kernels: ``impl="fa3"``) over ``g`` consecutive ranks, a sample with ``g = 1`` is one FA3 call on its
  rank (a launch per sample). Stages are separated by ``dist.barrier()``; a stage lasts as long
  as its slowest rank.
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.baselines.hierarchical import HYBRID_TOKENS_PER_RANK, hybrid_stages
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Phase
from megatron_hsap.sim.builder import Blocks, Builder, causal_pairs
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.engine import Workload

__all__ = ["allgather_zigzag_schedule", "hybrid_cp_schedule", "hybrid_stages", "HYBRID_TOKENS_PER_RANK"]



def _zigzag_halves(lengths: np.ndarray, P: int, r: int) -> tuple[Blocks, Blocks]:
    """Rank r's two q halves (chunk r, chunk 2P−1−r of every document) as kernel blocks against
    the keys before them (real tokens only)."""
    lengths = lengths.astype(np.float64)
    c = np.ceil(lengths / (2 * P))
    out = []
    for k in (r, 2 * P - 1 - r):
        a = np.minimum(k * c, lengths)
        b = np.minimum((k + 1) * c, lengths)
        nq = b - a
        out.append(Blocks.of(nq, b, causal_pairs(nq, a + 1)))
    return out[0], out[1]


def allgather_zigzag_schedule(cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase | str) -> tuple[Workload, list[int]]:
    """See the module docstring; CP ranks 0..P−1 placed contiguously on nodes."""
    hw = cluster.hw
    P = cluster.cp_size
    lengths = np.diff(np.asarray(cu, dtype=np.int64))
    lengths = lengths[lengths > 0]
    padded = -(-lengths // (2 * P)) * (2 * P) if P > 1 else lengths
    local = float(padded.sum()) / P
    ranks = list(range(P))
    b = Builder(P)
    k_bytes = local * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    v_bytes = local * shape.num_kv_heads * shape.head_dim_v * shape.dtype_bytes
    gathers = [cluster.ring_collective_time(ranks, k_bytes), cluster.ring_collective_time(ranks, v_bytes)]
    full_kv = P * (k_bytes + v_bytes)
    tags = [b.new_tag() for _ in range(4)]
    for r in ranks:
        front, back = _zigzag_halves(lengths, P, r)
        for i, t in enumerate(gathers):
            b.collective(r, tags[i], t, "collective", "all-gather k" if i == 0 else "all-gather v")
        b.elementwise(r, 2 * full_kv, hw, "reorder kv")  # read + write the gathered KV
        if phase == Phase.BWD:
            b.elementwise(r, full_kv, hw, "zero dkv")
        for half, name in ((front, "front half"), (back, "back half")):
            b.fa3_wrapper(r, float(half.nq.sum()), float(lengths.sum()), shape, phase, hw)
            b.kernel(r, half, hw, shape, phase, name)
        if phase == Phase.BWD:  # each half returns full-length dk, dv (written, then dk.add_: read 2, write 1)
            b.elementwise(r, 2 * 4 * full_kv, hw, "dk/dv of both halves")
            b.elementwise(r, 2 * full_kv, hw, "reorder dkv")
            for i, t in enumerate(gathers):
                b.collective(r, tags[2 + i], t, "collective", "reduce-scatter dk" if i == 0 else "reduce-scatter dv")
    return b.build(), ranks


def hybrid_cp_schedule(cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase | str) -> tuple[Workload, list[int]]:
    """See the module docstring. Ring samples are priced by the TE THD ring schedule on their
    own ``g``-rank sub-cluster (simulated once per distinct (length, g)), then placed as busy
    spans on their ranks; stages end with a barrier (one collective latency)."""
    from megatron_hsap.sim.engine import simulate_on
    from megatron_hsap.sim.schedules import pad_lengths, ring_schedule, zigzag_steps

    hw = cluster.hw
    P = cluster.cp_size
    lengths = np.diff(np.asarray(cu, dtype=np.int64))
    b = Builder(P)
    ring_cache: dict[tuple[int, int, int], float] = {}
    for stage in hybrid_stages(lengths, P):
        for n, first, g in stage:
            if g == 1:
                blk = Blocks.of([n], [n], causal_pairs(np.array([float(n)])))
                b.kernel(first, blk, hw, shape, phase, "fa3 sample")
                continue
            key = (n, first // hw.gpus_per_node if g <= hw.gpus_per_node else -1, g)
            if key not in ring_cache:
                sub = Cluster(hw=hw, intra_size=1, inter_size=g)
                chunk = pad_lengths(np.array([n]), 2 * g) / (2 * g)
                work, gpus = ring_schedule(zigzag_steps(chunk, g), shape, sub, list(range(g)), phase, impl="fa3",
                                           dkv_bytes_per_elem=shape.dtype_bytes)
                ring_cache[key] = simulate_on(work, sub, gpus).makespan
            for r in range(first, first + g):
                b.busy(r, ring_cache[key], "compute", f"ring sample {n} over {g}")
        tag = b.new_tag()
        for r in range(P):
            b.collective(r, tag, hw.latency(cluster.worst_link), "sync", "barrier")
    return b.build(), list(range(P))

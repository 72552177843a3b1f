"""LoongTrain's 2D attention: a head all-to-all over ``u`` ranks, then a *double ring* over the
``r = P/u`` ring ranks (SandAI-org/MagiAttention ``exps/dist_attn/baselines/loongtrain.py``
``FA3DoubleRingAttnFunc``, after InternLM/InternEvo).

The ring ranks form ``r/w`` windows of ``w`` consecutive ring ranks (``w`` = ring ranks per node,
so an inner ring stays on NVLink when ``u`` < GPUs per node). Forward, window ``k``: the rank
posts the *outer* transfer of the KV it started this window with to the same position of the
next window (overlapped with the whole inner loop), then runs ``w`` inner steps, each posting the
inner transfer to the next rank of its window, computing the per-document zigzag blocks of the
KV it holds (FA3), merging and waiting; the outer transfer is waited for at the end of the
window. Backward runs the same two rings carrying KV and (activation-dtype) dKV together, the
approximation ``ring_schedule`` also makes. KV owned by ring rank ``(a−k, b−i)`` is computed at
window ``k``, inner step ``i`` by ring rank ``(a, b)``.
"""

from __future__ import annotations

from megatron_hsap.baselines.hierarchical import window_size
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.sim.builder import Builder
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import merge_bytes
from megatron_hsap.sim.engine import Workload
from megatron_hsap.sim.schedules import RingSteps

__all__ = ["double_ring_schedule", "window_size"]


def double_ring_schedule(steps: RingSteps, shape: HeadShape, cluster: Cluster, gpus: list[int], phase: Phase | str, *,
                         w: int, before: list[float] = (), after: list[float] = ()) -> tuple[Workload, list[int]]:  # type: ignore[assignment]
    """One phase of the double ring over ring ranks ``gpus`` (``steps.blocks[x][s]`` = blocks of
    ring rank x against the KV of ring rank (x−s) mod r, as ``zigzag_steps`` builds them)."""
    hw = cluster.hw
    r = len(gpus)
    nw = r // w
    b = Builder(r)
    h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
    kv = steps.local_tokens * shape.token_bytes(Wire.KV)
    moved = kv if phase == Phase.FWD else 2 * kv  # backward: KV and dKV (activation dtype) travel together
    outer = [b.new_tag() for _ in range(nw)]
    inner = [[b.new_tag() for _ in range(w)] for _ in range(nw)]
    for x in range(r):
        a, pos = divmod(x, w)
        for t in before:
            b.busy(x, t, "a2a", "all-to-all in")
        for k in range(nw):
            if k + 1 < nw:
                b.send(outer[k], x, ((a + 1) % nw) * w + pos, moved, "kv outer")
                b.post(x, outer[k])
            for i in range(w):
                if i + 1 < w:
                    b.send(inner[k][i], x, a * w + (pos + 1) % w, moved, "kv inner")
                    b.post(x, inner[k][i])
                owner = ((a - k) % nw) * w + (pos - i) % w
                blocks = steps.blocks[x][(x - owner) % r]
                b.kernel(x, blocks, hw, shape, phase, f"window {k} step {i}")
                if owner != x and not blocks.empty:
                    width = h * dv * merge_bytes("fa3", Phase.FWD) if phase == Phase.FWD else (
                        h * d + hkv * (d + dv)) * merge_bytes("fa3", Phase.BWD)
                    b.elementwise(x, steps.out_rows[x, (x - owner) % r] * width, hw)
                if i + 1 < w:
                    b.wait(x, inner[k][i])
            if k + 1 < nw:
                b.wait(x, outer[k])
        for t in after:
            b.busy(x, t, "a2a", "all-to-all out")
    return b.build(), list(gpus)


"""One entry point for every simulated method: ``run_method(name, cu_seqlens, ...)``.

Methods (docs/design.md §4's list, as schedules): ``hsap`` (the compiled plan; P_intra 1 is plain SAP),
``te_a2a`` (TE's a2a CP with its own pipelined schedule, documents padded to 2P),
``te_thd_ring`` (TE THD p2p ring, per-document zigzag, documents padded to 2P),
``te_a2a_p2p`` and ``usp`` (all-to-all over the intra group, then the per-document zigzag
ring over the inter group — MagiAttention's USP baseline runs TE's ring too; they differ only in
the merge kernel), ``allgather_kv`` (Llama-3 style, contiguous layout, KV all-gathered per
head chunk, compute after it), ``ulysses`` (all-to-all to heads, whole documents per rank),
``distflashattn`` (document-blind balanced ring) and ``blind_ring`` (the packed batch as ONE
causal sequence under Megatron's a2a+p2p zigzag CP: Table 4's "packing").

``te_thd_ring_nopad`` (the same ring, padding not computed: cuDNN/FA3 ``pad_between_seqs``),
``allgather_kv_zigzag`` (document-aware all-gather KV, per-document zigzag) and ``hybrid_cp``
(Megatron hybrid / dynamic CP) are in ``sim/collectives.py``; ``loongtrain`` (head all-to-all
over P_intra, double ring over P_inter) in ``sim/double_ring.py``. Availability rules and sources are
the records of ``megatron_hsap.baselines.registry`` (one definition each). HSAP runs with the
shipped default layout (balanced); pass ``plan_options={"layout": "contiguous"}`` for the paper's.

Every method returns a ``MethodRun`` with both phases' timelines; ``None`` plus a reason when
it cannot run (``unavailable``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from megatron_hsap.baselines.hierarchical import te_a2a_pipeline
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.layout import normalize_cu_seqlens
from megatron_hsap.plan.options import kv_heads_exchanged
from megatron_hsap.sim.builder import Blocks, Builder, causal_pairs
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.engine import Timeline, Workload, simulate_on
from megatron_hsap.sim.schedules import distflashattn_schedule, pad_lengths, ring_schedule, zigzag_steps

__all__ = ["METHODS", "MethodRun", "PhaseRun", "run_method", "hsap_plan", "unavailable", "ideal_seconds", "useful_flops", "ulysses_degree"]

METHODS = ("hsap", "te_thd_ring", "te_thd_ring_nopad", "te_a2a", "te_a2a_p2p", "usp", "allgather_kv", "allgather_kv_zigzag", "ulysses",
           "hybrid_cp", "loongtrain", "distflashattn", "blind_ring")


@dataclass(slots=True)
class PhaseRun:
    timeline: Timeline
    workload: Workload
    gpus: list[int]

    @property
    def seconds(self) -> float:
        return self.timeline.makespan


@dataclass(slots=True)
class MethodRun:
    method: str
    topology: str  # intra x inter actually used
    P: int
    fwd: PhaseRun
    bwd: PhaseRun
    useful_fwd_flops: float  # document-causal pairs of real tokens × full-head FLOPs per pair
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.fwd.seconds + self.bwd.seconds

    def tflops_per_gpu(self, phase: Phase | str) -> float:
        phase = Phase(phase)
        f = self.useful_fwd_flops * (1.0 if phase == Phase.FWD else 2.5)
        t = self.fwd.seconds if phase == Phase.FWD else self.bwd.seconds
        return f / t / self.P / 1e12 if t > 0 else 0.0


def full_shape(num_heads: int, num_kv_heads: int | None, head_dim: int = 128, dtype_bytes: int = 2) -> HeadShape:
    return HeadShape(num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads, head_dim=head_dim,
                     head_dim_v=head_dim, dtype_bytes=dtype_bytes)


def _split(shape: HeadShape, u: int) -> HeadShape:
    """Heads one rank computes after an all-to-all over ``u`` ranks (``registry.split_heads``)."""
    from megatron_hsap.baselines.registry import split_heads

    return split_heads(shape, u)


def _heads_ok(shape: HeadShape, u: int) -> bool:
    from megatron_hsap.baselines.registry import heads_split_ok

    return heads_split_ok(shape, u)


def ulysses_degree(P: int, shape: HeadShape, gpus_per_node: int = 8) -> int:
    """USP's all-to-all degree (``registry.usp_degree``)."""
    from megatron_hsap.baselines.registry import usp_degree

    return usp_degree(P, shape, gpus_per_node)


def unavailable(method: str, *, intra: int, inter: int, shape: HeadShape) -> str | None:
    """Why ``method`` cannot run at this size (``n/a (P > H)`` ...), or None: the registry's rule
    (``hsap`` splits heads over the intra group like USP)."""
    from megatron_hsap.baselines.registry import unavailable as rule

    return rule("usp" if method == "hsap" else method, intra=intra, inter=inter, shape=shape)


def ideal_seconds(cu: np.ndarray, shape: HeadShape, hw: Any, P: int, phase: Phase | str) -> float:
    """Σ over documents of FLOPs / kernel rate at that document's shape, divided by P."""
    phase = Phase(phase)
    lengths = np.diff(np.asarray(cu, dtype=np.int64)).astype(np.float64)
    lengths = lengths[lengths > 0]
    fpp = shape.fwd_flops_per_pair if phase == Phase.FWD else shape.bwd_flops_per_pair
    group = shape.num_heads // max(1, shape.num_kv_heads)
    pairs = causal_pairs(lengths)
    return hw.kernel.blocks_time(lengths, lengths, pairs * fpp, phase, group, pairs) / P


def useful_flops(cu: np.ndarray, shape: HeadShape) -> float:
    lengths = np.diff(np.asarray(cu, dtype=np.int64)).astype(np.float64)
    return float(causal_pairs(lengths[lengths > 0]).sum() * shape.fwd_flops_per_pair)


def _a2a_times(cluster: Cluster, shape: HeadShape, local_tokens: float, phase: Phase) -> tuple[list[float], list[float]]:
    u = cluster.intra_size
    if u == 1:
        return [], []
    hkv_x = kv_heads_exchanged(shape.num_heads, shape.num_kv_heads, u)
    members = cluster.intra_group(0)
    b = shape.dtype_bytes

    def call(heads: int, dim: int) -> float:
        return cluster.all_to_all_time(members, local_tokens * (heads // u) * dim * b)

    q, k, v = call(shape.num_heads, shape.head_dim), call(hkv_x, shape.head_dim), call(hkv_x, shape.head_dim_v)
    o = call(shape.num_heads, shape.head_dim_v)
    return ([q, k, v], [o]) if phase == Phase.FWD else ([o], [q, k, v])


def _ring_methods(method: str, cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase) -> tuple[Workload, list[int]]:
    P, r = cluster.cp_size, cluster.inter_size
    lengths = np.diff(cu)
    if method == "blind_ring":
        lengths = np.array([int(cu[-1])])
    padded = pad_lengths(lengths, 2 * P) if P > 1 else lengths
    chunk = padded / (2 * r) if r > 1 else padded / 2.0
    steps = zigzag_steps(chunk, r)
    # kernels on the real tokens, the padded KV still travels: TE with pad_between_seqs, and the FA3
    # THD ring that MagiAttention's USP and LoongTrain call (its wrappers unpad every input)
    if method in ("te_thd_ring_nopad", "usp", "loongtrain"):
        steps = replace(zigzag_steps(lengths / (2 * r) if r > 1 else lengths / 2.0, r), local_tokens=steps.local_tokens)
    local = _split(shape, cluster.intra_size)
    before, after = _a2a_times(cluster, shape, float(padded.sum()) / P, phase)
    if method == "loongtrain":
        from megatron_hsap.sim.double_ring import double_ring_schedule, window_size

        w = window_size(r, cluster.intra_size, cluster.hw.gpus_per_node)
        return double_ring_schedule(steps, local, cluster, cluster.inter_group(0), phase, w=w, before=before, after=after)
    # MagiAttention's USP runs the same FA3 THD ring as its ring-p2p (exps/dist_attn/baselines/usp.py
    # calls ring_attn.py FA3RingAttnFunc): TE's per-step THD helpers and fused corrections, "te"
    impl = "te"
    return ring_schedule(steps, local, cluster, cluster.inter_group(0), phase, impl=impl,
                         dkv_bytes_per_elem=shape.dtype_bytes, before=before, after=after)


def _allgather(cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase, stride: int | None = None) -> tuple[Workload, list[int]]:
    """Llama-3 all-gather KV on the contiguous layout: per chunk of ``stride`` kv heads, a blocking
    all-gather of K and V, then the kernel (backward: then a reduce-scatter of dK, dV)."""
    hw = cluster.hw
    P = cluster.cp_size
    T = int(cu[-1])
    L = -(-T // P)
    hkv = shape.num_kv_heads
    stride = stride or hkv
    chunks = hkv // stride
    part = HeadShape(num_heads=shape.num_heads * stride // hkv, num_kv_heads=stride, head_dim=shape.head_dim,
                     head_dim_v=shape.head_dim_v, dtype_bytes=shape.dtype_bytes)
    b = Builder(P)
    ranks = list(range(P))
    kv_bytes = L * stride * (shape.head_dim + shape.head_dim_v) * shape.dtype_bytes
    gather = cluster.ring_collective_time(ranks, kv_bytes)
    starts = cu[:-1]
    gather_tags = [b.new_tag() for _ in range(chunks)]
    scatter_tags = [b.new_tag() for _ in range(chunks)]
    for r in range(P):
        lo, hi = r * L, min((r + 1) * L, T)
        first = max(int(np.searchsorted(cu, lo, side="right")) - 1, 0)
        last = int(np.searchsorted(cu, hi, side="left"))
        ds = starts[first:last].astype(np.float64)
        a = np.maximum(ds, lo)
        e = np.minimum(cu[first + 1 : last + 1].astype(np.float64), hi)
        nq = e - a
        blocks = Blocks.of(nq, e - ds, causal_pairs(nq, a - ds + 1))
        for i in range(chunks):
            if phase == Phase.BWD:
                b.elementwise(r, 2 * P * kv_bytes, cluster.hw, "zero dkv")
            b.collective(r, gather_tags[i], gather, "collective", "all-gather kv")
            b.kernel(r, blocks, hw, part, phase, "attention")
            if phase == Phase.BWD:
                b.collective(r, scatter_tags[i], gather, "collective", "reduce-scatter dkv")
    return b.build(), ranks


def _ulysses(cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase) -> tuple[Workload, list[int]]:
    P = cluster.cp_size
    lengths = np.diff(cu).astype(np.float64)
    lengths = lengths[lengths > 0]
    local = _split(shape, P)
    hkv_x = kv_heads_exchanged(shape.num_heads, shape.num_kv_heads, P)
    tokens = -(-int(cu[-1]) // P)
    ranks = list(range(P))  # CP ranks 0..P-1 on consecutive GPUs: more than 8 span nodes

    def a2a(heads: int, dim: int) -> float:
        return cluster.all_to_all_time(ranks, tokens * (heads // P) * dim * shape.dtype_bytes)

    q, k, v, o = a2a(shape.num_heads, shape.head_dim), a2a(hkv_x, shape.head_dim), a2a(hkv_x, shape.head_dim_v), a2a(shape.num_heads, shape.head_dim_v)
    before, after = ([q, k, v], [o]) if phase == Phase.FWD else ([o], [q, k, v])
    b = Builder(P)
    blocks = Blocks.of(lengths, lengths, causal_pairs(lengths))
    for r in ranks:
        for t in before:
            b.busy(r, t, "a2a", "all-to-all in")
        b.fa3_wrapper(r, float(lengths.sum()), float(lengths.sum()), local, phase, cluster.hw)
        b.kernel(r, blocks, cluster.hw, local, phase, "attention")
        for t in after:
            b.busy(r, t, "a2a", "all-to-all out")
    return b.build(), ranks


def _te_a2a(cu: np.ndarray, cluster: Cluster, shape: HeadShape, phase: Phase) -> tuple[Workload, list[int]]:
    """Transformer Engine's a2a CP (``AttnFuncWithCPAndQKVOA2A``, NVIDIA/TransformerEngine
    ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``
    ``flash_attn_a2a_communicate``): documents padded to 2P (THD dual-chunk layout); one
    all-to-all per tensor, the reorder of tensor i+1 before it and of tensor i−1 after it run on
    TE's side stream while tensor i travels (a software pipeline: first copy, then max(transfer,
    copies) per tensor, then the last copy); the kernel on the real tokens of H/P heads."""
    hw = cluster.hw
    P = cluster.cp_size
    lengths = np.diff(cu).astype(np.float64)
    lengths = lengths[lengths > 0]
    padded = pad_lengths(lengths.astype(np.int64), 2 * P) if P > 1 else lengths
    local = float(padded.sum()) / P
    ranks = list(range(P))
    b = shape.dtype_bytes

    def pipeline(tensors: list[tuple[int, int]]) -> float:
        if P == 1:
            return 0.0
        per_peer = [local * (h // P) * d * b for h, d in tensors]
        core = [cluster.all_to_all_time(ranks, x, copies=False) for x in per_peer]
        copy = [2 * x * P / hw.hbm_bw for x in per_peer]  # one read + write of the tensor
        return te_a2a_pipeline(core, copy)

    h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
    qkv, o = pipeline([(h, d), (hkv, d), (hkv, dv)]), pipeline([(h, dv)])
    before, after = (qkv, o) if phase == Phase.FWD else (o, qkv)
    bld = Builder(P)
    blocks = Blocks.of(lengths, lengths, causal_pairs(lengths))
    for r in ranks:
        bld.busy(r, before, "a2a", "all-to-all in")
        bld.kernel(r, blocks, hw, _split(shape, P), phase, "attention")
        bld.busy(r, after, "a2a", "all-to-all out")
    return bld.build(), ranks


def hsap_plan(cu: np.ndarray, *, hw: Any, intra: int, inter: int, shape: HeadShape, plan_options: dict | None = None) -> Any:
    """The HSAP plan ``run_method("hsap", ...)`` simulates: ``compile_plan`` with the shipped
    defaults (the balanced layout with its fallback) unless ``plan_options`` say otherwise — also
    how a comparison of forced layouts learns which one the default would ship."""
    from megatron_hsap.plan.plan import compile_plan

    return compile_plan(cu, inter, intra, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                        head_dim=shape.head_dim, dtype_bytes=shape.dtype_bytes,
                        hardware=hw.name if hw.name in ("a100", "h100", "h100-fa3") else "a100", **dict(plan_options or {}))


def run_method(method: str, cu_seqlens: object, *, hw: Any, intra: int, inter: int, shape: HeadShape,
               plan_options: dict[str, Any] | None = None, allgather_stride: int | None = None) -> MethodRun | None:
    """Simulate ``method`` forward and backward on ``cu_seqlens`` over ``intra × inter`` GPUs.

    ``shape``: the model's heads per TP rank (full, before any split). Ulysses and DistFlashAttn
    use all ``intra × inter`` ranks as one group; ``te_thd_ring`` / ``allgather_kv`` /
    ``distflashattn`` ignore the split and place CP ranks 0..P−1 contiguously on nodes."""
    cu = np.asarray(normalize_cu_seqlens(cu_seqlens), dtype=np.int64)
    if unavailable(method, intra=intra, inter=inter, shape=shape):
        return None
    P = intra * inter
    flat = Cluster(hw=hw, intra_size=1, inter_size=P)
    extra: dict[str, Any] = {}
    note = ""
    topo = f"{intra}x{inter}"
    if method == "hsap":
        from megatron_hsap.sim.hsap import hsap_workload

        cluster = Cluster(hw=hw, intra_size=intra, inter_size=inter)
        t0 = time.perf_counter()
        # the shipped default layout (balanced) unless told otherwise; the paper's variant is
        # plan_options={"layout": "contiguous"}
        plan = hsap_plan(cu, hw=hw, intra=intra, inter=inter, shape=shape, plan_options=plan_options)
        extra["compile_s"] = time.perf_counter() - t0
        if plan.options.flattened_from is not None:  # one level over the same P GPUs (plan/flatten.py)
            cluster = Cluster(hw=hw, intra_size=plan.intra_size, inter_size=plan.inter_size)
        extra["flattened"] = plan.options.flattened_from is not None
        extra["ran_as"] = f"{plan.intra_size}x{plan.inter_size}"  # the topology the plan runs on
        stats = plan.stats()
        keys = ("layout", "placement", "imbalance", "owner_imbalance", "bytes_total", "necessary_bytes", "rounds_fwd",
                "rounds_bwd", "estimated_time_s", "compute_efficiency", "compute_bound_s", "traffic_bound_s")
        extra["plan"] = {k: getattr(stats, k) for k in keys}
        build = lambda ph: hsap_workload(plan, cluster, ph)  # noqa: E731
        note = f"placement {stats.placement}, imbalance {stats.imbalance:.2f}"
    elif method in ("te_thd_ring", "te_thd_ring_nopad", "te_a2a_p2p", "usp", "loongtrain", "blind_ring"):
        u = 1 if method in ("te_thd_ring", "te_thd_ring_nopad") else (ulysses_degree(P, shape, hw.gpus_per_node) if method == "usp" else intra)
        cluster = Cluster(hw=hw, intra_size=u, inter_size=P // u)
        topo = cluster.topology
        build = lambda ph: _ring_methods(method, cu, cluster, shape, ph)  # noqa: E731
    elif method == "allgather_kv":
        build = lambda ph: _allgather(cu, flat, shape, ph, allgather_stride)  # noqa: E731
        topo = f"1x{P}"
    elif method == "allgather_kv_zigzag":
        from megatron_hsap.sim.collectives import allgather_zigzag_schedule

        build = lambda ph: allgather_zigzag_schedule(cu, flat, shape, ph)  # noqa: E731
        topo = f"1x{P}"
    elif method == "hybrid_cp":
        from megatron_hsap.sim.collectives import hybrid_cp_schedule

        build = lambda ph: hybrid_cp_schedule(cu, flat, shape, ph)  # noqa: E731
        topo = f"1x{P}"
        note = "per-sample CP group sizes"
    elif method == "ulysses":
        build = lambda ph: _ulysses(cu, flat, shape, ph)  # noqa: E731
        topo = f"{P}x1"
    elif method == "te_a2a":
        build = lambda ph: _te_a2a(cu, flat, shape, ph)  # noqa: E731
        topo = f"{P}x1"
    elif method == "distflashattn":
        build = lambda ph: distflashattn_schedule(int(cu[-1]), shape, flat, ph)  # noqa: E731
        topo = f"1x{P}"
        note = "document-blind"
    else:
        from megatron_hsap.errors import ConfigError

        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    runs = {}
    for ph in Phase:
        work, gpus = build(ph)
        c = cluster if method in ("hsap", "te_thd_ring", "te_thd_ring_nopad", "te_a2a_p2p", "usp", "loongtrain", "blind_ring") else flat
        runs[ph] = PhaseRun(simulate_on(work, c, gpus), work, gpus)
    return MethodRun(method, topo, P, runs[Phase.FWD], runs[Phase.BWD], useful_flops(cu, shape), note, extra)

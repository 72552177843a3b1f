"""Head chunks of the intra all-to-all: the valid counts, their estimated time and the count a plan
runs with (docs/design.md §2.2 "Autograd", §4).

``HSAPAttention`` (``runtime/hsap.py``) splits the ``h = H/P_intra`` q heads and ``hkv`` kv heads a
rank holds after the all-to-all (``plan.shape``; kv heads replicated when ``P_intra > Hkv``) into
``C = plan.head_chunks`` equal chunks and pipelines them: while SAP computes chunk ``k``, the
all-to-all of chunk ``k+1`` (q, k, v forward; dO backward) and the return of chunk ``k−1`` (o;
dq, dk, dv) are in flight on the intra group.

**Rule** (:func:`valid_head_chunks`): ``C`` divides both ``h`` and ``hkv``. Chunk ``c`` then holds q
heads ``[c·h/C, (c+1)·h/C)`` and kv heads ``[c·hkv/C, (c+1)·hkv/C)`` — exactly the kv heads those
q heads use (``h/hkv`` q heads per kv head), so each chunk is one SAP run of the same programs on
``1/C`` of the heads: every message and slot shrinks by ``C`` and the bytes summed over the chunks
equal the plan's. With one kv head per rank (``P_intra ≥ Hkv`` under GQA) only ``C = 1`` is valid:
a kv head shared by several chunks would be re-sent by every chunk's SAP rounds.

**Choice** (:func:`resolve_head_chunks`): ``options.head_chunks`` when given; else 1 when
``P_intra = 1`` (no all-to-all); else the valid count of least ``estimate.pipelined_time`` summed
over forward and backward (ties: fewer chunks). ``P_inter = 1`` (pure Ulysses) is priced the same
way: the local attention of chunk ``k`` hides the all-to-alls of its neighbours just as SAP does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.calls import call_counts
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.estimate import PipelinePhase, pipelined_time
from megatron_hsap.plan.hardware import LinkClass, link_class_for
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.options import check_head_chunks, valid_head_chunks  # defined there; re-exported

if TYPE_CHECKING:
    from megatron_hsap.plan.options import PlanOptions
    from megatron_hsap.plan.plan_type import Plan

__all__ = [
    "valid_head_chunks",
    "check_head_chunks",
    "chunk_shape",
    "intra_link",
    "a2a_call_bytes",
    "a2a_bytes_sent",
    "pipeline_phases",
    "head_chunk_estimates",
    "resolve_head_chunks",
]

# all_to_all_single calls per chunk before / after SAP (runtime/hsap.py): q, k, v in and o out
# forward; dO in and dq, dk, dv out backward
def chunk_shape(shape: HeadShape, chunks: int) -> HeadShape:
    """The head shape of one of ``chunks`` head chunks of ``shape`` (the rule above): ``h/C`` q and
    ``hkv/C`` kv heads, the same head sizes and dtype. The executor and the simulator both use it."""
    if chunks < 1 or shape.num_heads % chunks or shape.num_kv_heads % chunks:
        raise ConfigError(f"{chunks} head chunks do not split {shape.num_heads} q / {shape.num_kv_heads} kv heads "
                          f"evenly; valid: {valid_head_chunks(shape.num_heads, shape.num_kv_heads)}")
    return shape if chunks == 1 else replace(shape, num_heads=shape.num_heads // chunks,
                                             num_kv_heads=shape.num_kv_heads // chunks)


_CALLS = {Phase.FWD: (("q", "k", "v"), ("o",)), Phase.BWD: (("o",), ("q", "k", "v"))}


def intra_link(opts: "PlanOptions") -> LinkClass:
    """The intra group's link: NVLink when its ``tp_size × intra_size`` GPUs fit one node."""
    return link_class_for(opts.tp_size * opts.intra_size, opts.gpus_per_node)


def a2a_call_bytes(plan: "Plan") -> dict[str, int]:
    """Bytes one rank sends in the all-to-all of each tensor, all chunks together: ``{"q", "k",
    "v", "o"}`` (``t_local`` rows of ``h`` (or ``hkv``) heads to each of the ``P_intra − 1`` peers;
    dO, dq, dk, dv have the shapes of o, q, k, v)."""
    s, p = plan.shape, plan.intra_size
    row = plan.local_tokens * (p - 1) * s.dtype_bytes
    return {"q": row * s.num_heads * s.head_dim, "k": row * s.num_kv_heads * s.head_dim,
            "v": row * s.num_kv_heads * s.head_dim_v, "o": row * s.num_heads * s.head_dim_v}  # fmt: skip


def a2a_bytes_sent(plan: "Plan") -> dict[str, int]:
    """Intra all-to-all bytes one rank sends per phase, ``{"fwd", "bwd"}`` (whatever the chunk count)."""
    b = a2a_call_bytes(plan)
    return {ph.value: sum(b[n] for side in _CALLS[ph] for n in side) for ph in (Phase.FWD, Phase.BWD)}


def _kernel_calls(plan: "Plan", phase: Phase) -> int:
    """Most varlen kernel calls one inter rank makes in ``phase`` (``plan/calls.py``: the calls the
    runtime launches and the simulator prices)."""
    return max(call_counts(plan, phase), default=0)


def pipeline_phases(plan: "Plan") -> dict[Phase, PipelinePhase]:
    """The inputs of ``estimate.pipelined_time`` per phase: the plan's SAP estimate, its round
    latencies and kernel launches (paid again by every chunk) and the all-to-all bytes and calls."""
    hw, b = plan.hardware, a2a_call_bytes(plan)
    out = {}
    for ph, pt in ((Phase.FWD, plan.chosen.fwd_time), (Phase.BWD, plan.chosen.bwd_time)):
        before, after = _CALLS[ph]
        p = plan.intra_size  # copies: 4 × each whole tensor, P/(P−1) × the bytes sent (Hardware.a2a_copy_time)
        out[ph] = PipelinePhase(sap_s=pt.total - pt.launch, latency_s=pt.latency, launch_s=_kernel_calls(plan, ph) * hw.kernel.launch_s,
                                in_bytes=sum(b[n] for n in before), out_bytes=sum(b[n] for n in after),
                                in_calls=len(before), out_calls=len(after),
                                in_copy_s=hw.a2a_copy_time(sum(b[n] for n in before) * p / max(1, p - 1)),
                                out_copy_s=hw.a2a_copy_time(sum(b[n] for n in after) * p / max(1, p - 1)))  # fmt: skip
    return out


def head_chunk_estimates(plan: "Plan") -> dict[int, float]:
    """Estimated forward + backward seconds of the intra all-to-all pipelined with SAP, per valid
    chunk count (``C = 1``: the all-to-alls before and after SAP fully exposed)."""
    if plan.intra_size == 1:
        return {1: plan.chosen.time}
    link = intra_link(plan.options)
    bw, lat = plan.hardware.a2a_bandwidth(link), plan.hardware.latency(link)
    phases = pipeline_phases(plan)
    return {c: sum(pipelined_time(ph, c, bw, lat) for ph in phases.values())
            for c in valid_head_chunks(plan.shape.num_heads, plan.shape.num_kv_heads)}  # fmt: skip


def resolve_head_chunks(plan: "Plan") -> int:
    """The chunk count ``plan`` runs with (``Plan.head_chunks``; see the module docstring)."""
    forced = plan.options.head_chunks
    if forced is not None:
        return int(forced)
    if plan.intra_size == 1:  # pure SAP: no all-to-all to pipeline
        return 1
    est = head_chunk_estimates(plan)
    best = 1
    for c in sorted(est):
        if est[c] < est[best] * (1 - 1e-9):
            best = c
    return best

"""Where the time goes: a phase's makespan split into named terms that sum to it exactly.

For the critical rank ``k`` (the last to finish)::

    makespan = ideal                      Σ documents' FLOPs / kernel rate at their shape / P
             + kernel_efficiency          mean over ranks of kernel time − ideal (smaller blocks,
                                          launches, padding or document-blind work)
             + imbalance                  kernel time of k − mean kernel time
             + merges                     LSE merges and gradient accumulations on k
             + all_to_all                 intra-group all-to-alls on k (not overlapped)
             + latency                    per-round latency on k's waits (capped by its waits)
             + exposed_communication      the rest of k's waits on P2P rounds, plus blocking
                                          collectives and their skew
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.sim.engine import Post

__all__ = ["TERMS", "phase_breakdown"]

TERMS = ("ideal", "kernel_efficiency", "imbalance", "merges", "all_to_all", "latency", "exposed_communication")


def phase_breakdown(run: object, phase: str, ideal_s: float, latency_s: float) -> dict[str, float]:
    """Terms of ``run``'s ``phase`` (a ``PhaseRun`` of ``methods.MethodRun``) in seconds."""
    pr = run.fwd if phase == "fwd" else run.bwd  # type: ignore[attr-defined]
    tl = pr.timeline
    k = int(np.argmax(tl.finish))
    comp = tl.busy("compute")
    mean = float(comp.mean())
    wait = float(tl.busy("wait")[k])
    with_bytes = {(t.src, t.tag) for t in pr.workload.transfers} | {(t.dst, t.tag) for t in pr.workload.transfers}
    rounds = sum(1 for ins in pr.workload.programs[k] if isinstance(ins, Post) and (k, ins.tag) in with_bytes)
    lat = min(wait, rounds * latency_s)
    terms = {
        "ideal": ideal_s,
        "kernel_efficiency": mean - ideal_s,
        "imbalance": float(comp[k]) - mean,
        "merges": float(tl.busy("merge")[k]),
        "all_to_all": float(tl.busy("a2a")[k]),
        "latency": lat,
        "exposed_communication": wait - lat + float(tl.busy("collective")[k] + tl.busy("sync")[k]),
    }
    rest = float(tl.finish[k]) - sum(terms.values())
    terms["exposed_communication"] += rest  # any other span kind (none today); keeps the sum exact
    return terms

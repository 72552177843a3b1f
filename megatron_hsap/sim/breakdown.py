"""Where the time goes: a phase's makespan split into named terms that sum to it exactly.

For the critical rank ``k`` (the last to finish)::

    makespan = ideal                      Σ documents' FLOPs / kernel rate at their shape / P
             + kernel_efficiency          mean over ranks of kernel time − ideal (smaller blocks,
                                          launches, padding or document-blind work)
             + imbalance                  kernel time of k − mean kernel time, plus k's waits for
                                          peers that had not yet posted the round (a slower peer
                                          holds k up through the pairwise-synchronous P2P)
             + merges                     LSE merges and gradient accumulations on k
             + all_to_all                 intra-group all-to-alls on k (not overlapped)
             + latency                    per-round latency on k's waits once both sides posted
             + exposed_communication      the rest of those waits (bytes in flight), plus blocking
                                          collectives and their skew
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.ir import Phase

__all__ = ["TERMS", "phase_breakdown"]

TERMS = ("ideal", "kernel_efficiency", "imbalance", "merges", "all_to_all", "latency", "exposed_communication")


def phase_breakdown(run: object, phase: Phase | str, ideal_s: float, latency_s: float) -> dict[str, float]:
    """Terms of ``run``'s ``phase`` (a ``PhaseRun`` of ``methods.MethodRun``) in seconds."""
    pr = run.fwd if Phase(phase) is Phase.FWD else run.bwd  # type: ignore[attr-defined]
    tl = pr.timeline
    k = int(np.argmax(tl.finish))
    comp = tl.busy("compute")
    mean = float(comp.mean())
    skew = wait = lat = 0.0
    for s in tl.spans:
        if s.rank != k or s.kind != "wait":
            continue
        ready = tl.ready.get((k, s.tag), s.start)
        before = min(s.end, ready) - s.start if ready > s.start else 0.0  # peer had not posted yet
        skew += before
        flight = (s.end - s.start) - before
        lat += min(flight, latency_s)
        wait += flight
    terms = {
        "ideal": ideal_s,
        "kernel_efficiency": mean - ideal_s,
        "imbalance": float(comp[k]) - mean + skew,
        "merges": float(tl.busy("merge")[k]),
        "all_to_all": float(tl.busy("a2a")[k]),
        "latency": lat,
        "exposed_communication": wait - lat + float(tl.busy("collective")[k] + tl.busy("sync")[k]),
    }
    rest = float(tl.finish[k]) - sum(terms.values())
    terms["exposed_communication"] += rest  # any other span kind (none today); keeps the sum exact
    return terms

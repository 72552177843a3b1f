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

__all__ = ["TERMS", "phase_breakdown", "run_terms", "LossTable"]

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


def run_terms(run: object, cu: np.ndarray, shape: object, hw: object, P: int, latency_s: float) -> dict[str, float]:
    """``phase_breakdown`` of ``run`` summed over forward and backward, in seconds (ideal: every
    document at the kernel's rate for its shape over ``P`` GPUs, ``methods.ideal_seconds``)."""
    from megatron_hsap.sim.methods import ideal_seconds

    out = dict.fromkeys(TERMS, 0.0)
    for ph in Phase:
        for k, v in phase_breakdown(run, ph, ideal_seconds(cu, shape, hw, P, ph), latency_s).items():
            out[k] += v
    return out


class LossTable:
    """Where HSAP loses, as measured: for each point where HSAP's median is slower than a rival,
    the mean over the point's batches of HSAP's breakdown terms minus the rival's (ms, fwd + bwd;
    positive = HSAP spends more there), and the term that grows most — the miss's cause."""

    def __init__(self) -> None:
        self._acc: dict[tuple, list[dict[str, float]]] = {}
        self.rows: list[list[object]] = []

    def add(self, key: tuple, rival: str, hsap_terms: dict[str, float], rival_terms: dict[str, float]) -> None:
        """One batch of point ``key`` against ``rival`` (terms from ``run_terms``)."""
        self._acc.setdefault((key, rival), []).append({k: 1e3 * (hsap_terms[k] - rival_terms[k]) for k in TERMS})

    def close(self, key: tuple, rival: str, label: str, ratio: float) -> None:
        """Point ``key`` is done; keep its row when HSAP loses to ``rival`` (``ratio`` = rival
        time / HSAP time < 1)."""
        got = self._acc.pop((key, rival), [])
        if not got or not ratio < 1:
            return
        mean = {k: float(np.mean([d[k] for d in got])) for k in TERMS}
        worst = max(TERMS, key=mean.__getitem__)
        self.rows.append([*key, label, f"{ratio:.2f}×", *[mean[k] for k in TERMS], worst])

    def markdown(self, key_header: list[str]) -> list[str]:
        """The table (``markdown_table``) with its caption; nothing when HSAP never loses."""
        from megatron_hsap.sim.results import markdown_table

        if not self.rows:
            return []
        return ["Where HSAP loses, measured (`sim/breakdown.py`: HSAP's terms minus the rival's on the critical rank, "
                "ms forward + backward, mean over the point's batches; the last column is the term that grows most):", "",
                markdown_table([*key_header, "rival", "rival / HSAP", *TERMS, "cause"], self.rows), ""]

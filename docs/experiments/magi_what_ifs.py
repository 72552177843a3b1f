"""What-if measurements behind README's MagiAttention paragraph (issue 14): not shipped code.

The simulator is patched for the duration of one measurement; the patch says what is assumed.
Both run on the 10 evaluation batches of ``megatron-hsap simulate magi`` (``magi_batches(T, 10, 0)``:
the draw depends on the count), simulated H100 FA3-class, GQA 64:8, d 128, 8K tokens per GPU; % of the ideal, mean over the batches.

``8``: 8 GPUs as 8x1 (pure Ulysses, the tuner's topology; ``plan.head_chunks`` = 8 is one q head
per chunk, all sharing the rank's one kv head).

1. Head chunks 1, 2, 4 and 8 (``plan_options``).
2. Documents whole in one rank's 8K tokens kept home (they need no all-to-all): per batch, each
   rank's share of tokens in documents spanning ranks (the contiguous intra split); every
   all-to-all call's seconds scaled by (a) the largest share (the exchange waits for its busiest
   rank) and (b) the mean share (an upper bound: a permuted intra layout giving every rank the
   mean; compute, kernel efficiency and balance unchanged).

``64``: 64 GPUs as 4x16 (the tuner's topology; 2 kv heads per rank after the all-to-all, so at
4 or 8 head chunks 2 or 4 q chunks share a kv head and each re-sends its P2P kv rows).

3. Head chunks 2, 4 and 8 as shipped, and with a shared kv head's P2P rows sent once: the KV
   sends of every q chunk but a kv chunk's first, and the dK/dV returns of every one but its
   last, cost nothing.

    PYTHONPATH=. python docs/experiments/magi_what_ifs.py 8 64   # about a minute
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

import numpy as np

import megatron_hsap.sim.hsap as sim_hsap
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.methods import full_shape, ideal_seconds, run_method
from megatron_hsap.sim.protocols import MAGI_TOKENS_PER_GPU, magi_batches

HW, SHAPE = sim_hardware("h100-fa3"), full_shape(64, 8)


def spanning_share(cu: np.ndarray, ranks: int) -> np.ndarray:
    """[ranks] share of each rank's contiguous tokens that belong to documents spanning ranks."""
    region = int(cu[-1]) // ranks
    share = np.zeros(ranks)
    for a, b in zip(cu[:-1], cu[1:]):
        if a // region == (b - 1) // region:
            continue
        for r in range(ranks):
            share[r] += max(0, min(int(b), (r + 1) * region) - max(int(a), r * region))
    return share / region


def _of_ideal(cu: np.ndarray, P: int, intra: int, chunks: int | None) -> np.ndarray:
    """[fwd, bwd] share of the ideal: the same useful FLOPs, so the ideal's seconds over the run's."""
    run = run_method("hsap", cu, hw=HW, intra=intra, inter=P // intra, shape=SHAPE,
                     plan_options={"head_chunks": chunks} if chunks else None)
    return np.array([ideal_seconds(cu, SHAPE, HW, P, Phase.FWD) / run.fwd.seconds,
                     ideal_seconds(cu, SHAPE, HW, P, Phase.BWD) / run.bwd.seconds])


def _report(got: dict[str, list[np.ndarray]]) -> None:
    for name, v in got.items():
        f, b = np.mean(v, axis=0)
        print(f"{name:34s} {100 * f:5.1f}% / {100 * b:5.1f}% of the ideal (fwd / bwd, mean of {len(v)} batches)")


def eight_gpus(n: int = 10) -> None:
    original, scale = sim_hsap.a2a_calls, [1.0]

    def scaled(plan: object, cluster: object, phase: object, chunks: int = 1) -> tuple[list[float], list[float]]:
        before, after = original(plan, cluster, phase, chunks)
        return [x * scale[0] for x in before], [x * scale[0] for x in after]

    cases = {"chunks 1": (1, None), "chunks 2": (2, None), "chunks 4": (4, None), "chunks 8 (shipped)": (8, None),
             "home, largest share": (None, "max"), "home, mean share (bound)": (None, "mean")}
    got: dict[str, list[np.ndarray]] = {k: [] for k in cases}
    shares = []
    sim_hsap.a2a_calls = scaled
    try:
        for cu in magi_batches(MAGI_TOKENS_PER_GPU * 8, n, 0):
            cu = np.asarray(cu)
            share = spanning_share(cu, 8)
            shares.append(share)
            for name, (chunks, how) in cases.items():
                scale[0] = 1.0 if how is None else float(share.max() if how == "max" else share.mean())
                got[name].append(_of_ideal(cu, 8, 8, chunks))
    finally:
        sim_hsap.a2a_calls = original
    s = np.array(shares)
    print(f"spanning share per batch: largest {s.max(axis=1).min():.2f}-{s.max(axis=1).max():.2f}, "
          f"mean {s.mean(axis=1).min():.2f}-{s.mean(axis=1).max():.2f}")
    _report(got)


def sixty_four_gpus(n: int = 10) -> None:
    original = sim_hsap._sap
    per = [1]  # q chunks per kv chunk of the run in progress (0: every re-send charged)
    calls: Counter = Counter()  # per rank: SAP passes so far (one per head chunk, in chunk order)

    def once(b: object, r: int, prog: object, rows: object, shape: object, scale: dict, offset: int, phase: object,
             hw: object) -> None:  # fmt: skip
        c = calls[(id(b), r)]
        calls[(id(b), r)] += 1
        if per[0] > 1:
            scale = {**scale, **({Wire.KV: 0.0} if c % per[0] else {}), **({Wire.DKV: 0.0} if (c + 1) % per[0] else {})}
        original(b, r, prog, rows, shape, scale, offset, phase, hw)

    got: dict[str, list[np.ndarray]] = {}
    sim_hsap._sap = once
    try:
        for cu in magi_batches(MAGI_TOKENS_PER_GPU * 64, n, 0):
            cu = np.asarray(cu)
            for chunks in (None, 2, 4, 8):
                for sent_once in (False, True):
                    if chunks is None and sent_once:
                        continue
                    per[0] = max(1, (chunks or 1) // 2) if sent_once else 0  # 2 kv heads per rank at 4x16
                    name = f"chunks {chunks or 'planner'}" + (", kv sent once" if sent_once else "")
                    got.setdefault(name, []).append(_of_ideal(cu, 64, 4, chunks))
    finally:
        sim_hsap._sap = original
    _report(got)


def main(argv: list[str]) -> None:
    runs: dict[str, Callable[[], None]] = {"8": eight_gpus, "64": sixty_four_gpus}
    for gpus in argv or ["8"]:
        if gpus not in runs:
            raise SystemExit(f"usage: magi_what_ifs.py [8] [64] (got {gpus!r})")
        runs[gpus]()


if __name__ == "__main__":
    main(sys.argv[1:])

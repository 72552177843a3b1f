"""The baselines' real schedules as engine programs (point-to-point rings and helpers).

Every function returns ``(workload, gpus)`` for one phase: the engine programs of the ranks it
simulates and their CP ranks (for link classes). Kernel calls are one varlen call per step over
every document block of that step (``Blocks``), priced by the kernel curve; merges and gradient
accumulations are memory-bound kernels priced by the implementation's bytes per element
(``constants.MERGE_BYTES``). Communication is simulated transfer by transfer.

Schedules (read from each code base; the module docstring of ``plan/baselines.py`` prices the
same ones with flat rates):

* ``ring_schedule``: the P-step KV ring shared by ring-flash-attention (naive and zigzag varlen),
  Transformer Engine's THD p2p (per-document zigzag, every document padded to a multiple of 2P)
  and the ring part of USP / TE a2a+p2p. Forward step s: post KV to r+1 (steps < P−1), compute
  the step's blocks, merge the partial output, wait. Backward step s: post KV, compute, fold dq,
  wait for the dKV that arrives from r−1, fold this step's dKV into it, wait for KV, post dKV to
  r+1; after the last step dKV has travelled home (ring-flash-attention's order; TE sends KV and
  dKV in one round, which the same timeline approximates).
* ``distflashattn_schedule``: LightSeq's balanced causal schedule, document-blind (the batch is
  one causal sequence); idle ranks receive q, compute, and return o/lse (dq in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Phase, Wire
from megatron_hsap.sim.builder import Blocks, Builder, causal_pairs
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import merge_bytes
from megatron_hsap.sim.engine import Workload

__all__ = [
    "RingSteps",
    "zigzag_steps",
    "contiguous_ring_steps",
    "ring_schedule",
    "distflashattn_schedule",
    "pad_lengths",
]


def pad_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Every document padded up to a multiple of ``multiple`` (TE THD: 2·CP); empty stay empty."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // multiple) * multiple


@dataclass(frozen=True, slots=True)
class RingSteps:
    """What a ring computes: ``blocks[r][s]`` on rank r at step s (KV of rank r−s), the q rows
    whose output it merges (``out_rows``) and the kv rows whose gradient it folds (``kv_rows``)."""

    blocks: list[list[Blocks]]
    out_rows: np.ndarray  # [P, P]
    kv_rows: np.ndarray  # [P, P]
    extra_bytes: np.ndarray  # [P, P] extra HBM bytes per step (index gathers)
    local_tokens: float  # tokens (incl. padding) each rank holds: KV bytes per round = this × kv

    @property
    def work(self) -> np.ndarray:
        """Pairs per rank, float64 ``[P]``."""
        return np.array([sum(b.work for b in row) for row in self.blocks])


def zigzag_steps(chunk: np.ndarray, P: int, *, gather_extra: float = 0.0, width: float = 0.0) -> RingSteps:
    """Per-document zigzag (rank r holds chunks r and 2P−1−r of every document; ``chunk[d]`` =
    c_d, the chunk size of document d). Step 0: causal 2c × 2c; steps 1..r: q (2c) against the
    front half of the received kv (c); steps > r: the back half of q (c) against all of it (2c).
    ``gather_extra`` × ``width`` bytes per gathered row model ring-flash-attention's
    ``out[half_index1]`` gathers on the back-half steps."""
    c = np.asarray(chunk, dtype=np.float64)
    c = c[c > 0]
    blocks: list[list[Blocks]] = []
    out_rows = np.zeros((P, P))
    kv_rows = np.zeros((P, P))
    extra = np.zeros((P, P))
    for r in range(P):
        row = []
        for s in range(P):
            if s == 0:
                row.append(Blocks.of(2 * c, 2 * c, 2 * c * c + c))
                out_rows[r, s] = kv_rows[r, s] = 2 * c.sum()
            elif s <= r:
                row.append(Blocks.of(2 * c, c, 2 * c * c))
                out_rows[r, s], kv_rows[r, s] = 2 * c.sum(), c.sum()
            else:
                row.append(Blocks.of(c, 2 * c, 2 * c * c))
                out_rows[r, s], kv_rows[r, s] = c.sum(), 2 * c.sum()
                extra[r, s] = gather_extra * width * c.sum() if len(c) > 1 else 0.0
        blocks.append(row)
    return RingSteps(blocks, out_rows, kv_rows, extra, float(2 * c.sum()))


def contiguous_ring_steps(piece: np.ndarray, P: int) -> RingSteps:
    """ring-flash-attention's naive varlen ring: rank r holds the r-th of P equal pieces
    (``piece[d]`` tokens) of every document; step s ≤ r computes against rank r−s's pieces
    (causal at s = 0, full otherwise); steps s > r are idle (the KV still travels)."""
    m = np.asarray(piece, dtype=np.float64)
    m = m[m > 0]
    empty = Blocks.of([], [], [])
    blocks = []
    out_rows = np.zeros((P, P))
    kv_rows = np.zeros((P, P))
    for r in range(P):
        row = []
        for s in range(P):
            if s == 0:
                row.append(Blocks.of(m, m, causal_pairs(m)))
            elif s <= r:
                row.append(Blocks.of(m, m, m * m))
            else:
                row.append(empty)
                continue
            out_rows[r, s] = kv_rows[r, s] = m.sum()
        blocks.append(row)
    return RingSteps(blocks, out_rows, kv_rows, np.zeros((P, P)), float(m.sum()))


def ring_schedule(
    steps: RingSteps,
    shape: HeadShape,
    cluster: Cluster,
    gpus: list[int],
    phase: Phase | str,
    *,
    impl: str,
    dkv_bytes_per_elem: int,
    before: list[float] = (),  # type: ignore[assignment]
    after: list[float] = (),  # type: ignore[assignment]
) -> tuple[Workload, list[int]]:
    """The KV ring (module docstring) for one phase. ``before``/``after``: seconds of blocking
    all-to-alls around the ring (USP / TE a2a+p2p), identical on every rank."""
    hw = cluster.hw
    P = len(gpus)
    b = Builder(P)
    h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
    kv_bytes = steps.local_tokens * shape.token_bytes(Wire.KV)
    dkv_bytes = steps.local_tokens * hkv * (d + dv) * dkv_bytes_per_elem
    kv_tags = [b.new_tag() for _ in range(P)]
    dkv_tags = [b.new_tag() for _ in range(P)]
    for r in range(P):
        nxt = (r + 1) % P
        for t in before:
            b.busy(r, t, "a2a", "all-to-all in")
        for s in range(P):
            if s < P - 1:
                b.send(kv_tags[s], r, nxt, kv_bytes, "kv")
                b.post(r, kv_tags[s])
            blocks = steps.blocks[r][s]
            if impl == "te" and s < P - 1:  # THD p2p ring: a fixed cost per step that posts a transfer
                b.busy(r, hw.te_step_s, "host", f"step {s} setup")  # (sim/calibrate.py fits it)
            if impl == "te" and not blocks.empty:
                b.fa3_wrapper(r, steps.out_rows[r, s], steps.kv_rows[r, s], shape, phase, hw)
            b.kernel(r, blocks, hw, shape, phase, f"step {s}")
            if phase == Phase.FWD:
                if s > 0 and not blocks.empty:
                    b.elementwise(r, steps.out_rows[r, s] * h * dv * merge_bytes(impl, Phase.FWD) + steps.extra_bytes[r, s], hw)
            else:
                if s > 0 and not blocks.empty:
                    b.elementwise(r, steps.out_rows[r, s] * h * d * merge_bytes(impl, Phase.BWD) + steps.extra_bytes[r, s], hw, "dq")
                if s > 0:
                    b.wait(r, dkv_tags[s - 1])
                    if not blocks.empty:
                        b.elementwise(r, steps.kv_rows[r, s] * hkv * (d + dv) * merge_bytes(impl, Phase.BWD), hw, "dkv")
            if s < P - 1:
                b.wait(r, kv_tags[s])
            if phase == Phase.BWD and P > 1:
                b.send(dkv_tags[s], r, nxt, dkv_bytes, "dkv")
                b.post(r, dkv_tags[s])
        if phase == Phase.BWD and P > 1:
            b.wait(r, dkv_tags[P - 1])
        for t in after:
            b.busy(r, t, "a2a", "all-to-all out")
    return b.build(), list(gpus)


def distflashattn_schedule(T: int, shape: HeadShape, cluster: Cluster, phase: Phase | str) -> tuple[Workload, list[int]]:
    """DistFlashAttn (LightSeq), document-blind, on CP ranks ``0..P−1`` (``plan/baselines.py``
    describes the steps). Round t is posted at the start of step t and carries the inputs of
    step t+1 and the returns of step t−1; round S+1 returns the last step's results."""
    hw = cluster.hw
    P = cluster.cp_size
    L = float(-(-T // P))
    S = P // 2
    h, hkv, d, dv = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v
    tb = shape.token_bytes
    b = Builder(P)
    tags = [b.new_tag() for _ in range(S + 2)]

    def helping(s: int) -> bool:
        return 1 <= s <= S and 2 * s != P

    if phase == Phase.FWD:
        q_pack, back_q, back_kv = tb(Wire.Q), tb(Wire.O) + tb(Wire.LSE), 0.0
    else:  # LightSeq allocates dq and dk/dv deltas like q and k/v (activation dtype)
        q_pack = tb(Wire.Q) + tb(Wire.LSE) + tb(Wire.O) + tb(Wire.DO)
        back_q, back_kv = tb(Wire.Q), tb(Wire.KV)
    for s in range(1, S + 1):  # inputs of step s travel in round s−1
        for r in range(P):
            if r - s >= 0:
                b.send(tags[s - 1], r - s, r, L * tb(Wire.KV), "kv")
            elif helping(s):
                b.send(tags[s - 1], r + P - s, r, L * q_pack, "q")
    for s in range(1, S + 1):  # returns of step s travel in round s+1
        for r in range(P):
            if r < s and helping(s):
                b.send(tags[s + 1], r, r + P - s, L * back_q, "o" if phase == Phase.FWD else "dq")
            if r >= s and back_kv:
                b.send(tags[s + 1], r, r - s, L * back_kv, "dkv")
    diag = Blocks.of([L], [L], causal_pairs(L))
    full = Blocks.of([L], [L], [L * L])
    width_o = h * (dv if phase == Phase.FWD else d)
    for r in range(P):
        for t in range(S + 2):
            b.post(r, tags[t])
            if t == 0:
                b.kernel(r, diag, hw, shape, phase, "step 0")
            elif t <= S and (r >= t or helping(t)):
                b.kernel(r, full, hw, shape, phase, f"step {t}")
                if r >= t:  # own q rows: fold the partial in
                    b.elementwise(r, L * width_o * merge_bytes("distflashattn", phase), hw)
                elif phase == Phase.BWD:  # helper: dk/dv of its own kv
                    b.elementwise(r, L * hkv * (d + dv) * merge_bytes("distflashattn", Phase.BWD), hw, "dkv")
            b.wait(r, tags[t])
            s = t - 1  # returns of step s arrived in round t
            if 1 <= s <= S:
                if helping(s) and r >= P - s:
                    b.elementwise(r, L * width_o * merge_bytes("distflashattn", phase), hw, "merge returned")
                if back_kv and r + s < P:
                    b.elementwise(r, L * hkv * (d + dv) * merge_bytes("distflashattn", Phase.BWD), hw, "dkv returned")
    return b.build(), list(range(P))

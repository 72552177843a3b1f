"""Kernel-rate calibration by block shape, its YAML, and the per-rank kernel-time comparison.

Part of the GPU check (:mod:`megatron_hsap.bench.gpu_check`). The simulator prices one varlen
kernel call over blocks ``(n_q, n_kv, flops)`` as (``sim/config.py``, ``plan/hardware.py``)::

    t = launch_s + Σ flops / (peak_phase · eff(n))  [+ cta_s · ⌈max n_kv / 128⌉ · H · blocks, backward]
    eff(n) = n / (n + half_rate_tokens),  n = min(n_q, n_kv)

(the bracket is ``KernelModel.grid_time``: a varlen backward's grid is sized by its longest kv
block, so calls mixing one long and many short blocks pay for idle CTAs). For a fixed
``half_rate_tokens`` this is linear in ``(launch_s, 1/peak_fwd, 1/peak_bwd, cta_s)``; :func:`fit`
solves it by least squares on relative errors over a grid of ``half_rate_tokens`` (shared by
both phases, as in the simulator) and keeps the best. The measurement grid (:func:`grid`) is
forward/backward × causal/rectangle × every q×kv size pair as equal blocks, plus "ragged"
backward calls (one long block and many short ones) that pin ``cta_s``. FLOPs per block are
docs/design.md §4's: ``2·H·(d_qk + d_v)·work`` forward, 2.5× that backward, ``work`` the
unmasked (q, k) pairs.

The YAML written is exactly what ``megatron-hsap simulate --config`` reads
(``sim.config.load_overrides``: ``hardware: {name: {field: value}}``), written by hand because
the GPU box has no PyYAML; :func:`read_calibration` reads it back without PyYAML too, and
:func:`planner_hardware` / :func:`register_planner_hardware` turn it into the planner's
``plan.hardware.Hardware`` (flat rates = the fitted curve at ``PLANNER_REFERENCE_TOKENS``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.window import staircase_pairs

__all__ = [
    "Measurement", "Calibration", "block_work", "block_flops", "call_flops", "grid", "fit", "write_calibration",
    "read_calibration", "planner_hardware", "register_planner_hardware", "PLANNER_REFERENCE_TOKENS", "CALIBRATION_FIELDS",
]  # fmt: skip

PLANNER_REFERENCE_TOKENS = 8192  # the planner's flat rates: the curve at 8K blocks (docs/design.md §4's peaks)
CALIBRATION_FIELDS = ("attn_fwd_peak", "attn_bwd_peak", "half_rate_tokens", "launch_s", "cta_s")


def block_work(nq: int, nk: int, causal: bool) -> int:
    """Unmasked (q, k) pairs of one block: a dense rectangle, or bottom-right causal (query
    ``i`` of ``nq`` sees keys ``j <= i + nk - nq``)."""
    if not causal:
        return nq * nk
    if nq <= nk:  # query i sees i + nk - nq + 1 keys
        return staircase_pairs(nq, nk - nq + 1)
    return staircase_pairs(nk)  # the first nq - nk queries see no key


def block_flops(work: int, heads: int, d: int, dv: int, phase: Phase | str) -> float:
    """docs/design.md §4: 2·H·(d_qk + d_v)·work forward, 2.5× that backward."""
    fwd = 2.0 * heads * (d + dv) * work
    return fwd if phase == Phase.FWD else 2.5 * fwd


Block = tuple[int, int]  # (n_q, n_kv) of one document block of a varlen call


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One timed varlen kernel call over ``blocks`` (all causal or all rectangles)."""

    phase: str  # "fwd" | "bwd"
    causal: bool
    blocks: tuple[Block, ...]
    heads: int  # query heads
    flops: float  # of the whole call
    seconds: float  # median over repeats

    @property
    def label(self) -> str:
        first, n = self.blocks[0], len(self.blocks)
        if all(b == first for b in self.blocks):
            return f"{n} blocks {first[0]}x{first[1]}"
        return f"ragged: 1 block {max(b[1] for b in self.blocks)} + {n - 1} short"


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """The fitted curve (the simulator's fields) and how well it fits."""

    attn_fwd_peak: float
    attn_bwd_peak: float
    half_rate_tokens: float
    launch_s: float
    cta_s: float  # seconds per CTA of a varlen backward's grid (``KernelModel.grid_time``)
    max_rel_error: float  # of the model over the measurements
    median_rel_error: float

    def __post_init__(self) -> None:
        for name in CALIBRATION_FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name != "launch_s" and value <= 0):
                raise ConfigError(f"calibration {name}={value!r} is not a positive finite number")

    def call_seconds(self, phase: Phase | str, blocks: Sequence[Block], flops: Sequence[float], heads: int) -> float:
        """Seconds of one varlen call over ``blocks`` of ``flops`` each: the simulator's
        ``KernelModel.call_time`` plus ``grid_time`` (launch, curve, backward grid)."""
        peak = self.attn_fwd_peak if phase == Phase.FWD else self.attn_bwd_peak
        t = self.launch_s
        for (nq, nk), fl in zip(blocks, flops):
            n = max(1, min(nq, nk))
            t += fl * (n + self.half_rate_tokens) / (peak * n)
        if phase == Phase.BWD and blocks:
            t += self.cta_s * math.ceil(max(nk for _, nk in blocks) / 128) * heads * len(blocks)
        return t


def grid(sizes: Sequence[int], tokens_per_call: int) -> list[tuple[str, bool, tuple[Block, ...]]]:
    """``(phase, causal, blocks)`` of every call to time: each phase, mask and q×kv size pair as
    equal blocks filling about ``tokens_per_call`` kv tokens (short blocks are measured as the
    planner issues them, many documents in one varlen call); then ragged backward calls, one
    block of each of the two largest sizes plus short blocks of the smallest (``cta_s``)."""
    out = []
    for phase in Phase:
        for causal in (True, False):
            for nq in sizes:
                for nk in sizes:
                    if causal and nk < nq:
                        continue  # a causal block's kv ends where its q ends: nk >= nq
                    out.append((phase, causal, ((nq, nk),) * max(1, tokens_per_call // max(nq, nk))))
    short = min(sizes)
    for long in sorted(sizes)[-2:]:
        for causal in (True, False):
            many = max(1, tokens_per_call // short - 1)
            out.append((Phase.BWD, causal, ((long, long),) + ((short, short),) * many))
    return out


def call_flops(m_blocks: Sequence[Block], causal: bool, heads: int, d: int, dv: int, phase: Phase | str) -> list[float]:
    """FLOPs of each block of one call."""
    return [block_flops(block_work(nq, nk, causal), heads, d, dv, phase) for nq, nk in m_blocks]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray, free: int) -> np.ndarray:
    """Least squares with columns ``free:`` forced >= 0 by dropping the negative ones (a
    negative launch or CTA cost is noise); columns before ``free`` must come out positive."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        negative = [j for j in keep if j >= free and coef[j] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda j: coef[j]))


def fit(measurements: Sequence[Measurement]) -> Calibration:
    """Least-squares fit of the simulator's kernel model (relative errors; launch and CTA costs
    non-negative)."""
    if len({m.phase for m in measurements}) < 2:
        raise ConfigError("calibration needs forward and backward measurements")
    t = np.array([m.seconds for m in measurements])
    is_fwd = np.array([m.phase == Phase.FWD for m in measurements])
    # per call: A = Σ flops, B = Σ flops / n over its blocks, so Σ flops·(1 + half/n) = A + half·B;
    # flops per block from the call's total, split in proportion to each block's work
    a_sum, b_sum, ctas = np.zeros(len(t)), np.zeros(len(t)), np.zeros(len(t))
    for i, m in enumerate(measurements):
        works = np.array([block_work(nq, nk, m.causal) for nq, nk in m.blocks], dtype=np.float64)
        fl = m.flops * works / works.sum()
        n = np.array([max(1, min(nq, nk)) for nq, nk in m.blocks], dtype=np.float64)
        a_sum[i], b_sum[i] = fl.sum(), (fl / n).sum()
        if m.phase == Phase.BWD:
            ctas[i] = math.ceil(max(nk for _, nk in m.blocks) / 128) * m.heads * len(m.blocks)
    w = 1.0 / t  # relative errors: every shape counts alike, whatever its duration
    best = None
    for half in np.geomspace(1.0, 1e5, 321):
        scale = a_sum + half * b_sum  # seconds × peak of the call's blocks
        cols = [np.where(is_fwd, scale, 0.0), np.where(is_fwd, 0.0, scale), np.ones_like(t), ctas]
        a = np.stack(cols, 1) * w[:, None]
        coef = _nonnegative_lstsq(a, t * w, free=2)
        if coef[0] <= 0 or coef[1] <= 0:
            continue
        rel = np.abs(a @ coef - t * w)
        if best is None or rel.sum() < best[0]:
            best = (float(rel.sum()), float(half), coef, rel)
    if best is None:
        raise ConfigError("calibration fit failed: the timings do not grow with the FLOPs (re-run the check)")
    _, half, coef, rel = best
    return Calibration(attn_fwd_peak=1.0 / coef[0], attn_bwd_peak=1.0 / coef[1], half_rate_tokens=half,
                       launch_s=float(coef[2]), cta_s=float(coef[3]), max_rel_error=float(rel.max()),
                       median_rel_error=float(np.median(rel)))  # fmt: skip


def write_calibration(path: str | Path, cal: Calibration, hardware: str, header: Sequence[str] = ()) -> Path:
    """The simulator's ``--config`` YAML for ``hardware`` (written by hand: no PyYAML needed)."""
    lines = [f"# {line}" for line in header]
    lines += [
        f"# fit: median relative error {cal.median_rel_error:.3%}, max {cal.max_rel_error:.3%}",
        "hardware:",
        f"  {hardware}:",
    ]
    lines += [f"    {name}: {float(getattr(cal, name))!r}" for name in CALIBRATION_FIELDS]
    # The fit is of the saturating curve; without this the simulator's tile model (tile 128 in
    # sim/constants.py) would price kernels and silently ignore the measured half_rate_tokens.
    lines.append("    tile: 0.0  # price kernels with the fitted curve, not the simulator's tile model")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def read_calibration(path: str | Path) -> tuple[str, dict[str, float]]:
    """``(hardware name, fields)`` of a file :func:`write_calibration` wrote (no PyYAML)."""
    name, fields, section = None, {}, None
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key, _, value = line.strip().partition(":")
        if depth == 0:
            section = key
        elif depth == 1 and section == "hardware":
            if name is not None:
                raise ConfigError(f"{path}: one hardware entry expected, found {name!r} and {key!r}")
            name = key
        elif depth == 2 and name is not None:
            fields[key] = float(value)
    if name is None or set(fields) - {"tile"} != set(CALIBRATION_FIELDS):  # tile: write_calibration's model switch
        raise ConfigError(f"{path}: expected hardware: {{name: {{{', '.join(CALIBRATION_FIELDS)}}}}}, got {name!r} {sorted(fields)}")
    return name, fields


def planner_hardware(path: str | Path):  # -> plan.hardware.Hardware
    """The planner's ``Hardware`` of the calibrated GPU: the built-in set of the same name with
    the flat attention rates replaced by the fitted curve at ``PLANNER_REFERENCE_TOKENS`` and the
    curve (``KernelCurve``) by the fitted one; links and latencies unchanged."""
    from megatron_hsap.plan.hardware import HARDWARE, KernelCurve, KernelModel

    name, c = read_calibration(path)
    if name not in HARDWARE:
        raise ConfigError(f"{path}: hardware {name!r} is not a planner set; known: {sorted(HARDWARE)}")
    n = PLANNER_REFERENCE_TOKENS
    eff = n / (n + c["half_rate_tokens"])
    return dataclasses.replace(
        HARDWARE[name], name=f"{name}-calibrated", attn_fwd_flops=c["attn_fwd_peak"] * eff,
        attn_bwd_flops=c["attn_bwd_peak"] * eff,
        kernel=KernelModel(fwd_peak=c["attn_fwd_peak"], bwd_peak=c["attn_bwd_peak"],  # the fitted saturating curve (tile 0)
                           curve=KernelCurve(half_rate_tokens=c["half_rate_tokens"], launch_s=c["launch_s"])),
    )  # fmt: skip


def register_planner_hardware(path: str | Path, name: str | None = None) -> str:
    """Make the calibration selectable as ``compile_plan(..., hardware=NAME)`` (process-wide);
    returns NAME (default ``<gpu>-calibrated``). Built-in names cannot be replaced."""
    from megatron_hsap.plan import hardware as hw_mod

    hw = planner_hardware(path)
    name = name or hw.name
    builtin = {"a100", "h100", "h100-fa3", "h200"}
    if name in builtin:
        raise ConfigError(f"hardware name {name!r} is built in; register the calibration under another name")
    hw_mod.HARDWARE[name] = dataclasses.replace(hw, name=name)
    return name


# ----------------------------------------------------------------------------- per-rank comparison
def rank_calls(plan, rank: int, phase: Phase | str) -> list[list[tuple[int, int, bool]]]:
    """The kernel calls of one inter rank's program: per ``Compute`` stage, its items'
    ``(n_q, n_kv, causal)`` grouped by mask (one varlen call per mask and stage)."""
    from megatron_hsap.plan.ir import Compute

    calls = []
    for ins in plan.program(rank, phase).instrs:
        if isinstance(ins, Compute):
            for causal in (True, False):
                items = [(len(it.q), len(it.kv), causal) for it in ins.items if it.causal is causal]
                if items:
                    calls.append(items)
    return calls


def compare_ranks(
    plan, cal: Calibration, heads: int, d: int, dv: int, time_call: Callable[[str, list[tuple[int, int, bool]]], float]
) -> list[dict[str, float]]:
    """Per inter rank: planned work (pairs), the model's kernel seconds for its calls, and the
    measured kernel seconds (``time_call(phase, items)``), forward + backward."""
    work = plan.stats().work_per_rank
    rows = []
    for rank in range(plan.inter_size):
        predicted = measured = 0.0
        for phase in Phase:
            for items in rank_calls(plan, rank, phase):
                blocks = [(nq, nk) for nq, nk, _ in items]
                predicted += cal.call_seconds(phase, blocks, call_flops(blocks, items[0][2], heads, d, dv, phase), heads)
                measured += time_call(phase, items)
        rows.append({"rank": rank, "work": float(work[rank]), "predicted_s": predicted, "measured_s": measured,
                     "measured_over_predicted": measured / predicted if predicted else float("nan")})  # fmt: skip
    return rows

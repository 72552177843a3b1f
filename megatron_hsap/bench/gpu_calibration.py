"""Kernel-rate calibration by block shape, its YAML, and the per-rank kernel-time comparison.

Part of the GPU check (:mod:`megatron_hsap.bench.gpu_check`). The simulator prices one varlen
kernel call over blocks ``(n_q, n_kv, flops)`` as (``sim/config.py``, ``plan/hardware.py``)::

    t = launch_s + Σ flops / (peak_phase · eff(n)),   eff(n) = n / (n + half_rate_tokens),  n = min(n_q, n_kv)

With ``a = 1/peak`` and ``b = half_rate_tokens/peak`` that is linear in ``(launch_s, a, b)``:
``t = launch_s + a·flops + b·flops/n``. :func:`fit` solves it by least squares on relative errors
for a grid of ``half_rate_tokens`` shared by forward and backward (as the simulator shares it)
and keeps the best. FLOPs per block are docs/design.md §4's: ``2·H·(d_qk + d_v)·work`` forward,
2.5× that backward, with ``work`` the unmasked (q, k) pairs.

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

__all__ = [
    "Measurement", "Calibration", "block_work", "block_flops", "grid", "fit", "write_calibration",
    "read_calibration", "planner_hardware", "register_planner_hardware", "PLANNER_REFERENCE_TOKENS",
]  # fmt: skip

PLANNER_REFERENCE_TOKENS = 8192  # the planner's flat rates: the curve at 8K blocks (docs/design.md §4's peaks)
_FIELDS = ("attn_fwd_peak", "attn_bwd_peak", "half_rate_tokens", "launch_s")


def block_work(nq: int, nk: int, causal: bool) -> int:
    """Unmasked (q, k) pairs of one block: a dense rectangle, or bottom-right causal (query
    ``i`` of ``nq`` sees keys ``j <= i + nk - nq``)."""
    if not causal:
        return nq * nk
    if nq <= nk:  # query i sees i + nk - nq + 1 keys
        return nq * (nk - nq) + nq * (nq + 1) // 2
    return nk * (nk + 1) // 2  # the first nq - nk queries see no key


def block_flops(work: int, heads: int, d: int, dv: int, phase: str) -> float:
    """docs/design.md §4: 2·H·(d_qk + d_v)·work forward, 2.5× that backward."""
    fwd = 2.0 * heads * (d + dv) * work
    return fwd if phase == "fwd" else 2.5 * fwd


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One timed kernel call: ``docs`` equal blocks of ``nq × nk`` in one varlen call."""

    phase: str  # "fwd" | "bwd"
    causal: bool
    nq: int
    nk: int
    docs: int
    flops: float  # of the whole call
    seconds: float  # median over repeats


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """The fitted curve (the simulator's fields) and how well it fits."""

    attn_fwd_peak: float
    attn_bwd_peak: float
    half_rate_tokens: float
    launch_s: float
    max_rel_error: float  # of the model over the measurements
    median_rel_error: float

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name != "launch_s" and value <= 0):
                raise ConfigError(f"calibration {name}={value!r} is not a positive finite number")

    def predict(self, phase: str, nq: int, nk: int, flops: float) -> float:
        """Seconds of one call of ``flops`` over blocks of ``nq × nk`` (launch included)."""
        peak = self.attn_fwd_peak if phase == "fwd" else self.attn_bwd_peak
        n = max(1, min(nq, nk))
        return self.launch_s + flops * (n + self.half_rate_tokens) / (peak * n)


def grid(sizes: Sequence[int], tokens_per_call: int) -> list[tuple[str, bool, int, int, int]]:
    """``(phase, causal, nq, nk, docs)`` for every phase, mask and q×kv size pair; ``docs`` fills
    about ``tokens_per_call`` kv tokens per call (at least one block), so short blocks are
    measured as the planner issues them: many documents in one varlen call."""
    out = []
    for phase in ("fwd", "bwd"):
        for causal in (True, False):
            for nq in sizes:
                for nk in sizes:
                    if causal and nk < nq:
                        continue  # a causal block's kv ends where its q ends: nk >= nq
                    out.append((phase, causal, nq, nk, max(1, tokens_per_call // max(nq, nk))))
    return out


def fit(measurements: Sequence[Measurement]) -> Calibration:
    """Least-squares fit of the simulator's kernel model (relative errors, non-negative launch)."""
    if len({m.phase for m in measurements}) < 2:
        raise ConfigError("calibration needs forward and backward measurements")
    t = np.array([m.seconds for m in measurements])
    f = np.array([m.flops for m in measurements])
    n = np.array([max(1, min(m.nq, m.nk)) for m in measurements], dtype=np.float64)
    is_fwd = np.array([m.phase == "fwd" for m in measurements])
    w = 1.0 / t  # relative errors: every shape counts alike, whatever its duration
    best = None
    for half in np.geomspace(1.0, 1e5, 321):
        scale = f * (1.0 + half / n)  # seconds × peak, of the whole call (docs blocks)
        cols = [np.ones_like(t), np.where(is_fwd, scale, 0.0), np.where(is_fwd, 0.0, scale)]
        a = np.stack(cols, 1) * w[:, None]
        coef, *_ = np.linalg.lstsq(a, t * w, rcond=None)
        if coef[0] < 0:  # a negative launch cost is noise: refit without it
            coef = np.concatenate([[0.0], np.linalg.lstsq(a[:, 1:], t * w, rcond=None)[0]])
        if coef[1] <= 0 or coef[2] <= 0:
            continue
        rel = np.abs(a @ coef - t * w)
        if best is None or rel.sum() < best[0]:
            best = (float(rel.sum()), float(half), coef, rel)
    if best is None:
        raise ConfigError("calibration fit failed: the timings do not grow with the FLOPs (re-run the check)")
    _, half, coef, rel = best
    return Calibration(attn_fwd_peak=1.0 / coef[1], attn_bwd_peak=1.0 / coef[2], half_rate_tokens=half,
                       launch_s=float(coef[0]), max_rel_error=float(rel.max()),
                       median_rel_error=float(np.median(rel)))  # fmt: skip


def write_calibration(path: str | Path, cal: Calibration, hardware: str, header: Sequence[str] = ()) -> Path:
    """The simulator's ``--config`` YAML for ``hardware`` (written by hand: no PyYAML needed)."""
    lines = [f"# {line}" for line in header]
    lines += [
        f"# fit: median relative error {cal.median_rel_error:.3%}, max {cal.max_rel_error:.3%}",
        "hardware:",
        f"  {hardware}:",
    ]
    lines += [f"    {name}: {float(getattr(cal, name))!r}" for name in _FIELDS]
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
    if name is None or set(fields) != set(_FIELDS):
        raise ConfigError(f"{path}: expected hardware: {{name: {{{', '.join(_FIELDS)}}}}}, got {name!r} {sorted(fields)}")
    return name, fields


def planner_hardware(path: str | Path):  # -> plan.hardware.Hardware
    """The planner's ``Hardware`` of the calibrated GPU: the built-in set of the same name with
    the flat attention rates replaced by the fitted curve at ``PLANNER_REFERENCE_TOKENS`` and the
    curve (``KernelCurve``) by the fitted one; links and latencies unchanged."""
    from megatron_hsap.plan.hardware import HARDWARE, KernelCurve

    name, c = read_calibration(path)
    if name not in HARDWARE:
        raise ConfigError(f"{path}: hardware {name!r} is not a planner set; known: {sorted(HARDWARE)}")
    n = PLANNER_REFERENCE_TOKENS
    eff = n / (n + c["half_rate_tokens"])
    return dataclasses.replace(
        HARDWARE[name], name=f"{name}-calibrated", attn_fwd_flops=c["attn_fwd_peak"] * eff,
        attn_bwd_flops=c["attn_bwd_peak"] * eff,
        kernel=KernelCurve(half_rate_tokens=c["half_rate_tokens"], launch_s=c["launch_s"]),
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
def rank_calls(plan, rank: int, phase: str) -> list[list[tuple[int, int, bool]]]:
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
    work = plan.stats()["work_per_rank"]
    rows = []
    for rank in range(plan.inter_size):
        predicted = measured = 0.0
        for phase in ("fwd", "bwd"):
            for items in rank_calls(plan, rank, phase):
                flops = [block_flops(block_work(nq, nk, c), heads, d, dv, phase) for nq, nk, c in items]
                predicted += cal.launch_s + sum(
                    cal.predict(phase, nq, nk, fl) - cal.launch_s for (nq, nk, _), fl in zip(items, flops)
                )
                measured += time_call(phase, items)
        rows.append({"rank": rank, "work": float(work[rank]), "predicted_s": predicted, "measured_s": measured,
                     "measured_over_predicted": measured / predicted if predicted else float("nan")})  # fmt: skip
    return rows

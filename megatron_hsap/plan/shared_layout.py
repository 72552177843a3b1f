"""Plans of one batch for several sliding windows on ONE token layout (issue 15 item 1).

A model mixing full-attention and sliding-window layers (Gemma, Mistral, GPT-OSS) shards its batch
once: the layout is chosen on the full-attention plan (``compile_plan`` without a window) and the
plan of every other window is compiled on that layout (``Plan.with_window``), so every layer's
plan holds the same tokens on the same ranks. Such plans are cached beside ``compile_plan``'s
(keyed by the layout's segments too: a windowed plan compiled on its own chooses its own layout,
another plan under the same options).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.plan.cache import PLAN_CACHE
from megatron_hsap.plan.window import normalize_window

if TYPE_CHECKING:
    from megatron_hsap.plan.plan import Plan

__all__ = ["compile_on_layout", "plans_for_windows", "no_slower_than_full"]


def compile_on_layout(base: "Plan", window_size: object) -> "Plan":
    """``base``'s batch and options under ``window_size`` (``None``: full causal), on ``base``'s
    layout; ``base`` itself when the window is its own."""
    from megatron_hsap.plan import plan as _plan

    window = normalize_window(window_size)
    if window == base.options.window_size:
        return base
    opts = replace(base.options, window_size=window).validate()
    key = (base.batch.cu_seqlens, opts, base.layout.segments)
    hit = PLAN_CACHE.get(key)
    if hit is not None:
        return hit
    got = _plan._compile_on(base.layout, base.batch, base.shape, opts)
    if window is not None and base.options.window_size is None:
        got = _with_clipped(got, base)
    PLAN_CACHE.put(key, got)
    return got


def plans_for_windows(base: "Plan", windows: object) -> dict[tuple[int, int] | None, "Plan"]:
    """One plan per distinct window of ``windows`` (each ``None`` or ``(left, right)``), all on
    ``base``'s layout; keys are the normalised windows (``None`` or ``(left, 0)``)."""
    out: dict[tuple[int, int] | None, "Plan"] = {}
    for w in windows:
        key = normalize_window(w)
        if key not in out:
            out[key] = compile_on_layout(base, key)
    return out


def _with_clipped(plan: "Plan", full: "Plan") -> "Plan":
    """``plan`` (windowed), or the full-causal plan ``full`` with every staged block clipped to
    ``plan``'s window when that is estimated faster: clipping only removes work and bytes, so a
    windowed plan is never estimated slower than the full-causal plan of its batch."""
    from megatron_hsap.plan import plan as _plan
    from megatron_hsap.plan.codegen import PoolOverflow
    from megatron_hsap.plan.placement import Prices
    from megatron_hsap.plan.units import build_units, clip_unit

    left = plan.options.window
    units = [c for u in full.chosen.units if (c := clip_unit(replace(u, window=left), left)) is not None]
    hw, link = full.hardware, full.link
    pr = Prices.of(full.shape, hw, hw.bandwidth(link))
    try:
        cand = _plan._build(full.chosen.name, units, full.inter_size, full.shape, full.pool_capacity,
                            pr, hw.latency(link), full.chosen.budget)
    except PoolOverflow:  # (slots only shrink; first-fit could still differ)
        return plan
    if cand.time >= plan.chosen.time:
        return plan
    pieces, work_units = build_units(full.batch, full.layout, left)
    return replace(plan, layout=full.layout, pool_capacity=full.pool_capacity, pieces=tuple(pieces),
                   work_units=tuple(work_units), chosen=cand,
                   alternatives={**plan.alternatives, f"{cand.name} (full plan clipped)": cand.time})


def no_slower_than_full(plan: "Plan") -> "Plan":
    """A freshly compiled windowed ``plan`` against its batch's full-causal plan (compiled, or
    found in ``compile_plan``'s cache) clipped to the window; the faster of the two."""
    from megatron_hsap.plan import plan as _plan

    opts = replace(plan.options, window_size=None)
    key = (plan.batch.cu_seqlens, opts)
    full = PLAN_CACHE.get(key)
    if full is None:
        full = _plan._compile_cached(plan.batch.cu_seqlens, opts)
        PLAN_CACHE.put(key, full)
    return _with_clipped(plan, full)

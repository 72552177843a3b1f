"""Plans of one batch for several sliding windows on ONE token layout (issue 15 item 1).

A model mixing full-attention and sliding-window layers (Gemma, Mistral, GPT-OSS) shards its batch
once: the layout is chosen on the full-attention plan (``compile_plan`` without a window) and the
plan of every other window is compiled on that layout (``compile_on_layout``), so every layer's
plan holds the same tokens on the same ranks. Such plans are cached beside ``compile_plan``'s
(keyed by the layout's segments too: a windowed plan compiled on its own chooses its own layout,
another plan under the same options).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.plan import plan as _search  # the module, so tests can patch its _compile_on
from megatron_hsap.plan.cache import PLAN_CACHE
from megatron_hsap.plan.window import normalize_window

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["compile_on_layout", "plans_for_windows"]


def compile_on_layout(base: "Plan", window_size: object) -> "Plan":
    """``base``'s batch and options under ``window_size`` (``None``: full causal), on ``base``'s
    layout; ``base`` itself when the window is its own."""
    window = normalize_window(window_size)
    if window == base.options.window_size:
        return base
    opts = replace(base.options, window_size=window).validate()
    key = (base.batch.cu_seqlens, opts, base.layout.segments)
    hit = PLAN_CACHE.get(key)
    if hit is not None:
        return hit
    got = _search._compile_on(base.layout, base.batch, base.shape, opts)
    if window is not None and base.options.window_size is None:
        got = _search._with_clipped(got, base)
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

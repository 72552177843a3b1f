"""Plans of one batch for several sliding windows on ONE token layout (issue 15 item 1).

A model mixing full-attention and sliding-window layers (Gemma, Mistral, GPT-OSS) shards its batch
once: the layout is chosen on the full-attention plan (``compile_plan`` without a window) and the
plan of every other window is compiled on that layout (``compile_on_layout``), so every layer's
plan holds the same tokens on the same ranks. Such plans are cached beside ``compile_plan``'s
(keyed by the layout's segments too: a windowed plan compiled on its own chooses its own layout,
another plan under the same options).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_hsap.plan import plan as _search  # the module, so tests can patch its _compile_on
from megatron_hsap.plan.cache import PLAN_CACHE
from megatron_hsap.plan.window import normalize_window

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["adopt", "compile_on_layout", "plans_for_windows"]


def _key(base: "Plan", window: tuple[int, int] | None) -> tuple[tuple, object]:
    """``compile_on_layout``'s cache key of ``base`` under normalised ``window``, and its options."""
    opts = replace(base.options, window_size=window).validate()
    return (base.batch.cu_seqlens, opts, base.layout.segments), opts


def compile_on_layout(base: "Plan", window_size: object) -> "Plan":
    """``base``'s batch and options under ``window_size`` (``None``: full causal), on ``base``'s
    layout; ``base`` itself when the window is its own."""
    window = normalize_window(window_size)
    if window == base.options.window_size:
        return base
    key, opts = _key(base, window)
    hit = PLAN_CACHE.get(key)
    if hit is not None:
        return hit
    got = _search._compile_on(base.layout, base.batch, base.shape, opts)
    if window is not None and base.options.window_size is None:
        got = _search._with_clipped(got, base)
    PLAN_CACHE.put(key, got)
    return got


def adopt(base: "Plan", plans: "Iterable[Plan]") -> None:
    """Cache ``plans``, compiled on ``base``'s layout by another process (``compile_on_layout`` there:
    ``megatron/plan_worker.py``), under the keys ``compile_on_layout(base, window)`` looks up here."""
    for plan in plans:
        if plan.options.window_size != base.options.window_size:
            PLAN_CACHE.put(_key(base, plan.options.window_size)[0], plan)


def plans_for_windows(base: "Plan", windows: object) -> dict[tuple[int, int] | None, "Plan"]:
    """One plan per distinct window of ``windows`` (each ``None`` or ``(left, right)``), all on
    ``base``'s layout; keys are the normalised windows (``None`` or ``(left, 0)``)."""
    out: dict[tuple[int, int] | None, "Plan"] = {}
    for w in windows:
        key = normalize_window(w)
        if key not in out:
            out[key] = compile_on_layout(base, key)
    return out

"""The compiled-plan cache ``compile_plan`` (``plan/plan.py``) and ``plan/shared_layout.py`` share:
an LRU (``plan/lru.py``) of the last ``PLAN_CACHE_SIZE`` plans keyed by ``(cu_seqlens tuple,
PlanOptions)`` (``shared_layout`` adds the layout's segments), thread-safe (plans may be compiled on
the prefetch thread, ``megatron/prefetch.py``)."""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.lru import LRUCache

__all__ = ["PLAN_CACHE", "PLAN_CACHE_SIZE", "clear_plan_cache", "fast_key"]

PLAN_CACHE_SIZE = 64
PLAN_CACHE: "LRUCache[tuple, object]" = LRUCache(PLAN_CACHE_SIZE)


def clear_plan_cache() -> None:
    """Forget every cached plan (benchmarks time fresh compiles with it)."""
    PLAN_CACHE.clear()


def fast_key(cu_seqlens: object) -> tuple[int, ...] | None:
    """``cu_seqlens`` as a tuple when that is cheap and exact (int lists, integer arrays); only
    used to look up the cache, which holds validated batches only."""
    if isinstance(cu_seqlens, np.ndarray) and cu_seqlens.ndim == 1 and cu_seqlens.dtype.kind in "iu":
        return tuple(cu_seqlens.tolist())
    if isinstance(cu_seqlens, (list, tuple)) and set(map(type, cu_seqlens)) == {int}:
        return tuple(cu_seqlens)
    return None

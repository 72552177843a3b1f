"""The compiled-plan cache ``compile_plan`` (``plan/plan.py``) and ``plan/shared_layout.py`` share:
an LRU of the last ``_CACHE_SIZE`` plans keyed by ``(cu_seqlens tuple, PlanOptions)``, behind one
lock (plans may be compiled on the prefetch thread, ``megatron/prefetch.py``)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

__all__ = ["clear_plan_cache", "fast_key"]

_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_CACHE_SIZE = 64
_CACHE_LOCK = threading.Lock()


def clear_plan_cache() -> None:
    """Forget every cached plan (benchmarks time fresh compiles with it)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def fast_key(cu_seqlens: object) -> tuple[int, ...] | None:
    """``cu_seqlens`` as a tuple when that is cheap and exact (int lists, integer arrays); only
    used to look up the cache, which holds validated batches only."""
    if isinstance(cu_seqlens, np.ndarray) and cu_seqlens.ndim == 1 and cu_seqlens.dtype.kind in "iu":
        return tuple(cu_seqlens.tolist())
    if isinstance(cu_seqlens, (list, tuple)) and set(map(type, cu_seqlens)) == {int}:
        return tuple(cu_seqlens)
    return None

"""A small thread-safe least-recently-used map: the one LRU idiom of the package (pure Python).

Used for the compiled-plan cache (``plan/cache.py``), the runtime's executors and runners
(``runtime/executor.py``, ``runtime/hsap.py``) and the plan handshake's agreed hashes
(``runtime/handshake.py``). A hit moves the key to the most-recent end; an insert past
``maxsize`` drops the least recently used keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from megatron_hsap.plan.checks import positive_int

__all__ = ["LRUCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most ``maxsize`` entries; ``get`` and ``put`` are atomic under one lock (plans may be
    compiled on the prefetch thread, ``megatron/prefetch.py``). Don't store ``None``: ``get``
    returns it for a miss."""

    __slots__ = ("maxsize", "_items", "_lock")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = positive_int("maxsize", maxsize)
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key`` as the most recently used, evicting the oldest past ``maxsize``."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        """Membership without touching the order."""
        return key in self._items

    def keys(self) -> list[K]:
        """Keys from least to most recently used (a copy)."""
        with self._lock:
            return list(self._items)

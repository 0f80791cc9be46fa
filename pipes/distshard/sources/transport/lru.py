"""A small thread-safe LRU with a weight bound, emptied in a forked child.

Every process keeps its own open files, loaded indexes and decoded row groups
in such caches; a child made by ``fork`` (a DataLoader worker) starts with
empty ones instead of sharing its parent's handles.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

from ...forks import at_fork

V = TypeVar("V")

_ALL: "weakref.WeakSet[LRU[Any]]" = weakref.WeakSet()


class LRU(Generic[V]):
    """At most ``max_items`` entries and ``max_weight`` total weight; the least
    recently used go first, handed to ``on_evict`` (e.g. to close a file)."""

    def __init__(
        self, max_items: int, max_weight: int | None = None, on_evict: Callable[[V], None] | None = None
    ) -> None:
        self.max_items = max_items
        self.max_weight = max_weight
        self.on_evict = on_evict
        self._data: "OrderedDict[Hashable, tuple[V, int]]" = OrderedDict()
        self._weight = 0
        self._lock = threading.RLock()
        _ALL.add(self)

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            found = self._data.get(key)
            if found is None:
                return None
            self._data.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: V, weight: int = 1) -> V:
        evicted: list[V] = []
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._weight -= old[1]
                evicted.append(old[0])
            self._data[key] = (value, weight)
            self._weight += weight
            while len(self._data) > 1 and (
                len(self._data) > self.max_items or (self.max_weight is not None and self._weight > self.max_weight)
            ):
                _, (gone, gone_weight) = self._data.popitem(last=False)
                self._weight -= gone_weight
                evicted.append(gone)
        if self.on_evict is not None:
            for gone in evicted:
                if gone is not value:
                    self.on_evict(gone)
        return value

    def setdefault(self, key: Hashable, value: V, weight: int = 1) -> V:
        """The value already cached under ``key`` (another thread was first), else ``value``, cached."""
        with self._lock:
            found = self._data.get(key)
            if found is not None:
                self._data.move_to_end(key)
                return found[0]
            return self.put(key, value, weight)

    def pop(self, key: Hashable) -> V | None:
        with self._lock:
            found = self._data.pop(key, None)
            if found is None:
                return None
            self._weight -= found[1]
        return found[0]

    def clear(self, evict: bool = True) -> None:
        with self._lock:
            values = [value for value, _ in self._data.values()]
            self._data.clear()
            self._weight = 0
        if evict and self.on_evict is not None:
            for value in values:
                self.on_evict(value)


def clear_all() -> None:
    """Empty every cache of this process (closing what they hold), as a new process starts."""
    for cache in list(_ALL):
        cache.clear()


def _after_fork() -> None:
    for cache in list(_ALL):
        cache._data = OrderedDict()  # the parent's handles stay the parent's
        cache._weight = 0
        cache._lock = threading.RLock()


at_fork(_after_fork)

"""A per-process cache whose entries expire, so admin edits reach every replica in bounded time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Maps a key to a loaded value for `ttl_seconds`; loads again after that."""

    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._entries: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K, load: Callable[[K], V]) -> V:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > now:
            return entry[1]
        value = load(key)
        with self._lock:
            self._entries[key] = (now + self.ttl_seconds, value)
        return value

    def reload(self, key: K, load: Callable[[K], V]) -> V:
        """Load `key` now, whatever its entry's age, and keep the new value."""
        value = load(key)
        with self._lock:
            self._entries[key] = (self._clock() + self.ttl_seconds, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

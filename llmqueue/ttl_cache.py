"""A per-process cache whose entries expire, so admin edits reach every replica in bounded time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


# Callers choose the keys (a bearer token's hash, a model's name) and a miss is remembered too:
# without a bound, a stream of made-up keys would grow a process's memory until it is killed.
MAX_ENTRIES = 10_000


class TtlCache(Generic[K, V]):
    """Maps a key to a loaded value for `ttl_seconds`; loads again after that. At most
    `max_entries` are kept: when full, expired entries go, and if none has, all of them."""

    def __init__(
        self,
        ttl_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K, load: Callable[[K], V]) -> V:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > now:
            return entry[1]
        value = load(key)
        self._keep(key, value, now)
        return value

    def reload(self, key: K, load: Callable[[K], V]) -> V:
        """Load `key` now, whatever its entry's age, and keep the new value."""
        value = load(key)
        self._keep(key, value, self._clock())
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def _keep(self, key: K, value: V, now: float) -> None:
        with self._lock:
            if len(self._entries) >= self.max_entries and key not in self._entries:
                live = {k: e for k, e in self._entries.items() if e[0] > now}
                # All live: dropping them all costs one load each, a bounded price.
                self._entries = live if len(live) < self.max_entries else {}
            self._entries[key] = (now + self.ttl_seconds, value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

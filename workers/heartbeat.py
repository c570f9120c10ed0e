"""A worker's liveness beat: a thread that tells Redis this node serves its pool."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from contract import liveness

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        client: redis.Redis,
        pool: str,
        node: str,
        interval_seconds: float,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`stats()`, if given, is published with every beat (workers/cost.py)."""
        self.client, self.pool, self.node = client, pool, node
        self.interval_seconds = interval_seconds
        self.stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmqueue-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            liveness.leave(self.client, self.pool, self.node)
        except redis.RedisError:
            log.warning("could not remove %s from pool %s", self.node, self.pool)

    def _stats(self) -> dict[str, Any] | None:
        if self.stats is None:
            return None
        try:
            return self.stats()
        except Exception:  # counters are for benchmarks and operators: never skip the beat
            log.exception("worker stats failed; beating without them")
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                liveness.beat(self.client, self.pool, self.node, stats=self._stats())
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.interval_seconds)

"""A worker's liveness beat: a thread that tells Redis this node serves its pool."""

from __future__ import annotations

import logging
import threading

import redis

from llmqueue import liveness

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, client: redis.Redis, pool: str, node: str, interval_seconds: float) -> None:
        self.client, self.pool, self.node = client, pool, node
        self.interval_seconds = interval_seconds
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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                liveness.beat(self.client, self.pool, self.node)
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.interval_seconds)

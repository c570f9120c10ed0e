"""A worker's watch over the others: a dead worker's requests go back to their queues at once.

Every heartbeat interval each live worker keeps its own held messages visible (so kombu never
redelivers a generation that is still running) and restores the held messages of every worker,
of any pool, whose beat is older than LLMQUEUE_WORKER_STALE_SECONDS (celery_ext/rescue.py), then
forgets that worker. A request so comes back within the stale window plus one interval of its
worker's death, while the visibility timeout stays an hour for a cluster that died whole.
Whichever attempt claims a request last runs it (llmqueue/lifecycle.py): a worker that was only
cut off and comes back cannot record a second outcome.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from celery_ext import broker, rescue
from contract import liveness

log = logging.getLogger(__name__)


class Rescuer:
    def __init__(self, client: redis.Redis, node: str, stale_seconds: float, app: Any) -> None:
        self.client, self.node, self.stale_seconds, self.app = client, node, stale_seconds, app
        self._connection: Any = None

    def _qos(self) -> Any:
        """kombu's QoS of a channel of our own (its restore, its key names)."""
        if self._connection is None:
            self._connection = self.app.connection_for_write()
        return self._connection.default_channel.qos

    def requeue_held(self) -> int:
        """Put every message held under this worker's node name back at the head of its queue;
        returns how many. Before consuming: what a predecessor of the same name (pool@host, a
        supervisor's restart) held when it died, which no one else rescues, since the name
        beats again, and which this worker's keep_visible would otherwise keep unacked; and
        the engine watchdog's hand-back (workers/watchdog.py)."""
        return rescue.rescue(self.client, self.node, self._qos())

    def __call__(self) -> None:
        qos = self._qos()
        rescue.keep_visible(self.client, self.node, qos, broker.held_here())
        for pool, dead in liveness.stale_workers(self.client, self.stale_seconds):
            if dead == self.node:
                continue  # our own beat late (a stalled process): never rescue ourselves
            restored = rescue.rescue(self.client, dead, qos)
            liveness.leave(self.client, pool, dead)
            if restored:
                log.warning(
                    "worker %s stopped beating: %d of its requests requeued", dead, restored
                )

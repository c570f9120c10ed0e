"""The Redis broker transport llmqueue runs on: kombu's own, minus a client built per command.

kombu's Redis channel builds a new `redis.Redis` object for every publish, fetch bookkeeping and
ack (`conn_or_acquire` → `_create_client`). redis-py's constructor copies ~200 response callbacks
into a fresh dict each time: ~0.1 ms of GIL per call, three calls per request on the worker's
event loop (measured with py-spy). A client object is thread-safe (connections come from the
pool per command), so one per channel and pool does the same work. kombu is pinned in
requirements.txt because this subclasses its internals; tests/test_broker.py checks them.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        # kombu drops its pools after a connection error (`_disconnect_pools`): follow it.
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client(asynchronous=False)
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel

"""The Redis broker transport llmqueue runs on: kombu's own, minus a client built per command.

kombu's Redis channel builds a new `redis.Redis` object for every publish, fetch bookkeeping and
ack (`conn_or_acquire` → `_create_client`). redis-py's constructor copies ~200 response callbacks
into a fresh dict each time: ~0.1 ms of GIL per call, three calls per request on the worker's
event loop (measured with py-spy). A client object is thread-safe (connections come from the
pool per command), so one per channel and pool does the same work. kombu is pinned in
requirements.txt because this subclasses its internals; tests/test_broker.py checks them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class QoS(kombu_redis.QoS):
    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Iterator[Any]:
        """The unacked bookkeeping of every fetch (ZADD + HSET) and ack (ZREM + HDEL) without
        MULTI/EXEC around it: still one round trip, two commands fewer on the wire and the
        server, and no atomicity is lost that matters. The pair is written right after the
        message left its list, so a worker dying in between loses it either way; and a
        concurrent restore only takes entries older than the visibility timeout. (kombu's
        restore path passes its own transactional pipe, which is kept.)"""
        if pipe is not None:
            yield pipe
            return
        with self.channel.conn_or_acquire(client) as acquired:
            yield acquired.pipeline(transaction=False)


class Channel(kombu_redis.Channel):
    QoS = QoS
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


def install() -> None:
    """Make `redis://` broker URLs use this transport in this process. Registered under kombu's
    own scheme, not a new one, so URLs keep saying `redis://` everywhere they are shown or
    parsed again (Flower picks its queue-length reader by the broker URL's scheme)."""
    TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"

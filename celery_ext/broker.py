"""The Redis broker transport llmqueue runs on: kombu's own, minus a client built per command,
plus the hooks the worker's dispatcher needs (workers/queue_order.py: the queue order, each
message as it is read, each message once held), plus a record of which worker holds each
delivered message (its held set), for crash recovery (celery_ext/rescue.py).

kombu's Redis channel builds a new `redis.Redis` object for every publish, fetch bookkeeping and
ack (`conn_or_acquire` → `_create_client`). redis-py's constructor copies ~200 response callbacks
into a fresh dict each time: ~0.1 ms of GIL per call, three calls per request on the worker's
event loop (measured with py-spy). A client object is thread-safe (connections come from the
pool per command), so one per channel and pool does the same work. kombu is pinned in
requirements.txt because this subclasses its internals; tests/test_broker.py checks them.
`sentinel://` URLs (Redis Sentinel) get the same channel on kombu's sentinel pools
(tests/test_sentinel.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

import redis
import redis.sentinel
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis.commands.core import Script

log = logging.getLogger(__name__)
HELD_PREFIX = "llmqueue:held"
# Logged for an ack left undone because the message is no longer this worker's (QoS.ack).
ACK_LEFT = "was requeued while this worker was cut off"
# KEYS: the owner's held set, unacked index, unacked hash; ARGV: the delivery tag. Its unacked
# entry is removed only while the tag is still in the owner's held set.
_ACK_HELD = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  return 1
end
return 0
"""
# The worker node this process consumes as (set by the worker's runtime); None in the API.
_owner: str | None = None


def held_key(node: str) -> str:
    """The delivery tags `node` holds: fetched, not acked yet (a set). A worker whose beat went
    stale has its held messages restored at once (celery_ext/rescue.py) instead of after the
    visibility timeout; kombu's `unacked` hash alone does not say whose a message is."""
    return f"{HELD_PREFIX}:{node}"


def set_owner(node: str | None) -> None:
    """Record from now on which messages this process's consumer holds, under `node`."""
    global _owner
    _owner = node


# The delivery tags this process's consumer holds now (fetched, not yet acked or given back),
# whichever channel fetched them: the held set in Redis can name more (an ack a promoted replica
# never received, a dead predecessor's messages), and only these are still being worked on.
_held_here: set[str] = set()


def held_here() -> list[str]:
    """The delivery tags this process holds now (celery_ext/rescue.py keeps them visible)."""
    return list(_held_here)


def _tag(delivery_tag: str | bytes) -> str:
    return delivery_tag.decode() if isinstance(delivery_tag, bytes) else delivery_tag


class QoS(kombu_redis.QoS):
    def append(self, message: Any, delivery_tag: str) -> None:
        """kombu's unacked bookkeeping of a fetch (index + hash), and the owner's held set, in
        the one round trip kombu makes anyway."""
        delivery = message.delivery_info
        entry = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
            pipe.hset(self.unacked_key, delivery_tag, entry)
            if _owner is not None:
                pipe.sadd(held_key(_owner), delivery_tag)
                # A node never rescued (no worker left alive) leaves no set forever.
                pipe.expire(held_key(_owner), int(self.visibility_timeout) + 60)
            pipe.execute()
        if _owner is not None:
            _held_here.add(_tag(delivery_tag))
        virtual.QoS.append(self, message, delivery_tag)
        hook = _held_hook
        if hook is not None:
            hook()

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        """kombu's ack bookkeeping (index + hash), and the tag leaves its owner's held set."""
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        if _owner is not None:
            pipe.srem(held_key(_owner), delivery_tag)
            _held_here.discard(_tag(delivery_tag))
        return pipe

    def ack(self, delivery_tag: str) -> None:
        """kombu's ack, unless the message is no longer this worker's. A worker cut off from
        Redis for longer than the stale window was taken for dead: a live worker restored its
        held messages and forgot its held set (celery_ext/rescue.py), and another worker holds
        each now under the same delivery tag. The cut-off worker's late ack (its finish was
        refused by the claim) must not take that holder's unacked entry away, or nothing would
        restore the message if the holder died too. So the entry goes only while the tag is
        still in this worker's held set, in one script."""
        if _owner is None:
            super().ack(delivery_tag)
            return
        keys = [held_key(_owner), self.unacked_index_key, self.unacked_key]
        with self.channel.conn_or_acquire() as client:
            held = self._ack_held(keys=keys, args=[delivery_tag], client=client)
        # Done with here either way: keep_visible must stop dating it (an ack a promoted
        # replica never got leaves its entry, which only ages out if no one keeps it fresh).
        _held_here.discard(_tag(delivery_tag))
        if not held:
            log.warning("message %s %s; its new holder acks it", delivery_tag, ACK_LEFT)
        virtual.QoS.ack(self, delivery_tag)

    @cached_property
    def _ack_held(self) -> Script:
        """The ack's script, sent as EVALSHA (loaded again if the server lost it)."""
        with self.channel.conn_or_acquire() as client:
            return client.register_script(_ACK_HELD)

    def restore_unacked(self, client: Any = None) -> None:
        """kombu puts back on their queues the messages this consumer holds when its channel
        closes. When the channel closes because the broker went away, that cannot work, and
        the error it raises is one Celery calls unrecoverable: the worker would exit with its
        requests half generated. Instead they stay unacked and held: this worker runs them to
        their end and acks them once the broker is back (Channel._create_client), and if it
        dies first, crash recovery restores them."""
        try:
            super().restore_unacked(client)
        except (redis.RedisError, OSError, AttributeError) as exc:
            log.warning(
                "broker lost: %d held messages stay unacked until this worker acks them (%s)",
                len(self._delivered),
                exc,
            )

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """kombu requeues a rejected message at its queue's tail; a worker rejects only to hand
        a message back as it stops (workers/execution.py), and that message waited longest:
        it goes back to the head, as a rescued one does."""
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=False)
            virtual.QoS.ack(self, delivery_tag)
            return
        self.ack(delivery_tag)  # dropped: the same bookkeeping as an ack

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


# Called with every message the worker's consumer receives, before Celery handles it.
_delivery_hook: Callable[[dict[str, Any], str], None] | None = None


def on_delivery(hook: Callable[[dict[str, Any], str], None] | None) -> None:
    """Have `hook(message, queue)` see every message this process's consumer receives."""
    global _delivery_hook
    _delivery_hook = hook


# Called once a fetched message is recorded as held (kombu's unacked bookkeeping), before Celery
# handles it.
_held_hook: Callable[[], None] | None = None


def on_held(hook: Callable[[], None] | None) -> None:
    """Have `hook()` run after each fetched message's unacked bookkeeping, before Celery's
    strategy sees the message."""
    global _held_hook
    _held_hook = hook


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client: Any = None
    _brpop_timeout: float = 1

    @property
    def brpop_timeout(self) -> float:
        """kombu's BRPOP timeout, unless the queue order wants another for the next BRPOP: the
        worker's (workers.queue_order.TierCycle) polls sooner while it leaves a queue out for
        its budget, since a BRPOP in flight cannot take that queue back in."""
        poll_timeout = getattr(self.__dict__.get("_queue_cycle"), "poll_timeout", None)
        if poll_timeout is not None:
            return float(poll_timeout(self._brpop_timeout))
        return self._brpop_timeout

    @brpop_timeout.setter
    def brpop_timeout(self, value: float) -> None:
        self._brpop_timeout = value

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where this channel's broker is, kept for when kombu can no longer say (below).
        self._broker_params = self._connparams()

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        try:
            pool = self.pool
        except AttributeError:
            # The broker connection was lost and Celery opened a new one: kombu closed this
            # channel's transport, which no longer knows its server. Messages this channel
            # delivered are still acked here, on the same server, with a pool of our own.
            return self._orphan_client()
        # kombu drops its pools after a connection error (`_disconnect_pools`): follow it.
        if client is None or client.connection_pool is not pool:
            client = self._sync_client = super()._create_client(asynchronous=False)
        return client

    def _orphan_client(self) -> Any:
        client = self.__dict__.get("_orphan")
        if client is None:
            client = self.__dict__["_orphan"] = self.Client(connection_pool=self._orphan_pool())
        return client

    def _orphan_pool(self) -> Any:
        return redis.ConnectionPool(**self._broker_params)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The channel above on kombu's Redis Sentinel support (`sentinel://` broker URLs): kombu's
    SentinelChannel builds the pools, which ask the sentinels for the current master, so a
    worker follows a failover when Celery reconnects; the held sets, the head-first restore and
    the client per channel are the channel's above, unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where the sentinels are, kept for when kombu can no longer say (Channel._orphan_client).
        default_port = self.connection.default_port
        urls = [kombu_redis._parse_url(url) for url in self.connection.client.alt]
        sentinels = [(u.hostname, u.port or default_port) for u in urls if u.scheme == "sentinel"]
        self._sentinels = sentinels or [(self._broker_params["host"], self._broker_params["port"])]

    def _orphan_pool(self) -> Any:
        """A pool of the group's current master, as kombu's `_sentinel_managed_pool` builds it,
        from the sentinels this channel was opened with."""
        params = {k: v for k, v in self._broker_params.items() if k not in ("host", "port")}
        sentinels = redis.sentinel.Sentinel(
            self._sentinels,
            min_other_sentinels=getattr(self, "min_other_sentinels", 0),
            sentinel_kwargs=getattr(self, "sentinel_kwargs", None),
            **params,
        )
        return sentinels.master_for(getattr(self, "master_name", None), redis.Redis).connection_pool


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message: Any, queue: str) -> None:
        hook = _delivery_hook
        if hook is not None:
            hook(message, queue)
        super()._deliver(message, queue)


class SentinelTransport(Transport):
    """`sentinel://` broker URLs (kombu's SentinelTransport's defaults) on the channel above."""

    Channel = SentinelChannel
    default_port: Any = kombu_redis.SentinelTransport.default_port


def install() -> None:
    """Make `redis://` and `sentinel://` broker URLs use these transports in this process.
    Registered under kombu's own schemes, not new ones, so URLs keep saying `redis://` everywhere
    they are shown or parsed again (Flower picks its queue-length reader by the broker URL's
    scheme)."""
    TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
    TRANSPORT_ALIASES["sentinel"] = f"{__name__}:SentinelTransport"

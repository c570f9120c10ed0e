"""REDIS_URL as every process reads it: one server (`redis://`) or a Sentinel group (`sentinel://`).

With Redis Sentinel, REDIS_URL lists the sentinels, `;`-separated, the form kombu's and Celery's
own sentinel support parse: `sentinel://[:password@]host:port/db;sentinel://host:port/db`, and
REDIS_SENTINEL_MASTER names the group the sentinels watch. Every client the two programs build
(admission, the publisher, heartbeats, rescue, recorder, pacer, result waits) then asks the
sentinels which server is the master when it connects, and again after a connection error or a
READONLY answer from a demoted master, so it follows a failover without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379


def is_sentinel(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


@dataclass(frozen=True)
class SentinelGroup:
    """The sentinels REDIS_URL lists, and the master's database and password they apply to."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    password: str | None

    @property
    def url(self) -> str:
        """REDIS_URL again with the database (and password) on every sentinel: kombu reads them
        from whichever sentinel URL it connects through, Celery's backend from the first."""
        auth = f":{self.password}@" if self.password else ""
        return ";".join(
            f"{SENTINEL_SCHEME}://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels
        )


def sentinel_group(url: str) -> SentinelGroup:
    """Parse a `sentinel://…;sentinel://…` REDIS_URL; a database or password given on one
    sentinel holds for all (they name one master), two different ones are an error."""
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    passwords: set[str] = set()
    for chunk in filter(None, (part.strip() for part in url.split(";"))):
        parts = urlsplit(chunk)
        if parts.scheme != SENTINEL_SCHEME or not parts.hostname:
            raise ValueError(f"not a sentinel URL: {chunk!r} (sentinel://host:port/db)")
        sentinels.append((parts.hostname, parts.port or SENTINEL_PORT))
        if parts.path.strip("/"):
            dbs.add(int(parts.path.strip("/")))
        if parts.password:
            passwords.add(unquote(parts.password))
    if not sentinels or len(dbs) > 1 or len(passwords) > 1:
        raise ValueError("REDIS_URL lists no sentinel, or sentinels with different db/password")
    return SentinelGroup(tuple(sentinels), next(iter(dbs), 0), next(iter(passwords), None))


# Seconds a sentinel may take to answer which server is the master: a sentinel host that is
# down or cut off is then skipped for the next one instead of holding the caller.
SENTINEL_TIMEOUT_SECONDS = 1.0
# redis-py's options for the connections to the sentinels themselves (kombu's and Celery's
# `sentinel_kwargs` transport option). No retries: the next sentinel is the retry. redis-py's
# default (10, backing off up to 1 s) spent ~3.8 s on each dead sentinel before asking the next.
SENTINEL_KWARGS: dict[str, Any] = {
    "socket_timeout": SENTINEL_TIMEOUT_SECONDS,
    "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS,
    "retry": Retry(NoBackoff(), 0),
}


def connect(url: str, master: str = "", **kwargs: Any) -> redis.Redis:
    """A client of the server REDIS_URL names: `redis.Redis.from_url` for `redis://` (nothing
    added on that path), or for `sentinel://` one that connects to `master`'s current master
    (`kwargs`: redis.Redis options, e.g. socket_timeout)."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    if not master:
        raise ValueError("a sentinel:// REDIS_URL needs REDIS_SENTINEL_MASTER (the group's name)")
    group = sentinel_group(url)
    sentinels = Sentinel(list(group.sentinels), sentinel_kwargs=dict(SENTINEL_KWARGS))
    client: redis.Redis = sentinels.master_for(
        master, db=group.db, password=group.password, **kwargs
    )
    return client

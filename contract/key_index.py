"""A key family's names read from its index set, not by scanning the keyspace.

Broker, result backend and llmqueue's own books share one Redis database. A SCAN for one family
walks every key there, a day of result keys included (CELERY_RESULT_EXPIRES): with 300,000
of them one walk took 0.33-0.43 s of round trips (and Redis' CPU), and workers walked it every
heartbeat to find dead peers, every usage flush, and /metrics on every scrape. So each writer
adds the name to the family's index set (contract/keys.py) with its write, and readers take the
set.

Writers from before the index (an older version during a rolling upgrade) left names out of it:
the first read of an index in a process walks the keyspace once and adds what matches.
"""

from __future__ import annotations

import threading

import redis

_SWEEP_COUNT = 1000
_indexed: set[tuple[str, str]] = set()  # (server and database, index) walked once already
_lock = threading.Lock()


def members(client: redis.Redis, index: str, pattern: str) -> list[str]:
    """The key names listed in `index`, sorted; in this process's first read of `index` on
    this database, first the keys matching `pattern` that the index does not list yet."""
    where = (_database(client), index)
    with _lock:
        unwalked = where not in _indexed
        _indexed.add(where)
    if unwalked:
        add_unlisted(client, index, pattern)
    return sorted(_text(name) for name in client.smembers(index))


def add_unlisted(client: redis.Redis, index: str, pattern: str) -> int:
    """Walk the keyspace once for keys matching `pattern` and list them in `index`; how many
    keys matched."""
    found = [_text(key) for key in client.scan_iter(match=pattern, count=_SWEEP_COUNT)]
    for start in range(0, len(found), _SWEEP_COUNT):
        client.sadd(index, *found[start : start + _SWEEP_COUNT])
    return len(found)


def forget_walks() -> None:
    """Walk again at the next read of each index (tests of the upgrade path)."""
    with _lock:
        _indexed.clear()


def _database(client: redis.Redis) -> str:
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    where = (
        getattr(pool, "service_name", None)  # a Sentinel group's master
        or kwargs.get("path")
        or f"{kwargs.get('host')}:{kwargs.get('port')}"
    )
    return f"{where}/{kwargs.get('db', 0)}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Worker liveness in Redis: workers beat into their pool's sorted set; readers count fresh ones."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import redis

from contract import key_index
from contract.keys import WORKERS_INDEX_KEY
from contract.keys import worker_stats_key as stats_key
from contract.keys import workers_key as pool_key

__all__ = [
    "beat",
    "leave",
    "live_pools",
    "live_workers",
    "pool_key",
    "stale_workers",
    "stats_key",
    "worker_stats",
]


def beat(
    client: redis.Redis,
    pool: str,
    node: str,
    now: float | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    """Record that `node` serves `pool` now, with its counters (workers/cost.py) if given."""
    pipe = client.pipeline(transaction=False)
    pipe.zadd(pool_key(pool), {node: time.time() if now is None else now})
    pipe.sadd(WORKERS_INDEX_KEY, pool_key(pool))
    if stats is not None:
        pipe.hset(stats_key(pool), node, json.dumps(stats))
    pipe.execute()


def worker_stats(client: redis.Redis, pool: str) -> dict[str, dict[str, Any]]:
    """Each node's counters as of its last beat."""
    raw = client.hgetall(stats_key(pool))
    return {(k.decode() if isinstance(k, bytes) else str(k)): json.loads(v) for k, v in raw.items()}


def leave(client: redis.Redis, pool: str, node: str) -> None:
    """Remove `node` from `pool` at once (clean shutdown), instead of waiting for staleness."""
    pipe = client.pipeline(transaction=False)
    pipe.zrem(pool_key(pool), node)
    pipe.hdel(stats_key(pool), node)
    pipe.execute()


def live_workers(
    client: redis.Redis, pool: str, stale_seconds: float, now: float | None = None
) -> list[str]:
    """Nodes of `pool` whose last beat is younger than `stale_seconds`."""
    cutoff = (time.time() if now is None else now) - stale_seconds
    nodes = client.zrangebyscore(pool_key(pool), f"({cutoff}", "+inf")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in nodes]


def live_pools(client: redis.Redis, pools: Iterable[str], stale_seconds: float) -> set[str]:
    """The subset of `pools` with at least one live worker, in one round trip."""
    names = sorted(set(pools))
    cutoff = time.time() - stale_seconds
    pipe = client.pipeline(transaction=False)
    for pool in names:
        pipe.zcount(pool_key(pool), f"({cutoff}", "+inf")
    return {pool for pool, count in zip(names, pipe.execute(), strict=True) if count}


def stale_workers(
    client: redis.Redis, stale_seconds: float, now: float | None = None
) -> list[tuple[str, str]]:
    """(pool, node) of every worker of any pool whose last beat is `stale_seconds` old or
    older: dead, or cut off from Redis."""
    cutoff = (time.time() if now is None else now) - stale_seconds
    prefix = pool_key("")
    keys = key_index.members(client, WORKERS_INDEX_KEY, f"{prefix}*")
    pools = [key[len(prefix) :] for key in keys]
    pipe = client.pipeline(transaction=False)
    for pool in pools:
        pipe.zrangebyscore(pool_key(pool), "-inf", cutoff)
    return [
        (pool, node.decode() if isinstance(node, bytes) else str(node))
        for pool, nodes in zip(pools, pipe.execute(), strict=True)
        for node in nodes
    ]

"""Worker liveness in Redis: workers beat into their pool's sorted set; readers count fresh ones."""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis


def pool_key(pool: str) -> str:
    return f"llmqueue:workers:{pool}"


def beat(client: redis.Redis, pool: str, node: str, now: float | None = None) -> None:
    """Record that `node` serves `pool` now."""
    client.zadd(pool_key(pool), {node: time.time() if now is None else now})


def leave(client: redis.Redis, pool: str, node: str) -> None:
    """Remove `node` from `pool` at once (clean shutdown), instead of waiting for staleness."""
    client.zrem(pool_key(pool), node)


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

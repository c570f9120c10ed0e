"""A worker samples its queues' depth into a per-minute history: the admin dashboard's hour plot.

Every worker of a pool writes the same minute's field (the last sample of the minute wins), so
the history has no gap while any worker lives, and costs two round trips every few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from contract.keys import depth_history_key
from contract.latency import WINDOW_TTL_SECONDS, minute_of

SAMPLE_SECONDS = 10.0  # six samples a minute: the minute's last one is at most 10 s old


def record_depths(client: redis.Redis, queues: Sequence[str], now: float | None = None) -> None:
    """Store each queue's waiting messages now under the current minute."""
    if not queues:
        return
    minute = str(minute_of(time.time() if now is None else now))
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(queue)
    depths = pipe.execute()
    for queue, depth in zip(queues, depths, strict=True):
        key = depth_history_key(queue)
        pipe.hset(key, minute, int(depth))
        pipe.expire(key, WINDOW_TTL_SECONDS)
    pipe.execute()


def depth_sampler(client: redis.Redis, queues: Callable[[], Sequence[str]]) -> Callable[[], None]:
    """The periodic job: the queues the worker consumes as of each run."""
    return lambda: record_depths(client, list(queues()))

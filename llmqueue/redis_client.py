"""The process's Redis client for llmqueue's own keys and result waits (REDIS_URL)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings

from contract.redis_url import connect


@cache
def get_redis() -> redis.Redis:
    # With sentinels, a client of the current master that follows a failover (redis-py's
    # Sentinel); with redis://, redis.Redis.from_url as ever.
    return connect(settings.REDIS_URL, settings.REDIS_SENTINEL_MASTER, health_check_interval=30)

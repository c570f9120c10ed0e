"""The process's Redis client for llmqueue's own keys and result waits (REDIS_URL)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, health_check_interval=30)

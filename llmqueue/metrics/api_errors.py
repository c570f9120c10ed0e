"""Counting the API's own refusals (bad input, auth, not found) for /metrics, by error code.

Admission's 429s and 503s are counted inside its script; these never reach it. One HINCRBY on
a path that already failed: a Redis that is down must not turn a 400 into a 500.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings

from contract.keys import API_ERRORS_KEY
from llmqueue.redis_client import get_redis

log = logging.getLogger(__name__)


def count_api_error(code: str | None) -> None:
    if not settings.LLMQUEUE_METRICS:
        return
    try:
        get_redis().hincrby(API_ERRORS_KEY, code or "error", 1)
    except redis.RedisError as exc:
        log.warning("could not count API error %s: %s", code, exc)

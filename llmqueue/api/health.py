"""GET /health: a readiness probe that answers only when this process can reach Redis."""

from __future__ import annotations

import redis
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from llmqueue.api.errors import Unavailable, error_response
from llmqueue.redis_client import get_redis


@require_GET
def health(request: HttpRequest) -> JsonResponse:
    """One PING: a load balancer takes an API process that lost its broker out of rotation.

    It is also the floor the overload benchmark compares rejections with: a Django view doing
    one Redis round trip on the same server under the same load (bench/overload.py).
    """
    try:
        get_redis().ping()
    except redis.RedisError:
        return error_response(Unavailable("Redis is unreachable from this API process."))
    return JsonResponse({"status": "ok"})

"""GET /metrics: the whole system's figures in Prometheus' text format, for allowed scrapers."""

from __future__ import annotations

import hmac
from functools import cache

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmqueue.api.errors import Forbidden, error_response
from llmqueue.metrics.exposition import SystemCollector


@cache
def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SystemCollector())
    return registry


def may_scrape(request: HttpRequest) -> bool:
    """The configured bearer token (compared in constant time), or an allowed address."""
    token = settings.LLMQUEUE_METRICS_TOKEN
    sent = request.headers.get("Authorization", "")
    if token and hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        return True
    return request.META.get("REMOTE_ADDR", "") in settings.LLMQUEUE_METRICS_ALLOW_IPS


def metrics(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET"})
    if not may_scrape(request):
        return error_response(Forbidden("Not allowed to read /metrics.", code="metrics_forbidden"))
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)

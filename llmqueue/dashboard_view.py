"""The admin's queue dashboard page (staff only): llmqueue/metrics/dashboard.py, charted."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.safestring import mark_safe

from llmqueue.metrics import dashboard
from llmqueue.metrics.svg import line_chart
from llmqueue.redis_client import get_redis


def queue_dashboard(request: HttpRequest) -> HttpResponse:
    found = dashboard.build(get_redis())
    charts = [
        line_chart("Waiting requests per queue", "requests", found.depth, found.minutes),
        line_chart("p99 wait in queue per tier", "s", found.p99_wait, found.minutes),
    ]
    context = {
        **admin.site.each_context(request),
        "title": "Queue dashboard",
        "dashboard": found,
        "rate_minutes": dashboard.RATE_WINDOW_MINUTES,
        # Built from numbers and escaped labels only (llmqueue/metrics/svg.py).
        "charts": [mark_safe(chart) for chart in charts],
    }
    return TemplateResponse(request, "admin/llmqueue/dashboard.html", context)

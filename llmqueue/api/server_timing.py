"""Server-Timing on API responses: how long the app itself took, apart from queueing and network."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse


class ServerTimingMiddleware:
    """Adds `Server-Timing: app;dur=<ms>` (the W3C header browsers and load generators read):
    a caller or benchmark then tells time spent in the app from time spent waiting for a server
    thread, a core or the network."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        response["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.3f}"
        return response

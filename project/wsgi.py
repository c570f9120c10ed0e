"""WSGI entry point for production servers (granian or gunicorn, `project.wsgi:application`).

The OpenAI-compatible API under /v1/ authenticates every call by its bearer key: sessions, CSRF,
Django's auth and messages have nothing to do there, yet cost ~0.2 ms per call (measured: a
no-op view with and without them). So /v1/ gets a Django handler with only the middleware the
API needs (API_MIDDLEWARE), and everything else (the admin) the full stack.
"""

import gc
import os
from collections.abc import Callable, Iterable
from typing import Any

import django
from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)


class ApiHandler(WSGIHandler):
    """Django's WSGI handler, built with settings.API_MIDDLEWARE instead of MIDDLEWARE."""

    def load_middleware(self, is_async: bool = False) -> None:
        full = settings.MIDDLEWARE
        # Read once, here, while the process starts (single-threaded).
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full


site = WSGIHandler()
api = ApiHandler()
# Everything loaded so far (Django, Celery, kombu, the app: ~84k objects) lives as long as the
# process. Left to the collector, each full collection walked them all: 128-172 ms with every
# request of the process stopped, twice per bench/admission run; frozen, none happened.
gc.freeze()


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    handler = api if environ.get("PATH_INFO", "").startswith("/v1/") else site
    return handler(environ, start_response)

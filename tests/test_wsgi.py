"""The production WSGI entry point: /v1/ runs with the API's middleware, the admin with all."""

from __future__ import annotations

import gc
import json
from io import BytesIO
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest

from project.wsgi import application


def call(path: str) -> tuple[str, dict[str, str], bytes]:
    environ: dict[str, Any] = {"PATH_INFO": path, "wsgi.input": BytesIO(b"")}
    setup_testing_defaults(environ)
    environ["HTTP_HOST"] = "127.0.0.1"
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(application(environ, start_response))
    return seen["status"], seen["headers"], body


@pytest.mark.django_db
def test_api_paths_skip_sessions_and_csrf_but_keep_content_length():
    status, headers, body = call("/v1/models")
    assert status.startswith("401")
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["Content-Length"] == str(len(body))
    assert headers["X-Content-Type-Options"] == "nosniff"  # SecurityMiddleware still runs
    assert "Set-Cookie" not in headers
    assert "Vary" not in headers  # nothing read a session or cookie
    name, _, duration = headers["Server-Timing"].partition(";dur=")
    assert name == "app" and 0 < float(duration) < 10_000


@pytest.mark.django_db
def test_admin_keeps_the_full_middleware_stack():
    status, headers, _ = call("/admin/login/")
    assert status.startswith("200")
    assert "csrftoken=" in headers["Set-Cookie"]  # CSRF middleware ran for the login form
    assert "Cookie" in headers["Vary"]
    assert "Server-Timing" not in headers  # the API's timing only


def test_what_the_api_loaded_at_start_is_kept_out_of_the_collectors_walks():
    assert gc.get_freeze_count() > 10_000

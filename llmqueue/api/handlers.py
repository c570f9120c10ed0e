"""Django's error pages (project/urls.py): OpenAI-shaped JSON under /v1/, Django's own elsewhere.

The API's views answer their own errors (views.api_endpoint) and its URL conf ends in a JSON 404;
these cover what fails before a view runs: a Host header not allowed, a crash in middleware.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views import defaults

from llmqueue.api.errors import (
    BadRequest,
    GenerationFailed,
    error_response,
    request_error,
    unknown_endpoint,
)

API_PREFIX = "/v1/"


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith(API_PREFIX)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not _is_api(request):
        return defaults.bad_request(request, exception)
    return error_response(request_error(exception) or BadRequest("The request is malformed."))


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not _is_api(request):
        return defaults.page_not_found(request, exception)
    return error_response(unknown_endpoint(request.method, request.path))


def server_error(request: HttpRequest) -> HttpResponse:
    if not _is_api(request):
        return defaults.server_error(request)
    return error_response(GenerationFailed("Internal error.", code="internal_error"))

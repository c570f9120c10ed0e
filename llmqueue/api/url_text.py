"""A request's path and query string checked for text no lookup can use, before any lookup."""

from __future__ import annotations

from django.http import HttpRequest

from llmqueue.api.errors import BadRequest, unknown_endpoint
from llmqueue.api.validation import is_storable_text


def check_url_text(request: HttpRequest) -> None:
    """A NUL in an id (`/v1/files/%00`) or a query value: PostgreSQL refuses it in any string,
    so the lookup would fail as a 500; here it is a 404 (no such object) or a 400."""
    if not is_storable_text(request.path_info):
        raise unknown_endpoint(request.method, request.path)
    if not request.META.get("QUERY_STRING"):
        return
    for name, values in request.GET.lists():
        if not is_storable_text(name) or not all(is_storable_text(v) for v in values):
            raise BadRequest(f"Query parameter {name!r} holds a NUL character.", param=name)

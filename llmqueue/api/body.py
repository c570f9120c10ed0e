"""A request's body, read only within LLMQUEUE_MAX_BODY_BYTES: a larger one is refused first."""

from __future__ import annotations

from typing import BinaryIO

from django.conf import settings
from django.http import HttpRequest

from llmqueue.api.errors import BadRequest, RequestTooLarge

# Reads of a body sent without a length: small enough to stop soon after the limit.
_CHUNK_BYTES = 64 * 1024


def declared_length(request: HttpRequest) -> int | None:
    """The body's Content-Length, None when the client sent none (a chunked body)."""
    raw = request.META.get("CONTENT_LENGTH")
    if raw is None or raw == "":
        return None
    try:
        length = int(raw)
    except ValueError:
        length = -1
    if length < 0:
        raise BadRequest("Content-Length must be a number of bytes.", code="invalid_request")
    return length


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"The request body exceeds {limit} bytes (LLMQUEUE_MAX_BODY_BYTES); "
        "a batch of prompts goes through /v1/files and /v1/batches."
    )


def read_unsized(stream: BinaryIO, limit: int) -> bytes:
    """A body of unknown length, read until it ends or passes `limit` (then refused): never
    more than `limit` + one chunk in memory."""
    chunks: list[bytes] = []
    size = 0
    while chunk := stream.read(_CHUNK_BYTES):
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def read_body(request: HttpRequest) -> bytes:
    """The JSON endpoints' body. Refused by its Content-Length before a byte is read; a chunked
    body (no length) is read from the server's dechunked stream only as far as the limit."""
    limit: int = settings.LLMQUEUE_MAX_BODY_BYTES
    length = declared_length(request)
    if length is not None and length > limit:
        raise too_large(limit)
    if length is None and request.META.get("wsgi.input_terminated"):
        # Django reads a WSGI body only up to Content-Length, so without one it would see b"".
        return read_unsized(request.META["wsgi.input"], limit)
    return request.body

"""Idempotency keys: a prompt sent again under the same key answers the first one's request."""

from __future__ import annotations

import hashlib
import json
import uuid
from functools import cache
from typing import Any

from django.conf import settings

from contract.keys import PREFIX
from llmqueue.api.errors import ApiError, InvalidParameter
from llmqueue.redis_client import get_redis

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255

# KEYS[1] the key's entry; ARGV: the value this call would store, its ttl. Stores it if the key
# is free (nil: a fresh request); else returns what the first call stored.
_RESERVE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return false end
return redis.call('GET', KEYS[1])
"""
# KEYS[1] the key's entry; ARGV[1] this call's value: frees the key only if it is still its own.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class KeyReused(ApiError):
    """The key was sent before with another request: answering the first would be wrong."""

    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class KeyInUse(ApiError):
    """The first request under this key is still being admitted: its row does not exist yet."""

    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_use"


@cache
def _scripts() -> tuple[Any, Any]:
    client = get_redis()
    return client.register_script(_RESERVE), client.register_script(_RELEASE)


def entry_key(tenant_id: int, key: str) -> str:
    """Per tenant (two tenants' keys never meet), hashed (a key may be any text)."""
    return f"{PREFIX}:idempotency:{tenant_id}:{hashlib.sha256(key.encode()).hexdigest()}"


def checked_key(sent: str | None) -> str | None:
    if sent is None:
        return None
    if not sent or len(sent) > MAX_KEY_LENGTH:
        raise InvalidParameter(
            f"{HEADER} must hold 1 to {MAX_KEY_LENGTH} characters.", param=HEADER
        )
    return sent


def fingerprint(body: dict[str, Any], headers: dict[str, str | None]) -> str:
    """What makes two sends the same request: the body and the headers that change it."""
    canonical = json.dumps([body, headers], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def reserve(tenant_id: int, key: str, request_id: uuid.UUID, print_: str) -> uuid.UUID | None:
    """Bind `key` to `request_id` for LLMQUEUE_IDEMPOTENCY_TTL_SECONDS; None when this call is
    the key's first, else the first call's request id. Raises KeyReused for another body."""
    reserve_script, _ = _scripts()
    value = f"{request_id} {print_}"
    ttl = settings.LLMQUEUE_IDEMPOTENCY_TTL_SECONDS
    first = reserve_script(keys=[entry_key(tenant_id, key)], args=[value, ttl])
    if first is None:
        return None
    stored = first.decode() if isinstance(first, bytes) else str(first)
    first_id, _, first_print = stored.partition(" ")
    if first_print != print_:
        raise KeyReused(
            f"{HEADER} {key!r} was sent with a different request (request {first_id}); "
            "use a new key for a new request."
        )
    return uuid.UUID(first_id)


def release(tenant_id: int, key: str, request_id: uuid.UUID, print_: str) -> None:
    """Free the key of a request that was refused or never queued: sending it again is then a
    new request, as the refusal asked."""
    _, release_script = _scripts()
    release_script(keys=[entry_key(tenant_id, key)], args=[f"{request_id} {print_}"])

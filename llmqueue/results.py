"""Waiting for a request's result in the Redis result backend, without polling."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from celery import states

from llmqueue.redis_client import get_redis
from project.celery import app


@dataclass(frozen=True)
class Outcome:
    """A finished task as the result backend recorded it."""

    state: str  # SUCCESS | FAILURE | REVOKED
    result: dict[str, Any] | None
    error_type: str = ""
    error_message: str = ""


def _outcome(meta: dict[str, Any]) -> Outcome:
    if meta["status"] == states.SUCCESS:
        return Outcome(states.SUCCESS, meta["result"])
    info = meta.get("result") or {}
    if isinstance(info, dict):
        message = info.get("exc_message")
        if isinstance(message, list | tuple):
            message = " ".join(str(m) for m in message)
        return Outcome(meta["status"], None, str(info.get("exc_type", "")), str(message or ""))
    return Outcome(meta["status"], None, "", str(info))


def wait_for_outcome(request_id: str, timeout_seconds: float) -> Outcome | None:
    """The request's outcome, or None if it did not finish within `timeout_seconds`.

    Subscribes to the backend's per-task channel (Celery's Redis backend publishes every stored
    state there) before reading the key, so a result stored in between is not missed.
    """
    backend = app.backend
    key = backend.get_key_for_task(request_id)
    client = get_redis()
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(key)
        raw = client.get(key)
        deadline = time.monotonic() + timeout_seconds
        while True:
            if raw is not None:
                meta = backend.decode_result(raw)
                if meta["status"] in states.READY_STATES:
                    return _outcome(meta)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            message = pubsub.get_message(timeout=remaining)
            raw = message["data"] if message and message["type"] == "message" else None
    finally:
        pubsub.close()

"""Waiting for a request's result in the Redis result backend, without polling."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import states
from redis.client import PubSub

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
    info = meta.get("result")
    if isinstance(info, BaseException):  # the backend rebuilt the exception the worker stored
        return Outcome(meta["status"], None, type(info).__name__, " ".join(map(str, info.args)))
    if isinstance(info, dict):
        message = info.get("exc_message")
        if isinstance(message, list | tuple):
            message = " ".join(str(m) for m in message)
        return Outcome(meta["status"], None, str(info.get("exc_type", "")), str(message or ""))
    return Outcome(meta["status"], None, "", str(info or ""))


_local = threading.local()


def _thread_pubsub() -> PubSub:
    """This thread's pubsub connection, kept between waits: redis-py's PubSub.close() drops its
    socket, so a fresh one per request costs a TCP connect and the client handshake (~1 ms)."""
    pubsub: PubSub | None = getattr(_local, "pubsub", None)
    if pubsub is None:
        pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
        _local.pubsub = pubsub
    return pubsub


def _discard_thread_pubsub() -> None:
    pubsub: PubSub | None = getattr(_local, "pubsub", None)
    _local.pubsub = None
    _local.last_channel = None
    if pubsub is not None:
        pubsub.close()


def wait_for_outcome(request_id: str, timeout_seconds: float) -> Outcome | None:
    """The request's outcome, or None if it did not finish within `timeout_seconds`.

    Subscribes to the backend's per-task channel (Celery's Redis backend publishes every stored
    state there) before reading the key, so a result stored in between is not missed.

    A kept connection whose server went away (Redis restarted since the thread's last wait)
    fails only once it is used: the wait then starts over once on a fresh connection, within
    the same time budget; subscribing again before reading the key again misses nothing.
    """
    deadline = time.monotonic() + timeout_seconds
    kept = getattr(_local, "pubsub", None) is not None
    try:
        return _wait(request_id, deadline)
    except redis.ConnectionError:
        if not kept:
            raise
        return _wait(request_id, deadline)


def _wait(request_id: str, deadline: float) -> Outcome | None:
    backend = app.backend
    key = backend.get_key_for_task(request_id)
    channel = key.decode() if isinstance(key, bytes) else key
    client = get_redis()
    pubsub = _thread_pubsub()
    clean = False
    try:
        _leave_last_channel(pubsub)
        pubsub.subscribe(channel)
        raw = client.get(channel)
        while True:
            if raw is not None:
                meta = backend.decode_result(raw)
                if meta["status"] in states.READY_STATES:
                    clean = True
                    return _outcome(meta)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                clean = True
                return None
            message = pubsub.get_message(timeout=remaining)
            raw = None
            # A reused connection may still deliver a late message for an earlier request's
            # channel (published before its UNSUBSCRIBE was processed): only ours counts.
            if message and message["type"] == "message" and _name(message["channel"]) == channel:
                raw = message["data"]
    finally:
        _release(pubsub, channel, clean)


def _release(pubsub: PubSub, channel: str, clean: bool) -> None:
    """Keep the connection for this thread's next wait, still subscribed to `channel`: the next
    wait unsubscribes it first. Unsubscribing here came between the outcome and the response
    (~0.1 ms of redis-py's Python on every call, bench/latency.py); a message the channel still
    gets (a late duplicate) is told apart by its channel. A wait that broke off mid-way leaves
    the connection's state unknown: it is dropped."""
    if clean:
        _local.last_channel = channel
        return
    _discard_thread_pubsub()


def _leave_last_channel(pubsub: PubSub) -> None:
    channel: str | None = getattr(_local, "last_channel", None)
    if channel is not None:
        _local.last_channel = None
        pubsub.unsubscribe(channel)


def _name(channel: bytes | str) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel

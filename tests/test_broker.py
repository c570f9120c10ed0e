"""The Celery/kombu internals llmqueue leans on, checked against a real Redis: the publisher's
message equals apply_async's, the broker transport reuses its client, results read back."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import states
from celery.result import AsyncResult

from celery_ext import broker
from celery_ext.broker import Channel, held_key
from celery_ext.result_backend import LeanRedisBackend
from contract.task import GENERATE_TASK
from llmqueue.queueing.deadline_order import DEADLINE_HEADER
from llmqueue.queueing.publisher import publish_task
from project.celery import app
from workers.tasks import generate

QUEUE = "test.publisher"
VOLATILE_PROPERTIES = {"delivery_tag", "reply_to", "argsrepr", "kwargsrepr", "expiration"}


def pop_envelope(client: redis.Redis) -> dict[str, Any]:
    raw = client.rpop(QUEUE)
    assert isinstance(raw, bytes)
    return dict(json.loads(raw))


def test_published_message_is_the_one_apply_async_sends(clean_redis: redis.Redis):
    args = [{"request_id": "r-1", "prompt": "héllo", "params": {"max_tokens": 3}}]
    expires = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    generate.apply_async(
        args=args, task_id="same-id", queue=QUEUE, expires=expires, argsrepr="(r-1)",
        kwargsrepr="{}",
    )  # fmt: skip
    publish_task(GENERATE_TASK, "same-id", QUEUE, args, expires=expires, argsrepr="(r-1)")
    theirs, ours = pop_envelope(clean_redis), pop_envelope(clean_redis)
    assert clean_redis.llen(QUEUE) == 0
    assert ours["headers"].pop(DEADLINE_HEADER) == expires.timestamp()  # deadline order's key

    assert ours["headers"].pop("origin") and theirs["headers"].pop("origin")
    assert ours["headers"] == theirs["headers"]
    assert ours["headers"]["expires"] == "2031-01-02T03:04:05+00:00"
    for envelope in (ours, theirs):
        for name in VOLATILE_PROPERTIES:
            envelope["properties"].pop(name, None)
    assert ours["properties"] == theirs["properties"]
    assert base64.b64decode(ours["body"]) == base64.b64decode(theirs["body"])
    assert json.loads(base64.b64decode(ours["body"]))[0] == args
    assert {k: v for k, v in ours.items() if k not in ("headers", "properties")} == {
        k: v for k, v in theirs.items() if k not in ("headers", "properties")
    }


def test_broker_channel_reuses_one_client_per_pool(clean_redis: redis.Redis):
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.ping() is True
        channel._disconnect_pools()  # what kombu does after a connection error
        with channel.conn_or_acquire() as third:
            assert third is not first
            assert third.connection_pool is channel.pool


def test_lean_backend_stores_celerys_format_in_one_write(clean_redis: redis.Redis):
    backend = app.backend
    assert isinstance(backend, LeanRedisBackend)
    pubsub = clean_redis.pubsub(ignore_subscribe_messages=True)
    key = backend.get_key_for_task("t-1").decode()
    pubsub.subscribe(key)
    try:
        assert pubsub.get_message(timeout=5) is None  # the (ignored) subscribe confirmation
        backend.store_result("t-1", {"text": "hi"}, states.SUCCESS)
        message = pubsub.get_message(timeout=5)
    finally:
        pubsub.close()
    assert message is not None
    assert json.loads(message["data"])["result"] == {"text": "hi"}
    assert AsyncResult("t-1", app=app).get(timeout=5) == {"text": "hi"}
    ttl = clean_redis.ttl(key)
    assert 0 < ttl <= int(app.conf.result_expires)


def test_lean_backend_stores_failures_with_their_message(clean_redis: redis.Redis):
    app.backend.mark_as_failure("t-2", RuntimeError("engine fell over"))
    result = AsyncResult("t-2", app=app)
    assert result.state == states.FAILURE
    with pytest.raises(RuntimeError, match="engine fell over"):
        result.get(timeout=5)


def test_publisher_leaves_a_past_expiry_for_the_worker_to_judge(clean_redis: redis.Redis):
    """The publisher does not judge deadlines: the worker drops the message (see test_api)."""
    past = datetime.now(UTC) - timedelta(seconds=1)
    publish_task(GENERATE_TASK, "late", QUEUE, [{}], expires=past)
    assert pop_envelope(clean_redis)["headers"]["expires"] == past.isoformat()


def test_batched_store_writes_what_store_result_writes(clean_redis: redis.Redis):
    backend = app.backend
    backend.store_result("one", {"text": "a"}, states.SUCCESS)
    backend.store_many(
        [("many", {"text": "a"}, states.SUCCESS), ("bad", RuntimeError("no"), states.FAILURE)]
    )
    single, batched = (backend.get_task_meta(i) for i in ("one", "many"))
    for meta in (single, batched):
        meta.pop("date_done"), meta.pop("task_id")
    assert batched == single
    assert AsyncResult("many", app=app).get(timeout=5) == {"text": "a"}
    assert AsyncResult("bad", app=app).state == states.FAILURE


def test_an_ack_takes_no_unacked_entry_of_a_message_its_worker_no_longer_holds(
    clean_redis: redis.Redis,
):
    # As after a partition: a rescuer took the cut-off worker for dead, restored its messages
    # and forgot its held set; another worker holds "restored" now under the same tag.
    broker.set_owner("cut-off@host")
    try:
        with app.connection_for_write() as connection:
            qos = connection.default_channel.qos
            for tag in ("mine", "restored"):
                clean_redis.zadd(qos.unacked_index_key, {tag: 1.0})
                clean_redis.hset(qos.unacked_key, tag, "[]")
            clean_redis.sadd(held_key("cut-off@host"), "mine")
            clean_redis.sadd(held_key("new-holder@host"), "restored")
            broker._held_here.update({"mine", "restored"})  # as its fetches left them
            qos.ack("mine")
            qos.ack("restored")  # the late ack
            qos.reject("restored", requeue=False)  # a drop is the same bookkeeping
    finally:
        broker.set_owner(None)
    assert clean_redis.hkeys(qos.unacked_key) == [b"restored"]
    assert clean_redis.zrange(qos.unacked_index_key, 0, -1) == [b"restored"]
    assert clean_redis.smembers(held_key("new-holder@host")) == {b"restored"}
    assert not clean_redis.exists(held_key("cut-off@host"))
    # Acked either way, neither is this process's any more: keep_visible dates neither (the
    # merge of this ack with the failover fix once kept them, and the Sentinel test hung).
    assert broker.held_here() == []

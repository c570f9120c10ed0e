"""The reconciler on real Redis: queued rows whose messages are gone are republished once."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.test import Client
from django.utils import timezone

from contract.keys import RECONCILED_KEY
from llmqueue.models import PromptRequest
from llmqueue.queueing.reconcile import Reconciler, request_ids_in
from tests.conftest import Seeded, pretend_live
from tests.test_batches import auth

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
QUEUE = "default.interactive"
LATER = timedelta(seconds=15)  # past the grace period, before the interactive deadline (30 s)


def admit(key: str, n: int) -> list[str]:
    client = Client()
    ids = []
    for i in range(n):
        body = {"model": "sim", "prompt": f"p{i}", "max_tokens": 4, "background": True}
        response = client.post(
            "/v1/completions", json.dumps(body), content_type="application/json", **auth(key)
        )
        assert response.status_code == 202, response.content
        ids.append(response.json()["id"])
    return ids


def ids_on(client: redis.Redis, queue: str) -> list[str]:
    return [i for raw in client.lrange(queue, 0, -1) for i in request_ids_in(json.loads(raw))]


def test_a_row_whose_message_is_lost_is_republished_once_after_two_scans(
    seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    lost, kept = admit(seeded.key, 2)
    assert sorted(ids_on(clean_redis, QUEUE)) == sorted([lost, kept])
    # Redis lost the message of `lost` (a restart without its data, a failover).
    clean_redis.rpop(QUEUE)  # the oldest message: LPUSH puts the newest at the head
    assert ids_on(clean_redis, QUEUE) == [kept]
    now = timezone.now() + LATER
    reconciler = Reconciler()
    confirm = settings.LLMQUEUE_RECONCILE_CONFIRM_SECONDS
    assert reconciler.run_once(now, clock=100.0) == 0  # missing once: only suspected
    assert set(reconciler.suspects) == {PromptRequest.objects.get(pk=lost).pk}
    assert reconciler.run_once(now, clock=100.0 + confirm / 2) == 0  # not yet far enough apart
    assert reconciler.run_once(now, clock=100.0 + confirm) == 1
    assert sorted(ids_on(clean_redis, QUEUE)) == sorted([lost, kept])
    assert reconciler.run_once(now, clock=200.0) == 0  # both present now: nothing twice
    assert int(clean_redis.get(RECONCILED_KEY) or 0) == 1
    assert list(PromptRequest.objects.values_list("status", flat=True)) == [S.QUEUED] * 2


def test_delivered_young_running_and_overdue_rows_are_left_alone(
    seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    delivered, young, running, overdue = admit(seeded.key, 4)
    # A worker took `delivered`: kombu moved its message into the unacked hash.
    raw = clean_redis.rpop(QUEUE)
    assert isinstance(raw, bytes) and request_ids_in(json.loads(raw)) == [delivered]
    clean_redis.hset("unacked", "tag-1", json.dumps([json.loads(raw), "", QUEUE]))
    clean_redis.delete(QUEUE)  # every other message is gone
    now = timezone.now() + LATER
    PromptRequest.objects.filter(pk=young).update(enqueued_at=now)
    PromptRequest.objects.filter(pk=running).update(status=S.RUNNING)
    PromptRequest.objects.filter(pk=overdue).update(deadline_at=now)
    reconciler = Reconciler()
    assert [reconciler.run_once(now, clock=c) for c in (0.0, 50.0, 100.0)] == [0, 0, 0]
    assert clean_redis.llen(QUEUE) == 0 and clean_redis.get(RECONCILED_KEY) is None


def test_a_row_claimed_between_two_scans_is_not_republished(
    seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    (request_id,) = admit(seeded.key, 1)
    clean_redis.delete(QUEUE)  # in a worker's hands, between its BRPOP and its unacked write
    now = timezone.now() + LATER
    reconciler = Reconciler()
    assert reconciler.run_once(now, clock=0.0) == 0
    PromptRequest.objects.filter(pk=request_id).update(status=S.RUNNING)  # its claim
    assert reconciler.run_once(now, clock=50.0) == 0
    assert clean_redis.llen(QUEUE) == 0 and not reconciler.suspects

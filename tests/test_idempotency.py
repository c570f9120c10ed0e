"""Idempotency-Key: a prompt sent again under its key answers the first send's request, never a
second generation; a refused send frees the key; another body or tenant is another request."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
import redis

from llmqueue.api import idempotency
from llmqueue.api.idempotency import entry_key
from llmqueue.models import PromptRequest
from tests.conftest import SIMULATED, Seeded, WorkerFactory, pretend_live, queued_messages
from tests.test_api import post
from tests.test_api_admission import limit_tenant
from tests.test_crash_recovery import listen

pytestmark = pytest.mark.django_db(transaction=True)
BODY = {"model": "sim", "prompt": "once only", "max_tokens": 4}
BACKGROUND = {"X-LLMQueue-Background": "true"}


def send(server: Any, key: str, idempotency_key: str, body: Any = BODY, **headers: str):
    return post(server, "/v1/completions", key, body, **{"Idempotency-Key": idempotency_key},
                **headers)  # fmt: skip


def test_a_background_send_repeated_under_its_key_is_the_same_request(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")  # no worker: the request stays queued
    first = send(live_server, seeded.key, "k-1", **BACKGROUND)
    again = send(live_server, seeded.key, "k-1", **BACKGROUND)
    assert (first.status_code, again.status_code) == (202, 202)
    assert again.json()["id"] == first.json()["id"] == again.headers["X-LLMQueue-Request-Id"]
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert PromptRequest.objects.count() == 1
    assert queued_messages(clean_redis) == 1  # published once


def test_a_blocking_send_repeated_after_its_answer_gets_the_same_completion_generated_once(
    live_server, seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    published, stop, listener = listen(clean_redis)
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    first = send(live_server, seeded.key, "k-2")
    again = send(live_server, seeded.key, "k-2")
    stop.set()
    listener.join(timeout=5)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["choices"] == first.json()["choices"]
    assert again.json()["usage"] == first.json()["usage"]
    [row] = PromptRequest.objects.all()
    assert str(row.id) == first.headers["X-LLMQueue-Request-Id"]
    assert str(row.id) == again.headers["X-LLMQueue-Request-Id"]
    assert row.attempts == 1
    assert Counter(k.split(":")[1] for k in published if k.startswith(str(row.id))) == {
        "SUCCESS": 1
    }


def test_another_request_under_a_used_key_is_refused_and_stores_nothing(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    assert send(live_server, seeded.key, "k-3", **BACKGROUND).status_code == 202
    other = send(live_server, seeded.key, "k-3", {**BODY, "prompt": "something else"}, **BACKGROUND)
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    # The headers that change a request count as much as its body: blocking is another request.
    assert send(live_server, seeded.key, "k-3").status_code == 422
    assert PromptRequest.objects.count() == 1 and queued_messages(clean_redis) == 1


def test_a_refused_send_frees_its_key_for_the_retry_the_refusal_asks_for(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    limit_tenant(tokens_per_minute=6)
    small = {**BODY, "max_tokens": 2}  # ~3 prompt tokens + 2: one fits the minute, not two
    assert send(live_server, seeded.key, "k-4", small, **BACKGROUND).status_code == 202
    refused = send(live_server, seeded.key, "k-5", small, **BACKGROUND)
    assert refused.status_code == 429
    assert not clean_redis.exists(entry_key(seeded.tenant_id, "k-5"))
    assert PromptRequest.objects.count() == 1 and queued_messages(clean_redis) == 1
    limit_tenant(tokens_per_minute=1000)
    # Retried as its Retry-After says: the API learns the new limit from the decision after
    # the change, and the bucket refills from its 1 token at the new rate.
    for _ in range(10):
        retried = send(live_server, seeded.key, "k-5", small, **BACKGROUND)
        if retried.status_code != 429:
            break
        time.sleep(0.3)
    assert retried.status_code == 202 and "Idempotent-Replayed" not in retried.headers
    assert PromptRequest.objects.count() == 2


def test_the_same_key_from_two_tenants_is_two_requests(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    mine = send(live_server, seeded.key, "shared", **BACKGROUND)
    theirs = send(live_server, seeded.other_key, "shared", **BACKGROUND)
    assert (mine.status_code, theirs.status_code) == (202, 202)
    assert mine.json()["id"] != theirs.json()["id"]
    assert "Idempotent-Replayed" not in theirs.headers


@pytest.mark.parametrize("bad", ["", "x" * 256])
def test_a_key_of_no_or_too_many_characters_is_refused_and_stores_nothing(
    live_server, seeded: Seeded, clean_redis: redis.Redis, bad: str
):
    pretend_live(clean_redis, "default")
    response = httpx.post(
        f"{live_server.url}/v1/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {seeded.key}", "Idempotency-Key": bad, **BACKGROUND},
        timeout=30,
    )
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "Idempotency-Key"
    assert PromptRequest.objects.count() == 0 and queued_messages(clean_redis) == 0
    assert list(clean_redis.scan_iter(match=entry_key(seeded.tenant_id, "*")[:-1] + "*")) == []


def test_a_send_racing_the_first_before_its_row_exists_is_told_to_retry(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    # As the first send leaves it between binding its key and INSERTing its row.
    headers = {"X-LLMQueue-Tier": None, "X-LLMQueue-Background": "true",
               "X-LLMQueue-Deadline-Seconds": None}  # fmt: skip
    first_id = uuid.uuid4()
    assert idempotency.reserve(seeded.tenant_id, "k-6", first_id,
                               idempotency.fingerprint(BODY, headers)) is None  # fmt: skip
    racing = send(live_server, seeded.key, "k-6", **BACKGROUND)
    assert (racing.status_code, racing.headers["Retry-After"]) == (409, "1")
    assert racing.json()["error"]["code"] == "idempotency_key_in_use"
    assert PromptRequest.objects.count() == 0 and queued_messages(clean_redis) == 0

"""Admission through the HTTP API: 429 and 503 with Retry-After and nothing stored, refunds on a
real worker, quota changes seen by the running server, a broker lost at publish."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pytest
import redis
from django.db import connection

from llmqueue.admission import books
from llmqueue.models import PromptRequest, Tenant, Tier
from llmqueue.queueing.publishing import publishing_key
from tests.conftest import (
    SIMULATED,
    Seeded,
    WorkerFactory,
    assert_nothing_enqueued,
    pretend_live,
    queued_messages,
    wait_until,
)
from tests.test_api import post

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def ask(server: Any, key: str, max_tokens: int = 2, **body: Any) -> Any:
    payload = {"model": "sim", "prompt": "hi", "max_tokens": max_tokens, "background": True}
    return post(server, "/v1/completions", key, {**payload, **body})


def limit_tenant(**limits: Any) -> None:
    tenant = Tenant.objects.get(name="acme")
    for field, value in limits.items():
        setattr(tenant, field, value)
    tenant.save()  # a save, as the admin does: it bumps the config version


def test_over_the_request_rate_is_429_with_retry_after_and_nothing_stored(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    limit_tenant(requests_per_second=0.01, burst=2)
    assert [ask(live_server, seeded.key).status_code for _ in range(2)] == [202, 202]
    refused = ask(live_server, seeded.key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "0.01 per second, in bursts of up to 2" in error["message"]
    assert 90 <= int(refused.headers["Retry-After"]) <= 100  # one request every 100 s
    assert PromptRequest.objects.count() == 2 and queued_messages(clean_redis) == 2


def test_over_the_tokens_per_minute_is_429_naming_tokens(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    limit_tenant(tokens_per_minute=60)  # one token a second
    assert ask(live_server, seeded.key, max_tokens=40).status_code == 202  # holds 41 tokens
    refused = ask(live_server, seeded.key, max_tokens=40)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"
    assert 20 <= int(refused.headers["Retry-After"]) <= 23  # 41 needed, ~19 left
    never = ask(live_server, seeded.key, max_tokens=100)  # more than a whole minute holds
    assert never.status_code == 422
    assert never.json()["error"]["code"] == "tokens_per_minute_exceeded"
    assert PromptRequest.objects.count() == 1 and queued_messages(clean_redis) == 1


def test_no_live_worker_is_503_and_nothing_stored(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    refused = ask(live_server, seeded.key)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_worker"
    assert refused.headers["Retry-After"] == "5"
    assert_nothing_enqueued(clean_redis)
    assert not clean_redis.exists(books.bucket_key("requests", seeded.tenant_id))


def test_full_tier_queue_is_503_and_nothing_stored(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    Tier.objects.filter(name="interactive").update(max_queue_depth=2)
    assert [ask(live_server, seeded.key).status_code for _ in range(2)] == [202, 202]
    refused = ask(live_server, seeded.key)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert "2 requests waiting, limit 2" in error["message"]
    assert PromptRequest.objects.count() == 2 and queued_messages(clean_redis) == 2


def test_a_wait_past_the_tiers_first_token_target_is_503_and_nothing_stored(
    live_server, seeded: Seeded, clean_redis: redis.Redis, settings: Any
):
    # A drain rate that does not decay while the request is on its way: its estimate is exact.
    settings.LLMQUEUE_DRAIN_HALF_LIFE_SECONDS = 1e6
    pretend_live(clean_redis, "default")
    Tier.objects.filter(name="interactive").update(first_token_target_seconds=0.5)
    assert [ask(live_server, seeded.key).status_code for _ in range(3)] == [202] * 3
    queue = "default.interactive"
    tau = books.drain_tau_seconds()
    pipe = clean_redis.pipeline(transaction=False)
    books.record_drain(pipe, queue, 0, {}, now=time.time() - 2 * tau)  # counting since 2 tau
    books.record_drain(pipe, queue, 4 * tau * (1 - math.exp(-2)), {})  # 4 per second
    pipe.execute()
    # 3 due first at 4/s, its deadline 30 s: the median (the default quantile) of Gamma(4, 4/s)
    # is ~0.92 s.
    refused = ask(live_server, seeded.key)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "slo_unreachable"
    assert error["message"] == (
        "Queue 'default.interactive' would likely not reach this request within its tier's "
        "0.5 s first-token target: 3 requests due first (about 1 s of work ahead), its wait to "
        "a first token estimated at 0.92 s (the 0.5 quantile)."
    )
    assert refused.headers["Retry-After"] == "1"  # 0.42 s past the target, rounded up
    assert PromptRequest.objects.count() == 3 and queued_messages(clean_redis) == 3


def test_an_expired_request_gives_its_tokens_back(
    live_server, seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    Tier.objects.filter(name="interactive").update(max_wait_seconds=1)
    limit_tenant(tokens_per_minute=6)  # a token every 10 s: a refund is the only way back
    first = ask(live_server, seeded.key, max_tokens=4)  # holds 5 of 6
    assert first.status_code == 202
    assert ask(live_server, seeded.key, max_tokens=4).status_code == 429
    time.sleep(1.2)  # its deadline passes while it waits
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")

    def expired() -> bool:
        return PromptRequest.objects.get(pk=first.json()["id"]).status == S.EXPIRED

    wait_until(expired, 20, "the first request to expire")
    again = ask(live_server, seeded.key, max_tokens=4, prompt="again")
    assert again.status_code == 202, again.text  # all 5 tokens came back


def test_a_quota_change_in_the_admin_reaches_the_running_server(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    assert ask(live_server, seeded.key).status_code == 202  # the server caches this tenant
    limit_tenant(requests_per_second=0.01, burst=1)
    started = time.monotonic()
    statuses = []
    while time.monotonic() - started < 5 and 429 not in statuses:
        statuses.append(ask(live_server, seeded.key).status_code)
    # The next decision reads the bumped version: the one after runs on the new limits.
    assert statuses[-1] == 429 and len(statuses) <= 3


def test_a_broker_lost_at_publish_fails_the_row_and_settles_its_books(
    live_server, seeded: Seeded, clean_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    pretend_live(clean_redis, "default")
    limit_tenant(tokens_per_minute=6)

    def refuse(*_: Any, **__: Any) -> None:
        raise redis.ConnectionError("broker went away")

    monkeypatch.setattr("llmqueue.queueing.submission.publish_tasks", refuse)
    refused = ask(live_server, seeded.key, max_tokens=4)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "unavailable"
    row = PromptRequest.objects.get()
    assert row.status == S.FAILED and row.error.startswith("not enqueued: broker unavailable")
    # It no longer counts in its queue's depth as on its way (it never will be queued).
    assert clean_redis.zcard(publishing_key(row.queue)) == 0
    assert queued_messages(clean_redis) == 0
    monkeypatch.undo()
    # Its 5 tokens came back: another request of the same size fits in the 6-token minute.
    assert ask(live_server, seeded.key, max_tokens=4).status_code == 202


def test_a_database_refusing_the_row_is_503_and_releases_the_reservation(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    limit_tenant(tokens_per_minute=6)
    table = PromptRequest._meta.db_table
    with connection.cursor() as cursor:  # a real failure: the INSERT finds no table
        cursor.execute(f"ALTER TABLE {table} RENAME TO llmqueue_moved_away")
    try:
        refused = ask(live_server, seeded.key, max_tokens=4)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE llmqueue_moved_away RENAME TO {table}")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
    assert refused.json()["error"]["message"].startswith("The database is unavailable")
    assert_nothing_enqueued(clean_redis)
    assert PromptRequest.objects.count() == 0
    waiting = clean_redis.get(books.waiting_key("default.interactive", seeded.tenant_id))
    assert int(waiting or 0) == 0
    # Its 5 tokens came back: another request of the same size fits in the 6-token minute.
    assert ask(live_server, seeded.key, max_tokens=4).status_code == 202


def test_rejections_are_answers_not_logged_errors(
    live_server, seeded: Seeded, clean_redis: redis.Redis, caplog: pytest.LogCaptureFixture
):
    limit_tenant(requests_per_second=0.01, burst=1)
    with caplog.at_level(logging.INFO, logger="django.request"):
        assert ask(live_server, seeded.key).status_code == 503  # no worker
        pretend_live(clean_redis, "default")
        assert [ask(live_server, seeded.key).status_code for _ in range(2)] == [202, 429]
    assert [r for r in caplog.records if r.name == "django.request"] == []


def test_a_worker_reports_the_engines_lead_to_the_first_token(
    live_server, seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    done = ask(live_server, seeded.key, background=False)
    assert done.status_code == 200, done.text
    row = PromptRequest.objects.get()
    assert row.first_token_at is not None
    drain = books.drain_key("default.interactive")

    def reported() -> bool:
        return clean_redis.hget(drain, "lead_n") is not None

    wait_until(reported, 10, "the lead to be reported")  # sent after the result
    lead_sum, lead_n = (float(v or "nan") for v in clean_redis.hmget(drain, "lead_sum", "lead_n"))
    assert lead_n == 1.0
    # From the engine's inbox to the first token's step: inside enqueue → first token.
    assert 0 <= lead_sum <= (row.first_token_at - row.enqueued_at).total_seconds()

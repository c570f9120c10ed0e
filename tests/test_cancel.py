"""Cancelling a request (POST /v1/requests/{id}/cancel) on a real worker: a queued one never
reaches an engine, a running one is aborted in the engine at its next step and never recorded, a
blocked caller is answered 409, the tokens come back; a finished one keeps its output."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from contract import liveness
from llmqueue import usage
from llmqueue.models import PromptRequest, Tenant, TenantUsage
from tests.conftest import (
    SIMULATED,
    Seeded,
    WorkerFactory,
    pretend_live,
    queued_messages,
    wait_until,
)
from tests.test_api import get, post

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
# ~30 ms a decode step: 500 tokens take ~15 s, far longer than any wait below.
SLOW = ("--sim-time-scale", "4")


def ask(server: Any, key: str, max_tokens: int = 500, background: bool = True) -> Any:
    body = {"model": "sim", "prompt": "hi", "max_tokens": max_tokens, "background": background}
    return post(server, "/v1/completions", key, body)


def cancel(server: Any, key: str, request_id: str) -> Any:
    return post(server, f"/v1/requests/{request_id}/cancel", key, b"")


def in_engine(client: redis.Redis, worker: Any) -> int:
    stats = liveness.worker_stats(client, "default").get(worker.node, {})
    return int(stats.get("engine", stats).get("in_engine", -1))


def test_a_queued_request_cancelled_never_runs_and_gives_its_tokens_back(
    live_server, seeded: Seeded, clean_redis: redis.Redis, start_worker: WorkerFactory
):
    pretend_live(clean_redis, "default")
    tenant = Tenant.objects.get(pk=seeded.tenant_id)
    tenant.tokens_per_minute = 600  # room for one request of 502 tokens a minute
    tenant.save()
    request_id = ask(live_server, seeded.key).json()["id"]
    assert ask(live_server, seeded.key).status_code == 429  # its 502 tokens are held
    answer = cancel(live_server, seeded.key, request_id)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "cancelled"
    second = ask(live_server, seeded.key)
    assert second.status_code == 202  # the reservation came back at once
    cancel(live_server, seeded.key, second.json()["id"])
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    wait_until(lambda: queued_messages(clean_redis) == 0, 20, "both messages to be dropped")
    rows = list(PromptRequest.objects.values_list("status", "attempts", "output_text"))
    assert rows == [(S.CANCELLED, 0, ""), (S.CANCELLED, 0, "")]
    usage.flush(clean_redis)  # counted as cancelled in the tenant's usage, once each
    counted = TenantUsage.objects.filter(tenant_id=seeded.tenant_id)
    assert sum(counted.values_list("cancelled", flat=True)) == 2


def test_a_running_request_is_aborted_in_the_engine_and_never_recorded(
    live_server, seeded: Seeded, clean_redis: redis.Redis, start_worker: WorkerFactory
):
    worker = start_worker("default", *SIMULATED, *SLOW)
    request_id = ask(live_server, seeded.key).json()["id"]
    wait_until(lambda: PromptRequest.objects.get(pk=request_id).status == S.RUNNING, 10, "run")
    wait_until(lambda: in_engine(clean_redis, worker) == 1, 10, "the engine to hold it")
    cancelled_at = time.monotonic()
    assert cancel(live_server, seeded.key, request_id).json()["status"] == "cancelled"
    wait_until(lambda: in_engine(clean_redis, worker) == 0, 5, "the engine to drop it")
    assert time.monotonic() - cancelled_at < 5  # not the ~15 s the generation would take
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "its message to be acked")
    row = PromptRequest.objects.get(pk=request_id)
    assert (row.status, row.attempts, row.output_text, row.completion_tokens) == (
        S.CANCELLED, 1, "", None,
    )  # fmt: skip


def test_a_caller_blocked_on_a_request_is_answered_409_when_it_is_cancelled(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    start_worker("default", *SIMULATED, *SLOW)
    answers: list[Any] = []
    blocked = threading.Thread(
        target=lambda: answers.append(ask(live_server, seeded.key, background=False))
    )
    blocked.start()
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).exists(), 10, "run")
    row = PromptRequest.objects.get()
    assert cancel(live_server, seeded.key, str(row.id)).status_code == 200
    blocked.join(timeout=10)
    assert answers and answers[0].status_code == 409, answers
    error = answers[0].json()["error"]
    assert (error["code"], error["message"]) == ("request_cancelled", "cancelled by the caller")
    assert answers[0].headers["X-LLMQueue-Request-Id"] == str(row.id)


def test_a_finished_request_keeps_its_output_and_another_tenant_cannot_cancel(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    done = ask(live_server, seeded.key, max_tokens=3, background=False)
    assert done.status_code == 200
    request_id = done.headers["X-LLMQueue-Request-Id"]
    assert cancel(live_server, seeded.other_key, request_id).status_code == 404
    answer = cancel(live_server, seeded.key, request_id)
    assert (answer.status_code, answer.json()["status"]) == (200, "succeeded")
    assert answer.json()["result"]["choices"][0]["text"] == " lorem ipsum dolor"
    assert get(live_server, f"/v1/requests/{request_id}", seeded.key).json()["status"] == (
        "succeeded"
    )

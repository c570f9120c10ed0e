"""The HTTP API end to end: live server → Redis → simulated-engine worker subprocess → result."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest
import redis

from llmqueue.models import PromptRequest, Tenant, Tier
from tests.conftest import (
    SIMULATED,
    Seeded,
    WorkerFactory,
    assert_nothing_enqueued,
    pretend_live,
    queued_messages,
)

pytestmark = pytest.mark.django_db(transaction=True)


def post(server: Any, path: str, key: str | None, body: Any, **headers: str) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def get(server: Any, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}{path}", headers=headers, timeout=30)


def test_completion_round_trip(live_server, seeded: Seeded, start_worker: WorkerFactory):
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    response = post(
        live_server,
        "/v1/completions",
        seeded.key,
        {"model": "sim", "prompt": "hello", "max_tokens": 5},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    request_id = response.headers["X-LLMQueue-Request-Id"]
    assert body["id"] == f"cmpl-{request_id}"
    assert body["object"] == "text_completion"
    assert body["model"] == "sim"
    assert body["choices"] == [
        {
            "index": 0,
            "text": " lorem ipsum dolor sit amet",
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    row = PromptRequest.objects.get(pk=request_id)
    assert row.status == PromptRequest.Status.SUCCEEDED
    assert (row.attempts, row.prompt_tokens, row.completion_tokens) == (1, 2, 5)
    assert row.output_text == " lorem ipsum dolor sit amet"
    assert row.started_at is not None and row.finished_at is not None
    assert row.tier.name == "interactive"


def test_chat_round_trip(live_server, seeded: Seeded, start_worker: WorkerFactory):
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = post(
        live_server,
        "/v1/chat/completions",
        seeded.key,
        {"model": "sim", "messages": messages, "max_completion_tokens": 3},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " lorem ipsum dolor"}
    assert body["usage"]["completion_tokens"] == 3
    row = PromptRequest.objects.get(pk=response.headers["X-LLMQueue-Request-Id"])
    assert row.kind == "chat" and row.messages == messages


def test_background_returns_202_and_is_pollable(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    response = post(
        live_server,
        "/v1/completions",
        seeded.key,
        {"model": "sim", "prompt": "hi", "max_tokens": 2},
        **{"X-LLMQueue-Background": "true"},
    )
    assert response.status_code == 202
    request_id = response.json()["id"]
    assert response.json()["status"] == "queued"

    def finished() -> bool:
        return (
            get(live_server, f"/v1/requests/{request_id}", seeded.key).json()["status"]
            == "succeeded"
        )

    from tests.conftest import wait_until

    wait_until(finished, 20, "the background request")
    status = get(live_server, f"/v1/requests/{request_id}", seeded.key).json()
    assert status["attempts"] == 1
    assert status["result"]["choices"][0]["text"] == " lorem ipsum"
    # Another tenant's key sees nothing: 404, as for an unknown id.
    other = get(live_server, f"/v1/requests/{request_id}", seeded.other_key)
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "request_not_found"
    assert get(live_server, f"/v1/requests/{uuid.uuid4()}", seeded.key).status_code == 404


def test_models_lists_only_models_with_a_live_worker(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    assert get(live_server, "/v1/models", seeded.key).json() == {"object": "list", "data": []}
    worker = start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    data = get(live_server, "/v1/models", seeded.key).json()["data"]
    assert [(m["id"], m["object"], m["owned_by"]) for m in data] == [("sim", "model", "llmqueue")]
    worker.stop()
    assert get(live_server, "/v1/models", seeded.key).json()["data"] == []


def test_wait_timeout_is_504_and_request_stays_queued(
    live_server, seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")  # a worker that never gets to it
    Tier.objects.filter(name="interactive").update(max_wait_seconds=1)
    response = post(
        live_server,
        "/v1/completions",
        seeded.key,
        {"model": "sim", "prompt": "hi", "max_tokens": 2},
    )
    assert response.status_code == 504
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("timeout", "wait_timeout")
    request_id = response.headers["X-LLMQueue-Request-Id"]
    assert f"/v1/requests/{request_id}" in error["message"]
    assert PromptRequest.objects.get(pk=request_id).status == PromptRequest.Status.QUEUED
    assert get(live_server, f"/v1/requests/{request_id}", seeded.key).json()["status"] == "queued"


def test_expired_request_is_never_generated(
    live_server, seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")  # a worker busy elsewhere while the deadline passes
    Tier.objects.filter(name="interactive").update(max_wait_seconds=1)
    response = post(
        live_server,
        "/v1/completions",
        seeded.key,
        {"model": "sim", "prompt": "hi", "max_tokens": 2},
    )
    assert response.status_code == 504
    request_id = response.headers["X-LLMQueue-Request-Id"]
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    from tests.conftest import wait_until

    def expired() -> bool:
        return PromptRequest.objects.get(pk=request_id).status == PromptRequest.Status.EXPIRED

    wait_until(expired, 20, "the expiry")
    row = PromptRequest.objects.get(pk=request_id)
    assert (row.attempts, row.output_text, row.completion_tokens) == (0, "", None)
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "the message to be acked")


# --- rejections: each one asserts nothing was stored or enqueued -------------------------------

GOOD = {"model": "sim", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/completions", b"{not json", 400, "invalid_json"),
        ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
        ("/v1/completions", {"prompt": "x"}, 400, "missing_parameter"),
        ("/v1/completions", {"model": "sim"}, 400, "missing_parameter"),
        ("/v1/completions", {**GOOD, "max_tokens": "4"}, 400, "invalid_type"),
        ("/v1/completions", {**GOOD, "temperature": True}, 400, "invalid_type"),
        ("/v1/completions", {**GOOD, "logprobs": 2}, 400, "unknown_parameter"),
        ("/v1/completions", {**GOOD, "stream": True}, 400, "invalid_request"),
        ("/v1/completions", {**GOOD, "prompt": "  "}, 422, "invalid_parameter"),
        ("/v1/completions", {**GOOD, "max_tokens": 0}, 422, "invalid_parameter"),
        ("/v1/completions", {**GOOD, "max_tokens": 513}, 422, "invalid_parameter"),
        ("/v1/completions", {**GOOD, "temperature": 2.5}, 422, "invalid_parameter"),
        ("/v1/completions", {**GOOD, "n": 2}, 422, "invalid_parameter"),
        ("/v1/completions", {**GOOD, "prompt": "x" * 8180}, 422, "context_length_exceeded"),
        ("/v1/completions", {**GOOD, "prompt": "x" * 9000}, 413, "context_length_exceeded"),
        ("/v1/completions", {**GOOD, "model": "nope"}, 404, "model_not_found"),
        ("/v1/chat/completions", {"model": "sim", "messages": []}, 422, "invalid_parameter"),
        ("/v1/chat/completions", {"model": "sim", "messages": "hi"}, 400, "invalid_request"),
        (
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "invalid_request",
        ),
        ("/v1/chat/completions", {**GOOD}, 400, "unknown_parameter"),
    ],
)
def test_bad_input_is_rejected_and_nothing_enqueued(
    live_server, seeded: Seeded, clean_redis, path, body, status, code
):
    response = post(live_server, path, seeded.key, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"]
    assert_nothing_enqueued(clean_redis)


def test_tenant_max_tokens_limit_is_422(live_server, seeded: Seeded, clean_redis):
    Tenant.objects.filter(pk=seeded.tenant_id).update(max_tokens_per_request=8)
    response = post(live_server, "/v1/completions", seeded.key, {**GOOD, "max_tokens": 9})
    assert response.status_code == 422
    assert "between 1 and 8" in response.json()["error"]["message"]
    assert_nothing_enqueued(clean_redis)


@pytest.mark.parametrize(
    ("key", "code"), [(None, "invalid_api_key"), ("lq-wrong", "invalid_api_key")]
)
def test_bad_key_is_401(live_server, seeded: Seeded, clean_redis, key, code):
    response = post(live_server, "/v1/completions", key, GOOD)
    assert response.status_code == 401
    assert response.json()["error"] == {
        "message": response.json()["error"]["message"],
        "type": "authentication_error",
        "param": None,
        "code": code,
    }
    assert_nothing_enqueued(clean_redis)


def test_revoked_key_is_401_and_inactive_tenant_403(live_server, seeded: Seeded, clean_redis):
    from llmqueue.api.auth import forget_cached_callers
    from llmqueue.apikeys import revoke_api_key
    from llmqueue.models import ApiKey

    Tenant.objects.filter(pk=seeded.tenant_id).update(is_active=False)
    response = post(live_server, "/v1/completions", seeded.key, GOOD)
    assert (response.status_code, response.json()["error"]["code"]) == (403, "tenant_inactive")
    revoke_api_key(ApiKey.objects.get(tenant_id=seeded.tenant_id))
    forget_cached_callers()  # the live server shares this process's cache
    response = post(live_server, "/v1/completions", seeded.key, GOOD)
    assert (response.status_code, response.json()["error"]["code"]) == (401, "revoked_api_key")
    assert_nothing_enqueued(clean_redis)


def test_wrong_method_is_405(live_server, seeded: Seeded, clean_redis):
    response = get(live_server, "/v1/completions", seeded.key)
    assert response.status_code == 405
    assert_nothing_enqueued(clean_redis)


def test_a_tier_added_in_the_admin_is_served_by_a_running_worker(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    """The worker was started before the tier existed; no restart: it consumes the new tier's
    queue within LLMQUEUE_TIER_REFRESH_SECONDS of the admin's save."""
    from django.conf import settings

    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    urgent = Tier.objects.create(name="urgent", priority=0, weight=4, max_wait_seconds=30)
    tenant = Tenant.objects.get(pk=seeded.tenant_id)
    tenant.tier = urgent
    tenant.save()  # as the admin saves it: the API's caches follow the config version
    started = time.monotonic()
    response = post(
        live_server,
        "/v1/completions",
        seeded.key,
        {"model": "sim", "prompt": "hi", "max_tokens": 3},
    )
    waited = time.monotonic() - started
    assert response.status_code == 200, response.text
    row = PromptRequest.objects.get(pk=response.headers["X-LLMQueue-Request-Id"])
    assert (row.status, row.tier.name) == (PromptRequest.Status.SUCCEEDED, "urgent")
    assert waited < settings.LLMQUEUE_TIER_REFRESH_SECONDS + 3

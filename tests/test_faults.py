"""Redis faults under a running API and workers: the broker down at publish, a restart with AOF."""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections import Counter

import httpx
import pytest
import redis

from devtools.embedded_redis import redis_answers
from llmqueue.models import PromptRequest
from tests.conftest import SIMULATED, Seeded, pretend_live, queued_messages, settle, wait_until
from tests.stack import Stack, get, kill, post, stack_fixture  # noqa: F401 (the stack fixture)
from tests.test_redelivery import count_published_results

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status

FAST_WORKER = (*SIMULATED, "--sim-time-scale", "0")
# One slot, one sequence: the worker holds exactly one message. 32 decode steps of ≥7.4 ms × 50
# take ~12 s, so it is surely still generating when it is killed.
SLOW_WORKER = (*SIMULATED[:-1], "1", "--slots", "1", "--sim-time-scale", "50")
MAX_TOKENS = 32


def unacked_task_ids(client: redis.Redis) -> list[str]:
    # kombu keeps [raw message, exchange, routing key] per delivery tag.
    return [json.loads(raw)[0]["headers"]["id"] for raw in client.hvals("unacked")]


def test_broker_down_answers_503_and_stores_nothing(seeded: Seeded, stack: Stack):
    first_server = stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    stack.start_api(seeded.key)
    worker, _ = stack.start_worker(client, *FAST_WORKER)
    # A round trip first, so the API holds pooled connections to the server that then dies.
    before = post(stack, seeded.key)
    assert before.status_code == 200, before.text
    assert kill(worker, signal.SIGTERM) == 0

    assert kill(first_server, signal.SIGKILL) == -signal.SIGKILL
    assert not redis_answers(stack.redis_url)
    refused = post(stack, seeded.key)

    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"] == "5"
    assert refused.json() == {
        "error": {
            "message": "The queue is unavailable; retry shortly.",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }
    }
    # Admission needs Redis before anything is stored: no row, nothing reserved or queued.
    assert list(PromptRequest.objects.values_list("id", flat=True)) == [
        uuid.UUID(before.headers["X-LLMQueue-Request-Id"])
    ]

    second_server = stack.start_redis()
    assert second_server.pid != first_server.pid
    pretend_live(client, "default")  # the stopped worker left its pool: admission needs one
    # The same API process, no restart: its clients reconnect to the new server.
    queued = post(stack, seeded.key, background=True)
    assert queued.status_code == 202, queued.text
    assert queued.json()["status"] == "queued"
    stack.start_worker(client, *FAST_WORKER)
    after = post(stack, seeded.key)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == " lorem ipsum dolor sit amet"

    def background_done() -> bool:
        return PromptRequest.objects.get(pk=queued.json()["id"]).status == S.SUCCEEDED

    wait_until(background_done, 20, "the background request")
    statuses = Counter(PromptRequest.objects.values_list("status", flat=True))
    assert statuses == {S.SUCCEEDED: 3}
    # The result is stored before its message is acked (the ack is the last step).
    wait_until(lambda: queued_messages(client) == 0, 10, "every message to be acked")


def test_queued_and_unacked_messages_survive_a_redis_restart_with_aof(seeded: Seeded, stack: Stack):
    # server_argv turns the AOF on; every write reaches the disk before it is answered.
    aof = ("--appendfsync", "always")
    first_server = stack.start_redis(*aof)
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    # The batch tier (600 s deadline): nothing expires while Redis is away.
    stack.start_api(seeded.other_key)
    pretend_live(client, "default")  # admission sees a worker; none consumes yet
    ids = []
    for i in range(5):
        response = post(
            stack, seeded.other_key, background=True, prompt=f"p{i}", max_tokens=MAX_TOKENS
        )
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    assert client.llen("default.batch") == 5

    doomed, _ = stack.start_worker(client, *SLOW_WORKER)

    def holding() -> bool:
        return PromptRequest.objects.filter(status=S.RUNNING).count() == 1

    wait_until(holding, 30, "the slow worker to claim a request")
    assert kill(doomed, signal.SIGKILL) == -signal.SIGKILL
    held = PromptRequest.objects.get(status=S.RUNNING)
    assert (str(held.id), held.attempts) == (ids[0], 1)  # the oldest message is fetched first
    assert unacked_task_ids(client) == [ids[0]]
    assert client.llen("default.batch") == 4

    # SIGTERM: the server finishes its AOF and exits; a new process loads it from the same dir.
    assert kill(first_server, signal.SIGTERM) == 0
    assert not redis_answers(stack.redis_url)
    second_server = stack.start_redis(*aof)
    assert second_server.pid != first_server.pid
    assert client.llen("default.batch") == 4
    assert unacked_task_ids(client) == [ids[0]]

    published: Counter[str] = Counter()
    stop = threading.Event()
    listener = threading.Thread(
        target=count_published_results, args=(client, published, stop), daemon=True
    )
    listener.start()
    _, rescuer = stack.start_worker(client, *FAST_WORKER)

    # The held message comes back once it is older than the visibility timeout (8 s in tests).
    settle(client, 5, 40, stop, listener)

    rows = {str(r.id): r for r in PromptRequest.objects.all()}
    assert sorted(rows) == sorted(ids)
    for request_id in ids:
        row = rows[request_id]
        assert (row.status, row.worker, row.completion_tokens) == (S.SUCCEEDED, rescuer, MAX_TOKENS)
        # The killed worker's claim counts as an attempt; the rest ran once.
        assert row.attempts == (2 if request_id == ids[0] else 1)
        assert published[f"{request_id}:SUCCESS"] == 1
    assert sum(published.values()) == 5
    assert client.hlen("unacked") == 0
    assert client.zcard("unacked_index") == 0


def test_broker_lost_while_a_call_waits_answers_503_naming_the_queued_request(
    seeded: Seeded, stack: Stack
):
    server = stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    stack.start_api(seeded.key)
    pretend_live(client, "default")
    answer: list[httpx.Response] = []
    # No consumer: the call waits on the result channel when the server dies under it.
    waiting = threading.Thread(target=lambda: answer.append(post(stack, seeded.key)))
    waiting.start()
    wait_until(lambda: client.llen("default.interactive") == 1, 10, "the published message")
    assert kill(server, signal.SIGKILL) == -signal.SIGKILL
    waiting.join(timeout=30)

    (lost,) = answer
    row = PromptRequest.objects.get()
    assert lost.status_code == 503, lost.text
    assert lost.headers["X-LLMQueue-Request-Id"] == str(row.id)
    assert lost.headers["Retry-After"] == "5"
    assert lost.json()["error"]["code"] == "unavailable"
    assert f"poll GET /v1/requests/{row.id}" in lost.json()["error"]["message"]
    assert (row.status, row.attempts) == (S.QUEUED, 0)  # published: it waits for a worker

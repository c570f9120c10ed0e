"""SIGKILL a worker holding requests: another worker redelivers them; each result is stored once."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter

import pytest
import redis

from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.models import PromptRequest
from llmqueue.queueing.routing import resolve_model
from llmqueue.queueing.submission import submit_prompt
from tests.conftest import SIMULATED, Seeded, WorkerFactory, settle, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status

# 4 sequences in the engine, 8 task slots: the worker holds 4 generating + 4 waiting requests.
SLOW_WORKER = (*SIMULATED[:-1], "4", "--slots", "8", "--sim-time-scale", "1")
# 120 decode steps of ≥7.4 ms: ~1 s, long enough to be killed mid-generation, and with the wait
# for an engine slot still well under the 8 s test visibility timeout (else a live worker's own
# messages would be redelivered too: the production timeout must exceed fetch-to-finish).
MAX_TOKENS = 120


def count_published_results(
    client: redis.Redis, counts: Counter[str], stop: threading.Event
) -> None:
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("celery-task-meta-*")
    while not stop.is_set():
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "pmessage":
            meta = json.loads(message["data"])
            counts[f"{meta['task_id']}:{meta['status']}"] += 1
    pubsub.close()


def test_sigkilled_worker_requests_complete_once_on_another_worker(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    published: Counter[str] = Counter()
    stop = threading.Event()
    listener = threading.Thread(
        target=count_published_results, args=(clean_redis, published, stop), daemon=True
    )
    listener.start()
    doomed = start_worker("default", *SLOW_WORKER)
    caller, route = caller_for_key(seeded.key), resolve_model("sim")
    params = {"max_tokens": MAX_TOKENS, "stop": []}
    ids = [
        str(
            submit_prompt(
                caller, route, PromptSpec("completion", "sim", f"p{i}", None, params, 1, True)
            ).id
        )
        for i in range(12)
    ]

    def holding() -> bool:
        return PromptRequest.objects.filter(status=S.RUNNING).count() == 8

    wait_until(holding, 30, "the first worker to claim 8 requests")
    assert clean_redis.hlen("unacked") == 8  # delivered, not acked: 4 generating, 4 waiting
    assert PromptRequest.objects.filter(status=S.SUCCEEDED).count() == 0
    held = set(PromptRequest.objects.filter(status=S.RUNNING).values_list("id", flat=True))
    assert doomed.stop(signal.SIGKILL) == -signal.SIGKILL

    rescuer = start_worker("default", *SLOW_WORKER)

    settle(clean_redis, 12, 90, stop, listener)

    rows = {str(r.id): r for r in PromptRequest.objects.all()}
    for request_id in ids:
        row = rows[request_id]
        assert row.worker == rescuer.node
        assert row.completion_tokens == MAX_TOKENS
        # The killed worker's claim counts as an attempt; the rest ran once.
        assert row.attempts == (2 if row.id in held else 1)
        assert published[f"{request_id}:SUCCESS"] == 1
    # Nothing else was published for these requests (no second SUCCESS, no FAILURE).
    assert sum(n for key, n in published.items() if key.split(":")[0] in ids) == 12

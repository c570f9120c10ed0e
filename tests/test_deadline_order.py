"""Earliest deadline first within a queue: insertion by deadline, admission counting only the
requests due first, the per-request deadline over HTTP, and a real worker taking them in order."""

from __future__ import annotations

import json
import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis
from django.test import override_settings

from contract.task import GENERATE_TASK
from llmqueue import lua
from llmqueue.admission import books, decision
from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.models import PromptRequest
from llmqueue.queueing.deadline_order import DEADLINE_HEADER, WALK_LIMIT
from llmqueue.queueing.publisher import TaskMessage, publish_tasks
from llmqueue.queueing.routing import resolve_model
from llmqueue.queueing.submission import submit_prompt
from tests.conftest import (
    SIMULATED,
    T0,
    Seeded,
    WorkerFactory,
    assert_nothing_enqueued,
    pretend_live,
    wait_until,
)
from tests.test_admission import QUEUE, limits
from tests.test_api import post

BASE = datetime(2031, 1, 1, tzinfo=UTC)


def publish(*offsets: float | None, queue: str = QUEUE, base: datetime = BASE) -> None:
    """One message per offset (seconds after `base`; None: no deadline), named by its offset."""
    publish_tasks(
        GENERATE_TASK,
        [
            TaskMessage(
                str(offset),
                queue,
                [[]],
                expires=None if offset is None else base + timedelta(seconds=offset),
                by_deadline=offset is not None,
            )
            for offset in offsets
        ],
    )


def popped(client: redis.Redis, queue: str = QUEUE) -> list[str]:
    """Task ids in the order a consumer (BRPOP from the tail) receives them."""
    raw = client.lrange(queue, 0, -1)
    client.delete(queue)
    return [json.loads(message)["headers"]["id"] for message in reversed(raw)]


def test_messages_leave_in_deadline_order(clean_redis: redis.Redis):
    publish(30, 30.5)
    publish(1)  # tighter than both: ahead of them
    publish(31, None)  # later than all: behind; no deadline: the very back
    publish(0.5, 30.25)
    assert popped(clean_redis) == ["0.5", "1", "30", "30.25", "30.5", "31", "None"]


def test_the_deadline_travels_in_the_message_header(clean_redis: redis.Redis):
    publish(2)
    raw = clean_redis.rpop(QUEUE)
    assert isinstance(raw, bytes)
    envelope = json.loads(raw)
    assert envelope["headers"][DEADLINE_HEADER] == (BASE + timedelta(seconds=2)).timestamp()


@override_settings(LLMQUEUE_EDF_WITHIN_TIER=False)
def test_without_deadline_order_the_queue_is_fifo(clean_redis: redis.Redis):
    publish(30, 1, 0.5)
    assert popped(clean_redis) == ["30", "1", "0.5"]


def test_a_place_near_either_end_is_exact_and_one_far_from_both_is_the_back(
    clean_redis: redis.Redis,
):
    n = 2 * WALK_LIMIT + 100
    publish(*range(n))
    publish(n - 1.5)  # a replica's publish race: one message is due later, found from the head
    publish(2.5)  # urgent: three are due first, found from the tail
    publish(WALK_LIMIT + 50.5)  # over the limit from both ends: the back, never ahead
    order = popped(clean_redis)
    assert order.index("2.5") == 3 and order.index(f"{n - 1.5}") == n  # 2.5 is ahead of it too
    assert order[-1] == f"{WALK_LIMIT + 50.5}" and len(order) == n + 3


def test_admission_counts_only_the_requests_due_before_a_tighter_deadline(live: redis.Redis):
    # 10 requests with the tier's 30 s deadline, drained at 4/s: 2.5 s of work ahead.
    publish(*[30 + i * 0.01 for i in range(10)], base=datetime.fromtimestamp(T0, tz=UTC))
    tau, span_taus = books.drain_tau_seconds(), 2.0
    pipe = live.pipeline(transaction=False)  # counted for 2 tau, so the rate at T0 is 4/s
    books.record_drain(pipe, QUEUE, 0, {}, now=T0 - span_taus * tau)
    books.record_drain(pipe, QUEUE, 4 * tau * (1 - math.exp(-span_taus)), {}, now=T0)
    lua.execute(pipe)
    own = limits(max_wait_seconds=1.0, own_deadline=True)
    # Due 1 s from now: every queued request is due later, so none goes first.
    assert decision.admit(own, 1, now=T0).admitted
    with override_settings(LLMQUEUE_EDF_WITHIN_TIER=False):  # FIFO: all 10 ahead, 2.5 s > 1 s
        fifo = decision.admit(own, 1, now=T0)
    assert (fifo.reason, fifo.ahead) == ("too_slow", 10)
    # Due 30.05 s from now: the 5 due by then go first, 1.25 s at 4/s; a 2 s deadline with the
    # same 5 ahead would be refused, as the 2.5 s deadline of the FIFO view was.
    assert decision.admit(limits(max_wait_seconds=30.045, own_deadline=True), 1, now=T0).admitted
    tight = decision.admit(limits(max_wait_seconds=1.2, own_deadline=True), 1, now=T0 + 29)
    assert (tight.reason, tight.ahead) == ("too_slow", 10)


with_db = pytest.mark.django_db(transaction=True)


@with_db
def test_per_request_deadline_over_http(live_server, seeded: Seeded, clean_redis: redis.Redis):
    pretend_live(clean_redis, "default")
    body = {"model": "sim", "prompt": "hi", "max_tokens": 2, "background": True}
    too_long = post(live_server, "/v1/completions", seeded.key, {**body, "deadline_seconds": 31})
    assert too_long.status_code == 422
    assert too_long.json()["error"]["param"] == "deadline_seconds"
    for bad in (0, -1, "soon", True):
        answer = post(live_server, "/v1/completions", seeded.key, {**body, "deadline_seconds": bad})
        assert answer.status_code in (400, 422), bad
    assert_nothing_enqueued(clean_redis)
    ok = post(live_server, "/v1/completions", seeded.key, {**body, "deadline_seconds": 2.5})
    by_header = post(
        live_server, "/v1/completions", seeded.key, body, **{"X-LLMQueue-Deadline-Seconds": "4"}
    )
    assert (ok.status_code, by_header.status_code) == (202, 202)
    windows = [
        (row.deadline_at - row.enqueued_at).total_seconds()
        for row in PromptRequest.objects.filter(id__in=[ok.json()["id"], by_header.json()["id"]])
    ]
    assert sorted(windows) == [2.5, 4.0]


@with_db
def test_a_worker_takes_a_tighter_deadline_before_earlier_requests(
    seeded: Seeded, start_worker: WorkerFactory
):
    caller, route = caller_for_key(seeded.key), resolve_model("sim")
    params = {"max_tokens": 2, "stop": []}

    def submit(prompt: str, deadline: float | None = None) -> uuid.UUID:
        spec = PromptSpec("completion", "sim", prompt, None, params, 1, True, deadline)
        return submit_prompt(caller, route, spec).id

    ids = [submit("a"), submit("b"), submit("c"), submit("urgent", 10.0), submit("d")]
    start_worker("default", *SIMULATED, "--slots", "1", "--sim-time-scale", "0")
    wait_until(
        lambda: PromptRequest.objects.filter(id__in=ids, status="succeeded").count() == 5, 30, "all"
    )
    order = list(PromptRequest.objects.order_by("started_at").values_list("prompt", flat=True))
    assert order == ["urgent", "a", "b", "c", "d"]

"""Poison requests: one that kills every worker it reaches is failed after
LLMQUEUE_MAX_WORKER_LOSSES of them, instead of being redelivered to the next one forever; a
deploy's hand-back counts as no loss."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from llmqueue import lifecycle
from llmqueue.api.errors import failure_error
from llmqueue.api.results import wait_for_outcome
from llmqueue.models import PromptRequest
from tests.conftest import SIMULATED, Seeded, Worker, WorkerFactory, wait_until
from tests.test_crash_recovery import PRODUCTION, listen, published_for
from tests.test_scheduling import submit

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
POISON = "POISON"
# The simulated engine dies (SIGKILL) a second into generating a prompt holding POISON; a 3 s
# stale window so each dead worker's messages are rescued by the next one within seconds.
FAULTY = (*SIMULATED, "--sim-time-scale", "1", "--sim-crash-on", POISON)
QUICK_RESCUE = {
    **PRODUCTION,
    "LLMQUEUE_WORKER_STALE_SECONDS": "3",
    "LLMQUEUE_WORKER_HEARTBEAT_SECONDS": "1",
}


def exited(worker: Worker) -> Callable[[], bool]:
    return lambda: not worker.child.running()


def row(request_id: uuid.UUID) -> PromptRequest:
    return PromptRequest.objects.get(id=request_id)


def test_a_request_that_kills_every_worker_it_reaches_is_failed_after_the_limit(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    limit = settings.LLMQUEUE_MAX_WORKER_LOSSES
    assert limit == 3  # the documented default
    published, stop, listener = listen(clean_redis)
    [poison] = submit(seeded.key, 1, 400, prompt=f"{POISON} pill")
    for lost in range(limit):
        worker = start_worker("default", *FAULTY, env=QUICK_RESCUE)
        wait_until(exited(worker), 40, f"worker {lost + 1} to die of it")
        assert worker.child.returncode == -signal.SIGKILL
        found = row(poison)
        # Each worker claimed it (taking it over from the one before, which it counts lost).
        assert (found.status, found.worker, found.attempts) == (S.RUNNING, worker.node, lost + 1)
        assert found.worker_losses == lost
    survivor = start_worker("default", *FAULTY, env=QUICK_RESCUE)
    wait_until(lambda: row(poison).status == S.FAILED, 40, "the poison request to be failed")
    found = row(poison)
    assert (found.attempts, found.worker_losses) == (limit, limit)
    assert found.error == lifecycle.POISON_ERROR.format(losses=limit)
    # The survivor's claim failed it before its engine saw it: the worker lives on and serves.
    healthy = submit(seeded.key, 2, 8)
    wait_until(
        lambda: PromptRequest.objects.filter(id__in=healthy, status=S.SUCCEEDED).count() == 2,
        30,
        "the survivor to serve the next requests",
    )
    assert survivor.child.running()
    wait_until(lambda: published_for(published, [poison, *healthy]) == 3, 10, "3 results")
    stop.set()
    listener.join(timeout=5)
    assert published[f"{poison}:FAILURE"] == 1
    # What a caller waiting on it is answered: 500 worker_lost_repeatedly.
    outcome = wait_for_outcome(str(poison), 5)
    assert outcome is not None
    error = failure_error(outcome.error_type, outcome.error_message, {})
    assert (error.status, error.code, str(error)) == (500, "worker_lost_repeatedly", found.error)


def test_a_deploys_hand_back_is_no_lost_worker(seeded: Seeded):
    [request_id] = submit(seeded.key, 1, 8)
    now = timezone.now()
    claimed = lifecycle.claim([request_id], "w1", now, max_losses=1)[request_id]
    assert claimed.attempt == 1
    # The worker stops (SIGTERM) and hands the request back: queued again, so the next claim,
    # even with a limit of one lost worker, takes it over as a fresh attempt.
    assert lifecycle.hand_back([(request_id, 2)]) == 0  # another attempt's hand-back: no change
    assert lifecycle.hand_back([(request_id, 1)]) == 1
    assert row(request_id).status == S.QUEUED
    again = lifecycle.claim([request_id], "w2", now, max_losses=1)[request_id]
    assert (again.attempt, again.ended) == (2, None)
    found = row(request_id)
    assert (found.status, found.worker, found.worker_losses) == (S.RUNNING, "w2", 0)
    # w2 dies holding it: the next claim counts the loss, and with a limit of one fails it.
    lost = lifecycle.claim([request_id], "w3", now, max_losses=1)[request_id]
    assert lost.attempt is None and lost.ended is not None and lost.ended.outcome == "failed"
    found = row(request_id)
    assert (found.status, found.worker, found.worker_losses) == (S.FAILED, "w2", 1)
    assert found.error == lifecycle.POISON_ERROR.format(losses=1)


def test_without_a_limit_a_lost_worker_is_counted_and_the_request_runs_again(seeded: Seeded):
    [request_id] = submit(seeded.key, 1, 8)
    now = timezone.now()
    for attempt in (1, 2, 3):
        claim = lifecycle.claim([request_id], f"w{attempt}", now, max_losses=0)[request_id]
        assert claim.attempt == attempt
    assert row(request_id).worker_losses == 2

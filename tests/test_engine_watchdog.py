"""The engine watchdog: an engine that stops stepping with requests in it is detected, the
worker hands every message it holds back and exits, and another worker runs them."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from celery_ext.broker import held_key
from llmqueue.models import PromptRequest
from tests.conftest import SIMULATED, Seeded, WorkerFactory, wait_until
from tests.test_crash_recovery import PRODUCTION, listen, published_for
from tests.test_scheduling import submit
from workers.watchdog import ENGINE_STALLED, StepWatch, Watchdog

S = PromptRequest.Status


def test_the_step_watch_counts_quiet_time_only_while_requests_are_in_the_engine():
    watch = StepWatch(stall_seconds=10)
    assert watch.stalled(steps=5, in_engine=3, now=100) is None  # first look
    assert watch.stalled(steps=5, in_engine=3, now=109) is None
    assert watch.stalled(steps=5, in_engine=3, now=110) == 10
    assert watch.stalled(steps=6, in_engine=3, now=111) is None  # a step: quiet again from now
    assert watch.stalled(steps=6, in_engine=0, now=200) is None  # idle: no steps expected
    assert watch.stalled(steps=6, in_engine=2, now=205) is None  # busy again from 200
    assert watch.stalled(steps=6, in_engine=2, now=210) == 10


def test_the_watchdog_hands_back_and_exits_once_stalled_even_if_the_hand_back_fails():
    stats = {"steps": 7, "in_engine": 2}
    clock = [0.0]
    exits: list[int] = []

    def hand_back() -> int:
        raise redis.ConnectionError("Redis is gone too")

    stopped: list[bool] = []
    dog = Watchdog(
        StepWatch(5),
        lambda: stats,
        lambda: stopped.append(True),
        hand_back,
        lambda: clock[0],
        exits.append,
        sleep=lambda _: None,
    )
    dog()
    clock[0] = 4.9
    dog()
    assert exits == []
    clock[0] = 5.0
    with pytest.raises(redis.ConnectionError):
        dog()
    assert stopped == [True]  # fetching stopped before the hand-back
    assert exits == [ENGINE_STALLED]  # whatever the hand-back did, the worker exits


@pytest.mark.django_db(transaction=True)
def test_a_hung_engines_worker_hands_its_requests_back_and_exits(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    env = {**PRODUCTION, "LLMQUEUE_ENGINE_STALL_SECONDS": "2"}
    published, stop, listener = listen(clean_redis)
    hung = start_worker(
        "default", *SIMULATED, "--sim-time-scale", "1", "--sim-hang-on", "HANG", env=env
    )
    ids = submit(seeded.key, 3, 400) + submit(seeded.key, 1, 400, prompt="HANG here")
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 4, 30, "claims")
    started = time.monotonic()
    wait_until(lambda: not hung.child.running(), 20, "the hung worker to exit")
    exited = time.monotonic() - started
    assert hung.child.returncode == ENGINE_STALLED
    # The stall window, a check interval (the beat's, 2 s), the wait for a fetch in flight.
    assert exited < 2 + settings.LLMQUEUE_WORKER_HEARTBEAT_SECONDS + 1.5 + 2, f"{exited:.1f} s"
    assert not clean_redis.exists(held_key(hung.node))  # its messages went back, at once
    healthy = start_worker("default", *SIMULATED, "--sim-time-scale", "0", env=env)
    wait_until(
        lambda: PromptRequest.objects.filter(id__in=ids[:3], status=S.SUCCEEDED).count() == 3,
        30,
        "the healthy worker to run the three others",
    )
    for row in PromptRequest.objects.filter(id__in=ids[:3]):
        # Taken over from the hung worker, which counts as lost.
        assert (row.worker, row.attempts, row.worker_losses) == (healthy.node, 2, 1)
    # The healthy worker has no such fault: the request that hung the first runs here too.
    wait_until(lambda: PromptRequest.objects.get(id=ids[3]).status == S.SUCCEEDED, 30, "the fourth")
    wait_until(lambda: published_for(published, ids) == 4, 10, "four results")
    stop.set()
    listener.join(timeout=5)
    assert all(published[f"{i}:SUCCESS"] == 1 for i in ids)

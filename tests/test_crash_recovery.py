"""Crash recovery by heartbeat, with the production visibility timeout: a SIGKILLed worker's
requests start on another worker within the stale window, each result stored once; a live
worker's long generation is never redelivered, whatever the visibility timeout."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable

import pytest
import redis
from django.conf import settings

from celery_ext.broker import held_key
from celery_ext.rescue import keep_visible
from contract import liveness
from llmqueue.models import PromptRequest
from project.celery import app
from tests.conftest import Seeded, WorkerFactory, settle, wait_until
from tests.reliability_record import record
from tests.test_redelivery import MAX_TOKENS, SLOW_WORKER, count_published_results
from tests.test_scheduling import submit

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
PRODUCTION = {
    "LLMQUEUE_VISIBILITY_TIMEOUT_SECONDS": "3600",
    "LLMQUEUE_UNACKED_RESTORE_INTERVAL_SECONDS": "60",
}


def listen(client: redis.Redis) -> tuple[Counter[str], threading.Event, threading.Thread]:
    published: Counter[str] = Counter()
    stop = threading.Event()
    listener = threading.Thread(
        target=count_published_results, args=(client, published, stop), daemon=True
    )
    listener.start()
    return published, stop, listener


def published_for(published: Counter[str], ids: Iterable[uuid.UUID]) -> int:
    """Results published for `ids` (pub/sub spans Redis' databases: other processes' show up)."""
    mine = {str(i) for i in ids}
    return sum(n for key, n in published.items() if key.split(":")[0] in mine)


def record_outcome(
    scenario: str, ids: list[uuid.UUID], published: Counter[str], recovery_s: float
) -> None:
    """The report's figures (bench/reliability.py): what was accepted, ended, lost, run twice."""
    rows = PromptRequest.objects.filter(id__in=ids)
    record(
        scenario,
        accepted=len(ids),
        completed=rows.filter(status=S.SUCCEEDED).count(),
        lost=rows.exclude(status__in=[S.SUCCEEDED, S.FAILED, S.EXPIRED]).count(),
        duplicated=sum(max(0, published[f"{i}:SUCCESS"] - 1) for i in ids),
        recovery_s=round(recovery_s, 2),
    )


def test_a_killed_workers_requests_restart_elsewhere_within_the_stale_window(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    published, stop, listener = listen(clean_redis)
    # ~10 s generations on the doomed worker: none of its 8 ends while the survivor starts up
    # (a few seconds on a busy machine); ~1 s ones on the survivor.
    doomed = start_worker("default", *SLOW_WORKER[:-1], "10", env=PRODUCTION)
    ids = submit(seeded.key, 12, MAX_TOKENS)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 8, 30, "8 held")
    held = set(PromptRequest.objects.filter(status=S.RUNNING).values_list("id", flat=True))
    assert clean_redis.scard(held_key(doomed.node)) == 8  # its held set: what it fetched
    survivor = start_worker("default", *SLOW_WORKER, env=PRODUCTION)
    # As if it died inside kombu's restore_visible: the mutex it held lasts 300 s. The rescue
    # takes no such lock, so it must not wait for it.
    clean_redis.set("unacked_mutex", "the-dead-workers-token", ex=300)
    killed_at = time.time()
    assert doomed.stop(signal.SIGKILL) == -signal.SIGKILL

    def all_taken_over() -> bool:
        rows = PromptRequest.objects.filter(id__in=held)
        return all(r.attempts == 2 for r in rows)

    wait_until(all_taken_over, 30, "the survivor to claim the dead worker's requests")
    last_claim = max(r.started_at for r in PromptRequest.objects.filter(id__in=held))
    recovery = last_claim.timestamp() - killed_at
    stale = settings.LLMQUEUE_WORKER_STALE_SECONDS
    # Stale window + a rescue interval + the survivor's free slots (4 sequences, ~1 s each).
    assert recovery < stale + 6, f"recovered after {recovery:.1f} s"
    settle(clean_redis, 12, 60, stop, listener)
    for row in PromptRequest.objects.filter(id__in=ids):
        assert (row.worker, row.status) == (survivor.node, S.SUCCEEDED)
        assert row.attempts == (2 if row.id in held else 1)
        assert row.worker_losses == (1 if row.id in held else 0)  # the killed worker, once
        assert published[f"{row.id}:SUCCESS"] == 1
    assert published_for(published, ids) == 12  # nothing published twice, nothing failed
    assert not clean_redis.exists(held_key(doomed.node))
    assert doomed.node not in liveness.live_workers(clean_redis, "default", 3600)
    record_outcome("sigkill", ids, published, recovery)


def test_a_live_workers_long_generation_is_never_redelivered_whatever_the_visibility_timeout(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # A 2 s visibility timeout, restores tried every second, two workers: ~8 s generations
    # outlive it four times over, and a redelivered message would be claimed by the other one.
    short = {
        "LLMQUEUE_VISIBILITY_TIMEOUT_SECONDS": "2",
        "LLMQUEUE_UNACKED_RESTORE_INTERVAL_SECONDS": "1",
    }
    published, stop, listener = listen(clean_redis)
    slow = ("--engine", "simulated", "--model", "sim", "--max-num-seqs", "4", "--slots", "4")
    first = start_worker("default", *slow, "--sim-time-scale", "2", env=short)
    ids = submit(seeded.key, 2, 500)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 2, 10, "claims")
    start_worker("default", *slow, "--sim-time-scale", "2", env=short)
    settle(clean_redis, 2, 60, stop, listener)
    rows = list(PromptRequest.objects.filter(id__in=ids))
    assert [(r.attempts, r.worker) for r in rows] == [(1, first.node)] * 2
    assert published_for(published, ids) == 2


def test_a_worker_stopped_for_a_deploy_hands_its_requests_over_at_once(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # 2 s of grace for ~8 s generations: the 8 requests it holds (4 generating, 4 waiting in
    # its engine) go back to the queue's head at the end of the grace, not after the hour.
    deploy = {**PRODUCTION, "LLMQUEUE_SHUTDOWN_GRACE_SECONDS": "2"}
    published, stop, listener = listen(clean_redis)
    # ~8 s generations on the leaving worker: none ends within the successor's start (several
    # seconds on a busy machine) and the grace, as ~4 s ones did there.
    leaving = start_worker("default", *SLOW_WORKER[:-1], "2", env=deploy)
    ids = submit(seeded.key, 12, 500)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 8, 30, "8 held")
    held = set(PromptRequest.objects.filter(status=S.RUNNING).values_list("id", flat=True))
    successor = start_worker("default", *SLOW_WORKER, env=deploy)
    stopped_at = time.time()
    assert leaving.stop(signal.SIGTERM, timeout=60) == 0  # a clean exit, not a kill
    exited = time.time() - stopped_at
    assert exited < 2 + 3, f"exited after {exited:.1f} s"
    settle(clean_redis, 12, 60, stop, listener)
    rows = list(PromptRequest.objects.filter(id__in=ids))
    assert {r.status for r in rows} == {S.SUCCEEDED}
    for row in rows:  # all ran to the end on the successor, the handed-back ones as attempt 2
        assert (row.worker, row.attempts) == (successor.node, 2 if row.id in held else 1)
        assert row.worker_losses == 0  # handed back as queued: a deploy loses no worker
        assert row.completion_tokens == 500
        assert published[f"{row.id}:SUCCESS"] == 1
    assert published_for(published, ids) == 12  # nothing recorded for the handed-back attempts
    assert not clean_redis.exists(held_key(leaving.node))
    taken_over = max(r.started_at for r in rows if r.id in held).timestamp() - stopped_at
    record_outcome("sigterm", ids, published, taken_over)


def test_a_deploy_lets_short_generations_finish_on_the_leaving_worker(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # ~1 s generations, the default 25 s grace: everything in the engine finishes where it is.
    published, stop, listener = listen(clean_redis)
    leaving = start_worker("default", *SLOW_WORKER, env=PRODUCTION)
    ids = submit(seeded.key, 4, MAX_TOKENS)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 4, 30, "4 held")
    assert leaving.stop(signal.SIGTERM, timeout=60) == 0
    settle(clean_redis, 4, 30, stop, listener)
    rows = list(PromptRequest.objects.filter(id__in=ids))
    assert [(r.worker, r.attempts, r.status) for r in rows] == [(leaving.node, 1, S.SUCCEEDED)] * 4
    assert published_for(published, ids) == 4


def test_a_worker_restarted_under_the_same_name_requeues_what_its_predecessor_held(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # A supervisor restarts a killed worker at once under its default name (pool@host): the
    # name beats again before it is ever stale, so no other worker rescues the dead process's
    # messages, and the new one's keep_visible would keep them unacked for good.
    published, stop, listener = listen(clean_redis)
    node = f"default@restarted-{uuid.uuid4().hex[:6]}"
    first = start_worker("default", *SLOW_WORKER[:-1], "10", node=node, env=PRODUCTION)
    ids = submit(seeded.key, 4, MAX_TOKENS)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 4, 30, "4 held")
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    restarted = start_worker("default", *SLOW_WORKER, node=node, env=PRODUCTION)
    settle(clean_redis, 4, 30, stop, listener)
    for row in PromptRequest.objects.filter(id__in=ids):
        assert (row.worker, row.attempts, row.worker_losses) == (restarted.node, 2, 1)
        assert published[f"{row.id}:SUCCESS"] == 1
    assert published_for(published, ids) == 4


def test_a_worker_keeps_visible_only_the_messages_it_still_holds(clean_redis: redis.Redis):
    # Its held set names a message whose ack a Redis failover lost (still in `unacked` on the
    # new master): re-dated with every beat it would stay unacked as long as the worker lives;
    # left to age, kombu restores it after the visibility timeout and the claim drops it.
    with app.connection_for_write() as connection:
        qos = connection.default_channel.qos
        node = "default-unit@localhost"
        clean_redis.sadd(held_key(node), "running", "ack-lost", "acked")
        clean_redis.hset(qos.unacked_key, mapping={"running": "m", "ack-lost": "m"})
        clean_redis.zadd(qos.unacked_index_key, {"running": 1.0, "ack-lost": 1.0})
        assert keep_visible(clean_redis, node, qos, ["running"], now=100.0) == 1
        assert clean_redis.zscore(qos.unacked_index_key, "running") == 100.0
        assert clean_redis.zscore(qos.unacked_index_key, "ack-lost") == 1.0
        # A tag acked without leaving the set (a crash between the two) leaves it.
        assert clean_redis.smembers(held_key(node)) == {b"running", b"ack-lost"}

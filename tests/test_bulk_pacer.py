"""The bulk pacer: a job larger than its tenant's tokens per minute and its tier's queue depth is
paced, never refused, and leaves the tier's API callers room; two tenants backlogged on one tier
get tokens within a few largest requests of each other; one replica releases at a time; a
cancelled batch's running lines are aborted in the engine."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from django.db.models import Count
from django.test import Client
from django.utils import timezone

from contract.keys import waiting_key
from llmqueue.bulk.finalize import advance_jobs
from llmqueue.bulk.pacer import LEASE_KEY, Pacer, requests_waiting
from llmqueue.models import BulkJob, PromptRequest, Tenant, Tier
from tests.conftest import SIMULATED, Seeded, WorkerFactory, queued_messages, wait_until
from tests.test_api import post
from tests.test_batches import auth, line, submit
from tests.test_cancel import SLOW, in_engine

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
QUEUE = "default.batch"


def test_a_job_beyond_the_tenants_tpm_and_the_tiers_depth_is_paced_and_completes(
    live_server,
    seeded: Seeded,
    bulk_tier: Tier,
    clean_redis: redis.Redis,
    start_worker: WorkerFactory,
    pacer_thread: None,
):
    bulk_tier.max_queue_depth = 10  # the pacer fills at most 5: half stays for API callers
    bulk_tier.save()
    Tenant.objects.filter(pk=seeded.tenant_id).update(tokens_per_minute=600)
    start_worker("default", *SIMULATED)
    tenants = list(Tenant.objects.values_list("id", flat=True))
    depths: list[int] = []  # the job's lines released and not yet claimed
    totals: list[int] = []  # every request of the queue waiting: the API caller's too
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            depths.append(requests_waiting(QUEUE, [seeded.tenant_id]))
            totals.append(requests_waiting(QUEUE, tenants))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # 70 lines of 11 tokens (3 prompt + 8 max_tokens): 770 tokens, above 600 a minute.
    batch = submit(Client(), seeded.key, [line(f"r{i}") for i in range(70)])
    assert batch["status"] == "in_progress"
    # While the job runs, an API caller of the same tier is admitted: the depth left room.
    time.sleep(1)
    flex = {"model": "sim", "prompt": "x", "max_tokens": 2, "service_tier": "flex",
            "background": True}  # fmt: skip
    assert post(live_server, "/v1/completions", seeded.other_key, flex).status_code == 202
    job = BulkJob.objects.get(pk=batch["id"])
    wait_until(
        lambda: BulkJob.objects.get(pk=job.pk).status == BulkJob.Status.COMPLETED, 60, "job end"
    )
    stop.set()
    watcher.join(timeout=5)
    lines = PromptRequest.objects.filter(job=job)
    assert lines.filter(status=S.SUCCEEDED).count() == 70
    # The pacer's half of the depth. The API caller's request may come on top of a full half
    # (admitted after the pacer filled it): the tier's depth still bounds the two together.
    assert 0 < max(depths) <= 5
    assert max(totals) <= 10
    released = sorted(lines.values_list("enqueued_at", flat=True))
    # 600 tokens went at once (54 lines); the other 170 waited for the bucket's 10 tokens/s.
    assert (released[-1] - released[0]).total_seconds() >= 12
    assert queued_messages(clean_redis) == 0


def drain(client: redis.Redis) -> None:
    """As if the engine had claimed every released line: the queue and its waiting counts empty."""
    tenants = Tenant.objects.values_list("id", flat=True)
    client.delete(QUEUE, *(waiting_key(QUEUE, tenant) for tenant in tenants))


def released_tokens(tenants: list[int]) -> dict[int, int]:
    rows = PromptRequest.objects.filter(status=S.QUEUED).values_list("tenant_id", "reserved_tokens")
    totals = dict.fromkeys(tenants, 0)
    for tenant, tokens in rows:
        totals[tenant] += tokens
    return totals


def test_two_tenants_backlogged_on_a_tier_get_tokens_within_a_few_largest_requests(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    bulk_tier.max_queue_depth = 20  # 10 lines a tick
    bulk_tier.save()
    client = Client()
    # acme: 300 small lines (11 tokens); globex: 40 large ones (203 tokens), started later.
    submit(client, seeded.key, [line(f"s{i}") for i in range(300)])
    globex = Tenant.objects.get(name="globex").pk
    submit(client, seeded.other_key, [line(f"b{i}", max_tokens=200) for i in range(40)])
    largest = 203
    pacer = Pacer()
    served = {seeded.tenant_id: 0, globex: 0}
    gaps = []

    def backlogged(tenant: int) -> bool:
        return PromptRequest.objects.filter(status=S.HELD, tenant_id=tenant).exists()

    while backlogged(globex) and backlogged(seeded.tenant_id):
        assert pacer.release_once() == 10
        for tenant, tokens in released_tokens(list(served)).items():
            served[tenant] += tokens
        if backlogged(globex) and backlogged(seeded.tenant_id):  # the bound's premise
            gaps.append(abs(served[seeded.tenant_id] - served[globex]))
        # The engine took them: the queue is empty for the next tick.
        PromptRequest.objects.filter(status=S.QUEUED).update(
            status=S.SUCCEEDED, finished_at=timezone.now()
        )
        drain(clean_redis)
    assert len(gaps) > 10
    assert max(gaps) <= 2 * largest, (gaps, served)
    # Not round robin by request: acme got many more lines for the same tokens.
    lines = PromptRequest.objects.filter(status=S.SUCCEEDED)
    assert (
        lines.filter(tenant_id=seeded.tenant_id).count()
        > 5 * lines.filter(tenant_id=globex).count()
    )


def test_weights_divide_a_tiers_tokens_in_proportion(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    bulk_tier.max_queue_depth = 20
    bulk_tier.save()
    globex = Tenant.objects.get(name="globex")
    globex.weight = 3
    globex.save()
    client = Client()
    submit(client, seeded.key, [line(f"a{i}") for i in range(200)])
    submit(client, seeded.other_key, [line(f"b{i}") for i in range(200)])
    pacer = Pacer()
    for _ in range(8):
        pacer.release_once()
        drain(clean_redis)
    counts = dict(
        PromptRequest.objects.filter(status=S.QUEUED)
        .values_list("tenant_id")
        .annotate(n=Count("id"))
    )
    assert (counts[seeded.tenant_id], counts[globex.pk]) == (20, 60)


def test_only_the_lease_holder_releases(seeded: Seeded, bulk_tier: Tier, clean_redis):
    submit(Client(), seeded.key, [line("a")])
    first, second = Pacer(), Pacer()
    assert first.hold_lease() and not second.hold_lease()
    assert clean_redis.get(LEASE_KEY) == first.token.encode()
    clean_redis.delete(LEASE_KEY)  # the holder died and its lease lapsed
    assert second.hold_lease() and not first.hold_lease()


def test_cancelling_a_batch_aborts_its_running_lines_in_the_engine(
    live_server,
    seeded: Seeded,
    bulk_tier: Tier,
    clean_redis: redis.Redis,
    start_worker: WorkerFactory,
    pacer_thread: None,
):
    worker = start_worker("default", *SIMULATED, *SLOW)
    client = Client()
    batch = submit(client, seeded.key, [line(f"r{i}", max_tokens=500) for i in range(3)])
    running = PromptRequest.objects.filter(status=S.RUNNING)
    wait_until(lambda: running.count() == 3, 10, "the lines to run")
    wait_until(lambda: in_engine(clean_redis, worker) == 3, 10, "the engine to hold them")
    cancelled_at = time.monotonic()
    answer: Any = client.post(f"/v1/batches/{batch['id']}/cancel", **auth(seeded.key)).json()
    # Cancelling until no line runs; the pacer thread may already have finished it.
    assert answer["status"] in ("cancelling", "cancelled") and answer["cancelling_at"]
    wait_until(lambda: in_engine(clean_redis, worker) == 0, 5, "the engine to drop them")
    assert time.monotonic() - cancelled_at < 5
    advance_jobs()
    done = client.get(f"/v1/batches/{batch['id']}", **auth(seeded.key)).json()
    assert done["status"] == "cancelled"
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "the messages to be acked")
    rows = PromptRequest.objects.values_list("status", "output_text")
    assert list(rows) == [(S.CANCELLED, "")] * 3


def test_ended_lines_are_charged_what_they_used_not_what_they_reserved(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    submit(Client(), seeded.key, [line(f"a{i}", max_tokens=100) for i in range(4)])
    pacer = Pacer()
    assert pacer.release_once() == 4
    counter = pacer.counters[bulk_tier.pk]
    reserved = sum(PromptRequest.objects.values_list("reserved_tokens", flat=True))
    assert counter.counters[seeded.tenant_id] == reserved  # prompt + max_tokens, at release
    assert pacer.correct_ended() == 0  # none ended yet
    PromptRequest.objects.update(
        status=S.SUCCEEDED, prompt_tokens=3, completion_tokens=10, finished_at=timezone.now()
    )
    assert pacer.correct_ended() == 4
    assert counter.counters[seeded.tenant_id] == 4 * 13 and pacer.in_flight == {}

"""The admission decision against a real Redis: exact quota math on a controlled clock, refunds,
backpressure from depth and drain rate, usage counters, and no over-admission under concurrency."""

from __future__ import annotations

import math
import multiprocessing
import time
import uuid
from datetime import UTC, datetime

import pytest
import redis

from llmqueue import accounting, admission, liveness, lua, usage
from llmqueue.admission import Decision, Limits
from llmqueue.auth import Caller
from llmqueue.lifecycle import Ended
from llmqueue.models import TenantUsage
from llmqueue.routing import ModelRoute
from tests.conftest import T0, Seeded

QUEUE = "default.interactive"


def limits(**changes: float) -> Limits:
    base = {
        "tenant_id": 1,
        "tier_id": 1,
        "queue": QUEUE,
        "pool": "default",
        "requests_per_second": 2.0,
        "burst": 3,
        "tokens_per_minute": 600,
        "max_queue_depth": 100,
        "max_tier_share": 1.0,
        "max_wait_seconds": 30.0,
    }
    return Limits(**{**base, **changes})  # type: ignore[arg-type]


def admit(lim: Limits, tokens: int, at: float) -> Decision:
    return admission.admit(lim, tokens, now=T0 + at)


def reasons(decisions: list[Decision]) -> list[str]:
    return [d.reason for d in decisions]


def test_request_rate_allows_the_burst_then_refills_at_the_rate(live):
    lim = limits()
    assert reasons([admit(lim, 1, 0.0) for _ in range(3)]) == ["", "", ""]
    refused = admit(lim, 1, 0.0)
    assert (refused.reason, refused.retry_after_seconds) == ("rate", pytest.approx(0.5))
    assert admit(lim, 1, 0.25).retry_after_seconds == pytest.approx(0.25)
    assert admit(lim, 1, 0.5).admitted  # one request's worth came back after 1/rps
    assert not admit(lim, 1, 0.5).admitted
    assert reasons([admit(lim, 1, 10.0) for _ in range(4)]) == ["", "", "", "rate"]  # capped


def test_tokens_per_minute_hold_the_reservation_until_refunded(live):
    lim = limits(tokens_per_minute=600, burst=100)  # 10 tokens per second
    assert admit(lim, 400, 0.0).admitted
    refused = admit(lim, 400, 0.0)
    assert (refused.reason, refused.retry_after_seconds) == ("tokens", pytest.approx(20.0))
    assert admit(lim, 200, 0.0).admitted  # exactly what is left
    assert admit(lim, 1, 0.0).reason == "tokens"
    # The first request used 150 of its 400 tokens: 250 come back at once.
    pipe = live.pipeline(transaction=False)
    ended = Ended(uuid.UUID(int=1), 1, 1, QUEUE, "succeeded", 400, 50, 100)
    accounting.settle(pipe, [ended], now=T0)
    lua.execute(pipe)
    assert accounting.unused_tokens(ended) == 250
    assert admit(lim, 250, 0.0).admitted
    assert admit(lim, 1, 0.0).reason == "tokens"
    assert admit(lim, 10, 1.0).admitted  # and the bucket refills at tpm / 60 per second


def test_rejections_take_nothing_from_the_buckets(live):
    lim = limits(burst=1, max_queue_depth=1)
    live.lpush(QUEUE, "a message ahead")
    assert admit(lim, 1, 0.0).reason == "queue_full"
    live.delete(QUEUE)
    assert admit(lim, 1, 0.0).admitted  # the refused request spent neither token nor request


def test_no_live_worker_is_refused_before_anything_else(clean_redis):
    liveness.beat(clean_redis, "default", "old", now=T0 - 3600)  # stale long ago
    decision = admit(limits(), 1, 0.0)
    assert (decision.reason, decision.retry_after_seconds) == ("no_worker", None)


def test_full_queue_retry_after_follows_the_measured_drain_rate(live):
    lim = limits(max_queue_depth=10)
    live.lpush(QUEUE, *[f"m{i}" for i in range(12)])
    assert admit(lim, 1, 0.0).retry_after_seconds is None  # no drain rate measured yet
    tau = admission.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 4 * tau, {}, now=T0)  # 4 requests/s
    lua.execute(pipe)
    decision = admit(lim, 1, 0.0)
    assert decision.reason == "queue_full"
    assert decision.drain_rate_per_second == pytest.approx(4.0, rel=1e-3)
    # 12 waiting, room for 10: three must leave first, at 4 per second.
    assert decision.retry_after_seconds == pytest.approx(0.75, rel=1e-3)


def test_a_wait_longer_than_the_deadline_is_refused_up_front(live):
    lim = limits(max_wait_seconds=2.0)
    live.lpush(QUEUE, *[f"m{i}" for i in range(10)])
    tau = admission.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 4 * tau, {}, now=T0)
    lua.execute(pipe)
    decision = admit(lim, 1, 0.0)  # 10 ahead at 4/s: 2.5 s > 2 s
    assert (decision.reason, decision.ahead) == ("too_slow", 10)
    assert decision.retry_after_seconds == pytest.approx(0.5, rel=1e-3)
    live.rpop(QUEUE, 3)  # 7 ahead: 1.75 s
    assert admit(lim, 1, 0.0).admitted


def test_a_tier_with_a_first_token_target_sheds_at_the_target_not_at_the_deadline(live):
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0)
    live.lpush(QUEUE, *[f"m{i}" for i in range(6)])
    tau = admission.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 4 * tau, {}, now=T0)
    lua.execute(pipe)
    decision = admit(lim, 1, 0.0)  # 6 ahead at 4/s: 1.5 s, past the 1 s target (deadline 30 s)
    assert (decision.reason, decision.ahead) == ("too_slow", 6)
    assert decision.retry_after_seconds == pytest.approx(0.5, rel=1e-3)
    assert admit(limits(max_wait_seconds=30.0), 1, 0.0).admitted  # no target: the deadline
    live.rpop(QUEUE, 3)  # 3 ahead: 0.75 s
    assert admit(lim, 1, 0.0).admitted
    # A target at or past the deadline changes nothing.
    assert limits(max_wait_seconds=2.0, first_token_target_seconds=5.0).acceptable_wait_seconds == 2


def test_a_fraction_of_the_target_sheds_before_the_mean_wait_reaches_it(live):
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0, target_fraction=0.75)
    assert lim.acceptable_wait_seconds == 0.75
    live.lpush(QUEUE, *[f"m{i}" for i in range(4)])
    tau = admission.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 4 * tau, {}, now=T0)
    lua.execute(pipe)
    decision = admit(lim, 1, 0.0)  # 4 ahead at 4/s: 1 s, past 0.75 of the 1 s target
    assert (decision.reason, decision.ahead) == ("too_slow", 4)
    assert decision.retry_after_seconds == pytest.approx(0.25, rel=1e-3)
    live.rpop(QUEUE, 1)  # 3 ahead: 0.75 s
    assert admit(lim, 1, 0.0).admitted
    assert live.llen(QUEUE) == 3  # admit decides; only the submission enqueues


def test_limits_take_the_shedding_fraction_from_the_settings(settings):
    settings.LLMQUEUE_SHED_AT_SLO_FRACTION = 0.5
    caller = Caller(
        key_id=1, tenant_id=1, tenant_name="t", tenant_active=True, key_revoked=False,
        max_tokens_per_request=100, requests_per_second=1.0, burst=1, tokens_per_minute=1000,
        max_tier_share=1.0, tier_id=1, tier_name="interactive", tier_priority=0,
        max_wait_seconds=30, first_token_target_seconds=2.0, default_max_tokens=16,
        max_queue_depth=10,
    )  # fmt: skip
    lim = admission.limits_for(caller, ModelRoute("m", "default", 2048, 512))
    assert (lim.first_token_target_seconds, lim.acceptable_wait_seconds) == (2.0, 1.0)


def test_judged_against_the_target_the_wait_includes_the_engines_measured_lead(live):
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0)
    tau = admission.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 4 * tau, {}, now=T0)  # 4 requests/s
    admission.record_leads(pipe, QUEUE, 1.0, 2, now=T0 - 5)  # two took 0.5 s to a first token
    admission.record_leads(pipe, QUEUE, 0.8, 1, now=T0)  # the latest 0.8 s: mean ~0.6 s
    lua.execute(pipe)
    assert admit(lim, 1, 0.0).admitted  # an empty queue is never too slow, whatever the lead
    live.lpush(QUEUE, "m1", "m2")
    decision = admit(lim, 1, 0.0)  # 2 ahead at 4/s = 0.5 s, + ~0.6 s in the engine > 1 s
    assert (decision.reason, decision.ahead) == ("too_slow", 2)
    sum_, n = (float(x) for x in live.hmget(admission.drain_key(QUEUE), "lead_sum", "lead_n"))
    decay = math.exp(-5 / tau)
    assert (sum_, n) == (pytest.approx(1.0 * decay + 0.8), pytest.approx(2 * decay + 1))
    assert decision.retry_after_seconds == pytest.approx(0.5 + sum_ / n - 1.0, rel=1e-3)
    assert admit(limits(max_wait_seconds=1.0), 1, 0.0).admitted  # a deadline: queue wait only


def test_a_tenant_fills_only_its_share_of_the_queue(live):
    lim = limits(max_queue_depth=10, max_tier_share=0.2, burst=100)
    assert reasons([admit(lim, 1, 0.0) for _ in range(3)]) == ["", "", "tenant_share"]
    pipe = live.pipeline(transaction=False)
    admission.record_drain(pipe, QUEUE, 1, {1: 1}, now=T0)  # a worker claimed one of them
    lua.execute(pipe)
    assert admit(lim, 1, 0.0).admitted


def test_usage_counts_every_decision_and_outcome_then_lands_in_the_db(
    seeded: Seeded, live: redis.Redis
):
    tenant_id, tier_id = seeded.tenant_id, seeded.tier_id
    lim = limits(tenant_id=tenant_id, tier_id=tier_id, burst=2)
    now = time.time()
    for _ in range(3):
        admission.admit(lim, 5, now=now)
    pipe = live.pipeline(transaction=False)
    accounting.settle(
        pipe,
        [
            Ended(uuid.UUID(int=1), tenant_id, tier_id, QUEUE, "succeeded", 5, 2, 3),
            Ended(uuid.UUID(int=2), tenant_id, tier_id, QUEUE, "expired", 5),
        ],
    )
    lua.execute(pipe)
    assert usage.flush(live) == 1
    assert usage.flush(live) == 0  # the counters moved: nothing is counted twice
    row = TenantUsage.objects.get()
    hour = datetime.fromtimestamp(usage.hour_of(now), tz=UTC)
    assert (row.tenant_id, row.tier_id, row.hour) == (tenant_id, tier_id, hour)
    assert (row.admitted, row.rejected_rate, row.succeeded, row.expired) == (2, 1, 1, 1)
    assert (row.prompt_tokens, row.completion_tokens, row.failed) == (2, 3, 0)


def _hammer(lim: Limits, seconds: float, results: multiprocessing.Queue[tuple[int, int]]) -> None:
    admitted = refused = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        if admission.admit(lim, 1).admitted:
            admitted += 1
        else:
            refused += 1
    results.put((admitted, refused))


def test_concurrent_admission_from_processes_never_over_admits(live):
    # Redis' own clock decides (now=None), as in production: 4 processes hammer one tenant.
    liveness.beat(live, "default", "w1", now=time.time() + 3600)
    lim = limits(requests_per_second=20.0, burst=10, tokens_per_minute=10**9)
    context = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[tuple[int, int]] = context.Queue()
    started = time.time()
    processes = [context.Process(target=_hammer, args=(lim, 2.0, results)) for _ in range(4)]
    for p in processes:
        p.start()
    counts = [results.get(timeout=30) for _ in processes]
    for p in processes:
        p.join(timeout=10)
    elapsed = time.time() - started
    admitted = sum(a for a, _ in counts)
    refused = sum(r for _, r in counts)
    allowed = lim.burst + lim.requests_per_second * elapsed
    assert refused > admitted  # they really raced for it
    assert admitted <= allowed
    assert admitted >= lim.burst + lim.requests_per_second * 1.5  # and it did let the rate through


def test_a_script_the_server_does_not_know_is_loaded_and_run_once(clean_redis):
    import uuid

    from redis.commands.core import Script

    marker = uuid.uuid4().hex  # a source never loaded before: the server answers NOSCRIPT
    script = Script(clean_redis, f"-- {marker}\nreturn redis.call('INCR', KEYS[1])")
    pipe = clean_redis.pipeline(transaction=False)
    pipe.set("lua:before", 1)
    lua.call(pipe, script, ["lua:n"], [])
    pipe.incr("lua:after")
    assert lua.execute(pipe) == [True, 1, 1]
    assert clean_redis.get("lua:n") == b"1"  # once, not once per try
    assert clean_redis.get("lua:after") == b"1"
    assert clean_redis.script_exists(script.sha) == [True]

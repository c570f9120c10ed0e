"""The admission decision against a real Redis: exact quota math on a controlled clock, refunds,
backpressure from depth and drain rate, usage counters, and no over-admission under concurrency."""

from __future__ import annotations

import math
import multiprocessing
import time
import uuid
from datetime import UTC, datetime
from statistics import NormalDist

import pytest
import redis

from contract import liveness
from llmqueue import accounting, lua, usage
from llmqueue.admission import books, decision
from llmqueue.admission.decision import Decision, Limits
from llmqueue.admission.request import limits_for
from llmqueue.api.auth import Caller
from llmqueue.lifecycle import Ended
from llmqueue.models import TenantUsage
from llmqueue.queueing import publishing
from llmqueue.queueing.routing import ModelRoute
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
    return decision.admit(lim, tokens, now=T0 + at)


def reasons(decisions: list[Decision]) -> list[str]:
    return [d.reason for d in decisions]


def drain_at(live: redis.Redis, per_second: float, span_taus: float = 2.0) -> None:
    """Record claims so that the queue's drain rate at T0 is exactly `per_second`: counting
    started `span_taus` time constants ago, and what was claimed since then comes in at T0."""
    tau = books.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    books.record_drain(pipe, QUEUE, 0, {}, now=T0 - span_taus * tau)
    claimed = per_second * tau * (1 - math.exp(-span_taus))
    books.record_drain(pipe, QUEUE, claimed, {}, now=T0)
    lua.execute(pipe)


def wait_quantile(due: int, rate: float, lead: float, lead_var: float, q: float) -> float:
    """The wait's q-quantile as admission models it: Gamma(due + 1, rate) + the lead, as the
    Gamma of the same mean and variance, by Wilson-Hilferty."""
    mean = (due + 1) / rate + lead
    var = (due + 1) / rate**2 + lead_var
    shape = mean**2 / var
    z = NormalDist().inv_cdf(q)
    return float(mean * (1 - 1 / (9 * shape) + z / (3 * math.sqrt(shape))) ** 3)


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


def _dump(client: redis.Redis) -> dict[bytes, object]:
    """Every key's value (hashes as dicts), to compare two ways of reaching a state."""
    dump: dict[bytes, object] = {}
    for key in client.scan_iter():
        kind = client.type(key)
        if kind == b"hash":
            dump[key] = client.hgetall(key)
        elif kind == b"string":
            dump[key] = client.get(key)
        elif kind == b"set":
            dump[key] = client.smembers(key)
        else:
            dump[key] = client.zrange(key, 0, -1, withscores=True)
    return dump


def test_a_batch_settled_at_once_leaves_the_books_as_one_by_one_and_sends_fewer_commands(
    live, monkeypatch
):
    hour_key = usage.counter_key
    monkeypatch.setattr(usage, "counter_key", lambda t, tier, now=None: hour_key(t, tier, T0))
    ended = [  # two tenants, one of them on two tiers; some never claimed (still waiting)
        Ended(uuid.UUID(int=1), 1, 1, QUEUE, "succeeded", 400, 50, 100),
        Ended(uuid.UUID(int=2), 1, 1, QUEUE, "succeeded", 300, 20, 30),
        Ended(uuid.UUID(int=3), 1, 2, QUEUE, "expired", 200, was_waiting=True),
        Ended(uuid.UUID(int=4), 2, 1, QUEUE, "failed", 100, 10, was_waiting=True),
        Ended(uuid.UUID(int=5), 1, 1, QUEUE, "expired", 50, was_waiting=True),
    ]

    def books_after(batches: list[list[Ended]]) -> tuple[dict[bytes, object], int]:
        live.flushdb()  # both start from the same buckets and counts
        liveness.beat(live, "default", "w1", now=T0 + 3600)
        for tenant in (1, 2):  # a bucket with room for every refund, and waiting counts
            admit(limits(tenant_id=tenant, tokens_per_minute=6000, burst=10), 1000, 0.0)
            live.set(books.waiting_key(QUEUE, tenant), 5)
        commands = 0
        for batch in batches:
            pipe = live.pipeline(transaction=False)
            accounting.settle(pipe, batch, now=T0 + 1)
            commands += len(pipe.command_stack)
            lua.execute(pipe)
        return _dump(live), commands

    one_by_one, separate_commands = books_after([[e] for e in ended])
    at_once, batch_commands = books_after([ended])
    assert at_once == one_by_one
    assert live.hget(books.bucket_key("tokens", 1), "tokens") is not None
    waiting = [int(live.get(books.waiting_key(QUEUE, tenant)) or 0) for tenant in (1, 2)]
    assert waiting == [3, 4]
    assert batch_commands < separate_commands
    # One tenant's batch (an engine step's outcomes) costs what one of its requests does.
    alike = [Ended(uuid.UUID(int=i), 1, 1, QUEUE, "succeeded", 400, 50, 100) for i in range(10)]
    assert books_after([alike])[1] == books_after([alike[:1]])[1]


def test_rejections_take_nothing_from_the_buckets(live):
    lim = limits(burst=1, max_queue_depth=1)
    live.lpush(QUEUE, "a message ahead")
    assert admit(lim, 1, 0.0).reason == "queue_full"
    live.delete(QUEUE)
    assert admit(lim, 1, 0.0).admitted  # the refused request spent neither token nor request


def test_admitted_requests_count_in_the_depth_until_their_publish_clears_them(live):
    # Between the decision and the publish (the row's INSERT) the queue is shorter than what
    # was admitted to it: 16 API threads at once overshot a cap of 16 before this.
    lim = limits(max_queue_depth=2, burst=100)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    assert decision.admit(lim, 1, now=T0, request_id=first).admitted
    assert decision.admit(lim, 1, now=T0, request_id=second).admitted
    assert live.llen(QUEUE) == 0  # neither is published yet, and still the queue is full
    assert decision.admit(lim, 1, now=T0, request_id=str(uuid.uuid4())).reason == "queue_full"
    live.lpush(QUEUE, "the first one's message")
    publishing.clear(live, QUEUE, [first])  # as its publish does, in the same pipeline
    other = limits(max_queue_depth=2, burst=100, tenant_id=2)  # the first tenant's share is full
    assert decision.admit(other, 1, now=T0).reason == "queue_full"  # 1 queued + 1 publishing
    publishing.clear(live, QUEUE, [second])  # its INSERT was refused: it never will be queued
    assert decision.admit(other, 1, now=T0).admitted
    assert live.zcard(publishing.publishing_key(QUEUE)) == 0


def test_an_admission_never_published_stops_counting_after_the_grace(live):
    dead = limits(max_queue_depth=1, burst=100)
    assert decision.admit(dead, 1, now=T0, request_id="an API process died before publishing")
    other = limits(max_queue_depth=1, burst=100, tenant_id=2)
    assert decision.admit(other, 1, now=T0 + 1).reason == "queue_full"
    later = T0 + publishing.PUBLISH_GRACE_SECONDS + 1
    assert decision.admit(other, 1, now=later).admitted


def test_no_live_worker_is_refused_before_anything_else(clean_redis):
    liveness.beat(clean_redis, "default", "old", now=T0 - 3600)  # stale long ago
    decision = admit(limits(), 1, 0.0)
    assert (decision.reason, decision.retry_after_seconds) == ("no_worker", None)


def test_full_queue_retry_after_follows_the_measured_drain_rate(live):
    lim = limits(max_queue_depth=10)
    live.lpush(QUEUE, *[f"m{i}" for i in range(12)])
    assert admit(lim, 1, 0.0).retry_after_seconds is None  # no drain rate measured yet
    drain_at(live, 4.0)
    decision = admit(lim, 1, 0.0)
    assert decision.reason == "queue_full"
    assert decision.drain_rate_per_second == pytest.approx(4.0, rel=1e-3)
    # 12 waiting, room for 10: three must leave first, at 4 per second.
    assert decision.retry_after_seconds == pytest.approx(0.75, rel=1e-3)


def test_a_wait_longer_than_the_deadline_is_refused_up_front(live):
    lim = limits(max_wait_seconds=2.0)
    live.lpush(QUEUE, *[f"m{i}" for i in range(10)])
    drain_at(live, 4.0)
    decision = admit(lim, 1, 0.0)  # 10 ahead at 4/s: 2.5 s > 2 s
    assert (decision.reason, decision.ahead) == ("too_slow", 10)
    assert decision.retry_after_seconds == pytest.approx(0.5, rel=1e-3)
    live.rpop(QUEUE, 3)  # 7 ahead: 1.75 s
    assert admit(lim, 1, 0.0).admitted


def test_a_rate_counted_for_less_than_a_half_life_is_not_biased_low(live):
    tau = books.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    books.record_drain(pipe, QUEUE, 1, {}, now=T0 - 2.0)  # counting starts
    books.record_drain(pipe, QUEUE, 8, {}, now=T0)  # 8 more in the 2 s since
    lua.execute(pipe)
    live.lpush(QUEUE, "m1")
    observed = tau * (1 - math.exp(-2.0 / tau))  # the decayed seconds the count covers
    expected = (math.exp(-2.0 / tau) + 8) / observed  # ~4.7/s; count / tau alone said ~0.6/s
    assert admit(limits(), 1, 0.0).drain_rate_per_second == pytest.approx(expected, rel=1e-9)


def test_a_first_claims_rate_counts_over_at_least_the_minimum_span(live):
    tau = books.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    books.record_drain(pipe, QUEUE, 3, {}, now=T0 - 0.01)  # 3 claims, 10 ms ago
    lua.execute(pipe)
    live.lpush(QUEUE, "m1")
    span = books.MIN_DRAIN_SPAN_SECONDS
    expected = 3 * math.exp(-0.01 / tau) / (tau * (1 - math.exp(-span / tau)))  # ~3/s
    assert admit(limits(), 1, 0.0).drain_rate_per_second == pytest.approx(expected, rel=1e-9)


def test_after_an_idle_spell_the_rate_counts_afresh(live):
    tau = books.drain_tau_seconds()
    pipe = live.pipeline(transaction=False)
    books.record_drain(pipe, QUEUE, 100, {}, now=T0 - 5 * tau)  # long ago: forgotten
    books.record_drain(pipe, QUEUE, 2, {}, now=T0 - 2.0)
    books.record_drain(pipe, QUEUE, 4, {}, now=T0)
    lua.execute(pipe)
    assert float(live.hget(books.drain_key(QUEUE), "since") or 0) == T0 - 2.0
    live.lpush(QUEUE, "m1")
    expected = (2 * math.exp(-2.0 / tau) + 4) / (tau * (1 - math.exp(-2.0 / tau)))
    assert admit(limits(), 1, 0.0).drain_rate_per_second == pytest.approx(expected, rel=1e-9)


def test_a_tier_with_a_first_token_target_sheds_at_the_target_not_at_the_deadline(live):
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0, wait_quantile=0.9)
    assert lim.acceptable_wait_seconds == 1.0
    drain_at(live, 4.0)
    live.lpush(QUEUE, *[f"m{i}" for i in range(2)])
    # 2 due first at 4/s, no lead measured: the 0.9 quantile of Gamma(3, 4/s) ~1.33 s > 1 s.
    decision = admit(lim, 1, 0.0)
    estimate = wait_quantile(2, 4.0, 0.0, 0.0, 0.9)
    assert (decision.reason, decision.ahead) == ("too_slow", 2)
    # Exact but for the drain count's round trip through Lua's tostring (14 digits).
    assert decision.estimated_wait_seconds == pytest.approx(estimate, rel=1e-9, abs=1e-7)
    assert decision.retry_after_seconds == pytest.approx(estimate - 1.0, rel=1e-9, abs=1e-7)
    assert admit(limits(max_wait_seconds=30.0), 1, 0.0).admitted  # no target: the deadline
    live.rpop(QUEUE, 1)  # 1 due first: Gamma(2, 4/s)'s 0.9 quantile ~0.97 s
    assert wait_quantile(1, 4.0, 0.0, 0.0, 0.9) < 1.0
    assert admit(lim, 1, 0.0).admitted
    assert live.llen(QUEUE) == 1  # admit decides; only the submission enqueues
    # A target at or past the deadline changes nothing.
    assert limits(max_wait_seconds=2.0, first_token_target_seconds=5.0).acceptable_wait_seconds == 2


def test_the_quantile_judges_a_short_queue_more_strictly_than_a_long_one(live):
    # The same mean wait, 0.8 s, once as 3 due first at 5/s and once as 39 at 50/s: the short
    # queue's wait spreads more (cv 1/2 vs 1/sqrt(40)), so only it misses a 1 s target at 0.9.
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0, wait_quantile=0.9)
    live.lpush(QUEUE, *[f"m{i}" for i in range(3)])
    drain_at(live, 5.0)
    short = admit(lim, 1, 0.0)
    assert short.reason == "too_slow"
    assert short.estimated_wait_seconds == pytest.approx(wait_quantile(3, 5.0, 0, 0, 0.9), abs=1e-7)
    live.delete(books.drain_key(QUEUE))
    live.lpush(QUEUE, *[f"n{i}" for i in range(36)])
    drain_at(live, 50.0)
    assert wait_quantile(39, 50.0, 0, 0, 0.9) < 1.0 < wait_quantile(3, 5.0, 0, 0, 0.9)
    assert admit(lim, 1, 0.0).admitted
    assert live.llen(QUEUE) == 39


def test_limits_take_the_wait_quantile_from_the_settings(settings):
    settings.LLMQUEUE_SHED_WAIT_QUANTILE = 0.8
    caller = Caller(
        key_id=1, tenant_id=1, tenant_name="t", tenant_active=True, key_revoked=False,
        max_tokens_per_request=100, requests_per_second=1.0, burst=1, tokens_per_minute=1000,
        max_tier_share=1.0, tier_id=1, tier_name="interactive", tier_priority=0,
        max_wait_seconds=30, first_token_target_seconds=2.0, default_max_tokens=16,
        max_queue_depth=10,
    )  # fmt: skip
    lim = limits_for(caller, ModelRoute("m", "default", 2048, 512))
    assert (lim.first_token_target_seconds, lim.acceptable_wait_seconds) == (2.0, 2.0)
    assert lim.wait_quantile == 0.8


def test_judged_against_the_target_the_wait_includes_the_engines_measured_lead(live):
    lim = limits(max_wait_seconds=30.0, first_token_target_seconds=1.0, wait_quantile=0.9)
    tau = books.drain_tau_seconds()
    drain_at(live, 10.0)
    pipe = live.pipeline(transaction=False)
    books.record_leads(pipe, QUEUE, 0.4, 2, now=T0 - 5)  # a batch of two, mean 0.2 s
    books.record_leads(pipe, QUEUE, 0.3, 1, now=T0 - 1)  # one of 0.3 s
    books.record_leads(pipe, QUEUE, 0.5, 1, now=T0)  # one of 0.5 s
    lua.execute(pipe)
    assert admit(lim, 1, 0.0).admitted  # an empty queue is never too slow, whatever the lead
    d5, d1 = math.exp(-5 / tau), math.exp(-1 / tau)
    sums = {"lead_sum": 0.4 * d5 + 0.3 * d1 + 0.5, "lead_n": 2 * d5 + d1 + 1}
    sums |= {"lead_sq": 0.4**2 / 2 * d5 + 0.3**2 * d1 + 0.5**2, "lead_b": d5 + d1 + 1}
    stored = live.hmget(books.drain_key(QUEUE), *sums)
    assert [float(x or 0) for x in stored] == [pytest.approx(v, rel=1e-9) for v in sums.values()]
    lead = sums["lead_sum"] / sums["lead_n"]  # ~0.35 s
    # The spread of the batches' means, each weighed by its size (b - 1: unbiased).
    lead_var = (sums["lead_sq"] - lead * sums["lead_sum"]) / (sums["lead_b"] - 1)
    live.lpush(QUEUE, "m1", "m2", "m3")
    decision = admit(lim, 1, 0.0)  # 3 due first at 10/s (0.4 s) + ~0.35 s: 0.9 quantile ~1.1 s
    estimate = wait_quantile(3, 10.0, lead, lead_var, 0.9)
    assert estimate > 1.0 > wait_quantile(3, 10.0, 0.0, 0.0, 0.9)  # without the lead, in time
    assert (decision.reason, decision.ahead) == ("too_slow", 3)
    assert decision.estimated_wait_seconds == pytest.approx(estimate, rel=1e-9, abs=1e-7)
    assert admit(limits(max_wait_seconds=1.0), 1, 0.0).admitted  # a deadline: queue wait only


def test_a_tenant_fills_only_its_share_of_the_queue(live):
    lim = limits(max_queue_depth=10, max_tier_share=0.2, burst=100)
    assert reasons([admit(lim, 1, 0.0) for _ in range(3)]) == ["", "", "tenant_share"]
    pipe = live.pipeline(transaction=False)
    books.record_drain(pipe, QUEUE, 1, {1: 1}, now=T0)  # a worker claimed one of them
    lua.execute(pipe)
    assert admit(lim, 1, 0.0).admitted


def test_usage_counts_every_decision_and_outcome_then_lands_in_the_db(
    seeded: Seeded, live: redis.Redis
):
    tenant_id, tier_id = seeded.tenant_id, seeded.tier_id
    lim = limits(tenant_id=tenant_id, tier_id=tier_id, burst=2)
    now = time.time()
    for _ in range(3):
        decision.admit(lim, 5, now=now)
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
        if decision.admit(lim, 1).admitted:
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

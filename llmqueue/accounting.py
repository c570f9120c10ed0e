"""A request's books: what admission reserved is settled once, when the request ends.

Admission holds prompt tokens + max_tokens against the tenant's tokens per minute and counts the
request as waiting in its queue. When the request ends (succeeded, failed, expired, or never
published) the unused part of the reservation goes back to the tenant, the outcome and tokens
are counted in its usage, and if no worker ever claimed it, it stops counting as waiting. Only
the writer that moved the row to its final state settles it (the conditional UPDATEs of
llmqueue/lifecycle.py decide that), so nothing is settled twice.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import redis

from llmqueue import latencies, usage
from llmqueue.admission import books
from llmqueue.lifecycle import Claim, Ended


def unused_tokens(ended: Ended) -> int:
    return max(0, ended.reserved_tokens - ended.prompt_tokens - ended.completion_tokens)


def settle(pipe: redis.client.Pipeline, ended: list[Ended], now: float | None = None) -> None:
    """Queue on `pipe` the refunds, usage counts and waiting-count drops of ended requests
    (`now`, epoch seconds, is for tests: Redis' clock by default).

    Summed per tenant (refunds), per tenant and tier (usage) and per queue and tenant (waiting)
    first: a recorder's batch of outcomes at one engine step is mostly one tenant's, and a
    command per request (a refund script and seven counters each) was most of the worker's Redis
    traffic under load. A sum refunds what the requests' refunds would one after another (each
    adds to the bucket, capped at its size, at the same instant)."""
    refunds: Counter[int] = Counter()
    counts: defaultdict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    waiting: Counter[tuple[str, int]] = Counter()
    for e in ended:
        refunds[e.tenant_id] += unused_tokens(e)
        counts[e.tenant_id, e.tier_id].update(
            {
                e.outcome: 1,
                "prompt_tokens": e.prompt_tokens,
                "completion_tokens": e.completion_tokens,
            }
        )
        if e.was_waiting and e.queue:
            waiting[e.queue, e.tenant_id] += 1
    for tenant_id, tokens in refunds.items():
        books.refund(pipe, tenant_id, tokens, now)
    for (tenant_id, tier_id), fields in counts.items():
        usage.count(pipe, tenant_id, tier_id, fields)
    for (queue, tenant_id), n in waiting.items():
        pipe.decrby(books.waiting_key(queue, tenant_id), n)
    latencies.count(pipe, latencies.ended_observations(ended), now)


def count_leads(pipe: redis.client.Pipeline, leads: list[tuple[str, float]]) -> None:
    """Queue on `pipe` each queue's engine lead times (engine → first token) of this batch."""
    by_queue: dict[str, list[float]] = {}
    for queue, seconds in leads:
        if queue:
            by_queue.setdefault(queue, []).append(seconds)
    for queue, times in by_queue.items():
        books.record_leads(pipe, queue, sum(times), len(times))


def count_claims(pipe: redis.client.Pipeline, claims: list[Claim]) -> None:
    """Queue on `pipe` what first claims change: each queue's drain rate (the requests that left
    it for an engine), and its tenants' counts of waiting requests."""
    by_queue: dict[str, dict[int, int]] = {}
    for c in claims:
        if c.first and c.queue:
            tenants = by_queue.setdefault(c.queue, {})
            tenants[c.tenant_id] = tenants.get(c.tenant_id, 0) + 1
    for queue, tenants in by_queue.items():
        books.record_drain(pipe, queue, sum(tenants.values()), tenants)
    latencies.count(pipe, latencies.claim_observations(claims))

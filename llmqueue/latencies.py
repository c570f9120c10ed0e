"""Latency histograms in Redis: each ended request's times counted per tier, by the recorder.

A batch of ended requests becomes one HINCRBY per touched bucket (and one HINCRBYFLOAT per
histogram's sum) in the recorder's own pipeline: no round trip of its own, a few commands per
batch rather than per request. Every kind goes to a cumulative hash (Prometheus histograms) and
to the minute's copy (sliding windows: SLO attainment now, the dashboard's hour).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

import redis
from django.conf import settings

from contract import latency
from contract.keys import latency_key, latency_window_key
from llmqueue.lifecycle import Claim, Ended

Observation = tuple[str, int, float]  # (kind, tier id, seconds)


def ended_observations(ended: Iterable[Ended]) -> list[Observation]:
    """Queue, first-token and end-to-end times of ended requests. A request that never reached
    an engine (expired or cancelled in its queue) counts in time in queue up to its end: the
    wait it did, so a tier whose requests expire does not look fast."""
    seen: list[Observation] = []
    for e in ended:
        t = e.timing
        queued = t.since_enqueued(t.started if t.started is not None else t.finished)
        for kind, seconds in (
            (latency.QUEUE, queued),
            (latency.FIRST_TOKEN, t.since_enqueued(t.first_token)),
            (latency.TOTAL, t.since_enqueued(t.finished)),
        ):
            if seconds is not None:
                seen.append((kind, e.tier_id, seconds))
    return seen


def claim_observations(claims: Iterable[Claim]) -> list[Observation]:
    """Deadline slack at dispatch: how far from its deadline a first claim took a request."""
    return [
        (latency.SLACK, c.tier_id, max(0.0, c.slack_seconds))
        for c in claims
        if c.slack_seconds is not None and c.tier_id
    ]


def count(pipe: redis.client.Pipeline, seen: list[Observation], now: float | None = None) -> None:
    """Queue on `pipe` the histogram increments of `seen` (nothing with LLMQUEUE_METRICS off)."""
    if not seen or not settings.LLMQUEUE_METRICS:
        return
    minute = latency.minute_of(time.time() if now is None else now)
    buckets: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    sums: dict[tuple[str, int], float] = defaultdict(float)
    for kind, tier_id, seconds in seen:
        buckets[kind, tier_id][latency.bucket_field(seconds)] += 1
        sums[kind, tier_id] += seconds
    for (kind, tier_id), counts in buckets.items():
        window = latency_window_key(kind, tier_id, minute)
        for key in (latency_key(kind, tier_id), window):
            for field, n in counts.items():
                pipe.hincrby(key, field, n)
            pipe.hincrbyfloat(key, latency.SUM, sums[kind, tier_id])
        pipe.expire(window, latency.WINDOW_TTL_SECONDS)

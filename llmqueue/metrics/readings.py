"""One scrape's readings of the whole system: every replica's and worker's counts, not one's.

Everything comes from Redis (admission's and the workers' counters, histograms, beats, the
queues themselves) and the DB (tiers, tenants, the oldest waiting request), so any API replica
answers /metrics with the same figures. Reading is a handful of round trips, pipelined.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings
from django.db.models import Min

from contract import key_index, latency, liveness
from contract.keys import (
    API_ERRORS_KEY,
    RECONCILED_KEY,
    TOTALS_INDEX_KEY,
    TOTALS_PREFIX,
    drain_key,
    latency_key,
    latency_window_key,
)
from contract.queues import Lane
from llmqueue.admission.books import drain_rate, drain_tau_seconds
from llmqueue.models import PromptRequest, ServedModel, Tenant, Tier
from llmqueue.queueing.lanes import queue_name

OTHER_TENANT = "other"


@dataclass(frozen=True)
class QueueReading:
    pool: str
    tier: str
    waiting: int  # messages in the broker list
    unacked: int  # delivered to a worker, not acked yet
    oldest_age_seconds: float  # of the oldest queued row; 0 when none waits
    drain_rate: float  # requests/s, as admission measures it
    estimated_wait_seconds: float  # waiting / drain rate: admission's mean wait


@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[str, int]]  # (upper bound, cumulative count), "+Inf" last
    total: float
    count: int


@dataclass(frozen=True)
class WorkerReading:
    pool: str
    node: str
    info: dict[str, str]
    batch_fill: float | None
    token_budget_fill: float | None
    steps: int | None
    in_engine: int | None = None  # requests in the engine now
    held: int | None = None  # requests the worker holds (engine + parked), of its task slots


@dataclass
class Readings:
    queues: list[QueueReading] = field(default_factory=list)
    # (tier, tenant label, field) → count since the start, summed over hidden tenants
    totals: dict[tuple[str, str, str], int] = field(default_factory=dict)
    api_errors: dict[str, int] = field(default_factory=dict)
    republished: int = 0
    histograms: dict[tuple[str, str], Histogram] = field(default_factory=dict)  # (kind, tier)
    slo_attainment: dict[str, float] = field(default_factory=dict)  # tier → share on time
    workers_alive: dict[str, int] = field(default_factory=dict)
    workers: list[WorkerReading] = field(default_factory=list)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def cumulative(counts: dict[str, int]) -> list[tuple[str, int]]:
    """Per-bucket counts (contract/latency.py fields) as Prometheus' cumulative buckets."""
    running, out = 0, []
    for bound in [*map(repr, latency.BUCKETS), latency.INF]:
        running += counts.get(bound, 0)
        out.append((bound, running))
    return out


def histogram_of(raw: dict[Any, Any]) -> Histogram:
    counts = {_text(k): int(v) for k, v in raw.items() if _text(k) != latency.SUM}
    buckets = cumulative(counts)
    return Histogram(buckets, float(raw.get(latency.SUM.encode(), 0) or 0), buckets[-1][1])


def attainment(counts: dict[str, int], target_seconds: float) -> float | None:
    """Share of first tokens within `target_seconds`, from per-bucket counts; None if none."""
    total = sum(counts.values())
    if not total:
        return None
    on_time = sum(
        n for bound, n in counts.items() if bound != latency.INF and float(bound) <= target_seconds
    )
    return on_time / total


def unacked_by_queue(client: redis.Redis) -> dict[str, int]:
    """Messages delivered to a worker and not acked yet, by queue (kombu's `unacked` hash holds
    [message, exchange, routing key] per delivery tag; our routing key is the queue's name)."""
    counts: dict[str, int] = defaultdict(int)
    for entry in client.hvals("unacked"):
        try:
            counts[str(json.loads(entry)[2])] += 1
        except (ValueError, IndexError, TypeError):
            continue
    return counts


def oldest_queued(now: float) -> dict[str, float]:
    """Seconds the oldest queued row of each queue has waited."""
    rows = (
        PromptRequest.objects.filter(status=PromptRequest.Status.QUEUED)
        .values("queue")
        .annotate(oldest=Min("enqueued_at"))
    )
    return {row["queue"]: max(0.0, now - row["oldest"].timestamp()) for row in rows}


def read_queues(
    client: redis.Redis, pools: list[str], tiers: list[str], now: float
) -> list[QueueReading]:
    names = sorted({queue_name(pool, tier) for pool in pools for tier in tiers})
    lanes = [Lane.of_queue(name) for name in names]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
        pipe.hmget(drain_key(name), "count", "ts", "since")
    replies = pipe.execute()
    unacked, oldest, tau = unacked_by_queue(client), oldest_queued(now), drain_tau_seconds()
    readings = []
    for index, (lane, name) in enumerate(zip(lanes, names, strict=True)):
        waiting, drain = int(replies[2 * index]), replies[2 * index + 1]
        rate = drain_rate(drain, now, tau)
        wait = waiting / rate if rate > 0 else 0.0
        readings.append(
            QueueReading(
                lane.pool,
                lane.tier,
                waiting,
                unacked.get(name, 0),
                oldest.get(name, 0.0),
                rate,
                wait,
            )
        )
    return readings


def read_totals(
    client: redis.Redis, tier_names: dict[int, str], labels: dict[int, str]
) -> dict[tuple[str, str, str], int]:
    keys = key_index.members(client, TOTALS_INDEX_KEY, f"{TOTALS_PREFIX}:*:*")
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    totals: dict[tuple[str, str, str], int] = defaultdict(int)
    for key, raw in zip(keys, pipe.execute(), strict=True):
        tenant_id, tier_id = key[len(TOTALS_PREFIX) + 1 :].split(":")
        tier = tier_names.get(int(tier_id))
        if tier is None:
            continue
        tenant = labels.get(int(tenant_id), OTHER_TENANT)
        for name, value in raw.items():
            totals[tier, tenant, _text(name)] += int(value)
    return dict(totals)


def read_latencies(
    client: redis.Redis, tiers: dict[int, Tier], now: float
) -> tuple[dict[tuple[str, str], Histogram], dict[str, float]]:
    """Each tier's histograms since the start, and its SLO attainment over the window."""
    window_minutes = max(1, math.ceil(settings.LLMQUEUE_METRICS_SLO_WINDOW_SECONDS / 60))
    minute = latency.minute_of(now)
    pipe = client.pipeline(transaction=False)
    for tier_id in tiers:
        for kind in latency.KINDS:
            pipe.hgetall(latency_key(kind, tier_id))
        for m in range(minute - window_minutes + 1, minute + 1):
            pipe.hgetall(latency_window_key(latency.FIRST_TOKEN, tier_id, m))
    replies = iter(pipe.execute())
    histograms, slo = {}, {}
    for tier in tiers.values():
        for kind in latency.KINDS:
            histograms[kind, tier.name] = histogram_of(next(replies))
        window: dict[str, int] = defaultdict(int)
        for _ in range(window_minutes):
            for bound, n in next(replies).items():
                if _text(bound) != latency.SUM:
                    window[_text(bound)] += int(n)
        target = tier.first_token_target_seconds
        share = attainment(window, target) if target else None
        if share is not None:
            slo[tier.name] = share
    return histograms, slo


def read_workers(
    client: redis.Redis, pools: list[str], now: float
) -> tuple[dict[str, int], list[WorkerReading]]:
    stale = settings.LLMQUEUE_WORKER_STALE_SECONDS
    alive: dict[str, int] = {}
    workers: list[WorkerReading] = []
    for pool in pools:
        nodes = liveness.live_workers(client, pool, stale, now)
        alive[pool] = len(nodes)
        stats = liveness.worker_stats(client, pool)
        for node in nodes:
            workers.append(worker_reading(pool, node, stats.get(node, {})))
    return alive, workers


def worker_reading(pool: str, node: str, stats: dict[str, Any]) -> WorkerReading:
    """A worker's beat (workers/cost.py snapshot) as the figures /metrics shows."""
    info = {k: str(v) for k, v in stats.get("info", {}).items()}
    engine = stats.get("engine", {})
    budget = stats.get("budget", {})
    seqs = int(info.get("max_num_seqs", 0) or 0)
    fill = engine.get("in_engine", 0) / seqs if seqs and "in_engine" in engine else None
    cap = budget.get("token_budget") or 0
    tokens_fill = budget.get("tokens", 0) / cap if cap else None
    steps, in_engine, held = engine.get("steps"), engine.get("in_engine"), budget.get("requests")
    return WorkerReading(
        pool, node, info, fill, tokens_fill,
        None if steps is None else int(steps),
        None if in_engine is None else int(in_engine),
        None if held is None else int(held),
    )  # fmt: skip


def read(client: redis.Redis, now: float | None = None) -> Readings:
    """Everything /metrics shows, as of now."""
    now = time.time() if now is None else now
    tiers = {t.id: t for t in Tier.objects.all()}
    tier_names = {i: t.name for i, t in tiers.items()}
    labels = dict(Tenant.objects.filter(track_in_metrics=True).values_list("id", "name"))
    pools = sorted(set(ServedModel.objects.values_list("pool", flat=True)))
    readings = Readings()
    readings.queues = read_queues(client, pools, sorted(tier_names.values()), now)
    readings.totals = read_totals(client, tier_names, labels)
    readings.api_errors = {_text(k): int(v) for k, v in client.hgetall(API_ERRORS_KEY).items()}
    readings.republished = int(client.get(RECONCILED_KEY) or 0)
    readings.histograms, readings.slo_attainment = read_latencies(client, tiers, now)
    readings.workers_alive, readings.workers = read_workers(client, pools, now)
    return readings

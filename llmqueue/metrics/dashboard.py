"""The admin dashboard's figures: each queue now, its last hour, and the live workers.

Read from the same places as /metrics (llmqueue/metrics/readings.py) plus the per-minute
windows: admissions and rejections (admission's script), latency histograms (the recorder) and
each queue's depth history (its workers, workers/depth_history.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from django.db.models import Count, Q

from contract import latency
from contract.keys import admissions_window_key, depth_history_key, latency_window_key
from llmqueue.metrics import readings
from llmqueue.models import BulkJob, Tier

RATE_WINDOW_MINUTES = 5  # "now": the last five minutes, as SLO attainment's default window
HISTORY_MINUTES = 60


@dataclass(frozen=True)
class LaneRow:
    pool: str
    tier: str
    waiting: int
    unacked: int
    oldest_age_seconds: float
    finished_per_minute: float  # the tier's, over the last RATE_WINDOW_MINUTES
    rejection_rate: float | None  # rejected ÷ (admitted + rejected), the tier's; None if no traffic
    slo_attainment: float | None


@dataclass(frozen=True)
class JobRow:
    """A bulk job not finished yet: its lines by status."""

    id: str
    tenant: str
    tier: str
    status: str
    total: int
    lines: dict[str, int]

    @property
    def done(self) -> int:
        return sum(self.lines.get(s, 0) for s in ("succeeded", "failed", "expired", "cancelled"))

    @property
    def percent(self) -> int:
        return round(100 * self.done / self.total) if self.total else 0


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[int, float]]  # (epoch minute, value)


@dataclass
class Dashboard:
    lanes: list[LaneRow] = field(default_factory=list)
    workers: list[readings.WorkerReading] = field(default_factory=list)
    depth: list[Series] = field(default_factory=list)
    p99_wait: list[Series] = field(default_factory=list)
    minutes: tuple[int, int] = (0, 0)  # first and last minute of the plots
    jobs: list[JobRow] = field(default_factory=list)


def quantile(counts: dict[str, int], q: float) -> float | None:
    """The q-quantile of a histogram's per-bucket counts, interpolated within its bucket as
    Prometheus' histogram_quantile does; None when empty."""
    total = sum(counts.values())
    if not total:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound in latency.BUCKETS:
        n = counts.get(repr(bound), 0)
        if seen + n >= rank and n:
            return lower + (bound - lower) * (rank - seen) / n
        seen += n
        lower = bound
    return latency.BUCKETS[-1]  # in +Inf: as high as we can say


def _fields(raw: dict[bytes, bytes]) -> dict[str, int]:
    return {k.decode(): int(float(v)) for k, v in raw.items() if k.decode() != latency.SUM}


def tier_rates(
    client: redis.Redis, tiers: list[Tier], minute: int
) -> dict[str, tuple[float, float | None]]:
    """Each tier's finished requests per minute and rejection rate over the rate window."""
    minutes = range(minute - RATE_WINDOW_MINUTES + 1, minute + 1)
    pipe = client.pipeline(transaction=False)
    for tier in tiers:
        for m in minutes:
            pipe.hgetall(admissions_window_key(tier.id, m))
            pipe.hgetall(latency_window_key(latency.TOTAL, tier.id, m))
    replies = iter(pipe.execute())
    rates = {}
    for tier in tiers:
        admitted = rejected = finished = 0
        for _ in minutes:
            counts = _fields(next(replies))
            admitted, rejected = (
                admitted + counts.get("admitted", 0),
                rejected + counts.get("rejected", 0),
            )
            finished += sum(_fields(next(replies)).values())
        asked = admitted + rejected
        rates[tier.name] = (finished / RATE_WINDOW_MINUTES, rejected / asked if asked else None)
    return rates


def history(
    client: redis.Redis, queues: list[str], tiers: list[Tier], minute: int
) -> tuple[list[Series], list[Series]]:
    """Each queue's depth and each tier's p99 wait in queue, minute by minute, last hour."""
    minutes = list(range(minute - HISTORY_MINUTES + 1, minute + 1))
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.hgetall(depth_history_key(queue))
    for tier in tiers:
        for m in minutes:
            pipe.hgetall(latency_window_key(latency.QUEUE, tier.id, m))
    replies = iter(pipe.execute())
    depth = []
    for queue in queues:
        by_minute = {int(k): float(v) for k, v in next(replies).items()}
        depth.append(Series(queue, [(m, by_minute[m]) for m in minutes if m in by_minute]))
    waits = []
    for tier in tiers:
        points = []
        for m in minutes:
            p99 = quantile(_fields(next(replies)), 0.99)
            if p99 is not None:
                points.append((m, p99))
        waits.append(Series(tier.name, points))
    return depth, waits


LINE_STATUSES = ("held", "queued", "running", "succeeded", "failed", "expired", "cancelled")
UNFINISHED_JOBS = ("validating", "in_progress", "finalizing", "cancelling")


def active_jobs(limit: int = 20) -> list[JobRow]:
    """The oldest unfinished bulk jobs, their lines counted by status in one grouped query."""
    counts = {s: Count("lines", filter=Q(lines__status=s)) for s in LINE_STATUSES}
    jobs = (
        BulkJob.objects.filter(status__in=UNFINISHED_JOBS)
        .select_related("tenant", "tier")
        .annotate(**counts)
        .order_by("created_at")[:limit]
    )
    return [
        JobRow(
            job.id, job.tenant.name, job.tier.name, job.status, job.total,
            {s: getattr(job, s) for s in LINE_STATUSES},
        )
        for job in jobs
    ]  # fmt: skip


def build(client: redis.Redis, now: float | None = None) -> Dashboard:
    now = time.time() if now is None else now
    minute = latency.minute_of(now)
    found = readings.read(client, now)
    tiers = list(Tier.objects.order_by("priority", "name"))
    rates = tier_rates(client, tiers, minute)
    order = {t.name: i for i, t in enumerate(tiers)}
    lanes = []
    for q in sorted(found.queues, key=lambda q: (q.pool, order.get(q.tier, len(order)), q.tier)):
        finished, rejection = rates.get(q.tier, (0.0, None))
        lanes.append(
            LaneRow(
                q.pool, q.tier, q.waiting, q.unacked, q.oldest_age_seconds, finished, rejection,
                found.slo_attainment.get(q.tier),
            )
        )  # fmt: skip
    queues = [f"{lane.pool}.{lane.tier}" for lane in lanes]
    depth, waits = history(client, queues, tiers, minute)
    history_span = (minute - HISTORY_MINUTES + 1, minute)
    return Dashboard(lanes, found.workers, depth, waits, history_span, active_jobs())

"""The Prometheus exposition of one scrape's readings: names, help, types and labels.

Labels stay bounded: pool, tier, node (one per GPU worker) and tenant only for tenants the
admin marks tracked (the others add up under tenant="other").
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from contract import latency
from llmqueue.metrics import readings
from llmqueue.redis_client import get_redis

PREFIX = "llmqueue"
HISTOGRAMS = {
    latency.QUEUE: ("queue_wait_seconds", "Time from admission to a worker's claim."),
    latency.FIRST_TOKEN: ("time_to_first_token_seconds", "Time from admission to the first token."),
    latency.TOTAL: ("request_duration_seconds", "Time from admission to the request's end."),
    latency.SLACK: (
        "deadline_slack_seconds",
        "Time left to the deadline when a worker claimed it.",
    ),
}
OUTCOMES = ("succeeded", "failed", "expired", "cancelled")
REJECTIONS = ("rate", "tokens", "tenant_share", "queue_full", "no_worker", "too_slow")


def queue_metrics(found: readings.Readings) -> Iterator[Metric]:
    lanes = ["pool", "tier"]
    depth = GaugeMetricFamily(
        f"{PREFIX}_queue_depth",
        "Requests in a (pool, tier) queue: waiting in the broker and delivered but not acked.",
        labels=[*lanes, "state"],
    )
    oldest = GaugeMetricFamily(
        f"{PREFIX}_queue_oldest_age_seconds", "Age of the oldest queued request.", labels=lanes
    )
    drain = GaugeMetricFamily(
        f"{PREFIX}_queue_drain_rate",
        "Requests per second leaving the queue for an engine.",
        labels=lanes,
    )
    wait = GaugeMetricFamily(
        f"{PREFIX}_queue_estimated_wait_seconds",
        "Admission's estimate of a new request's wait (waiting ÷ drain rate).",
        labels=lanes,
    )
    for q in found.queues:
        depth.add_metric([q.pool, q.tier, "waiting"], q.waiting)
        depth.add_metric([q.pool, q.tier, "unacked"], q.unacked)
        oldest.add_metric([q.pool, q.tier], q.oldest_age_seconds)
        drain.add_metric([q.pool, q.tier], q.drain_rate)
        wait.add_metric([q.pool, q.tier], q.estimated_wait_seconds)
    yield from (depth, oldest, drain, wait)


def counter_metrics(found: readings.Readings) -> Iterator[Metric]:
    labels = ["tier", "tenant"]
    admitted = CounterMetricFamily(
        f"{PREFIX}_requests_admitted", "Requests admitted.", labels=labels
    )
    rejected = CounterMetricFamily(
        f"{PREFIX}_requests_rejected",
        "Requests refused by admission: 429 (rate, tokens) and 503 (the others), by reason.",
        labels=[*labels, "reason"],
    )
    ended = CounterMetricFamily(
        f"{PREFIX}_requests_finished", "Requests ended, by outcome.", labels=[*labels, "outcome"]
    )
    tokens = CounterMetricFamily(
        f"{PREFIX}_tokens",
        "Tokens of ended requests, prompt and completion.",
        labels=[*labels, "kind"],
    )
    for (tier, tenant, name), value in sorted(found.totals.items()):
        if name == "admitted":
            admitted.add_metric([tier, tenant], value)
        elif name.startswith("rejected_") and name[len("rejected_") :] in REJECTIONS:
            rejected.add_metric([tier, tenant, name[len("rejected_") :]], value)
        elif name in OUTCOMES:
            ended.add_metric([tier, tenant, name], value)
        elif name in ("prompt_tokens", "completion_tokens"):
            tokens.add_metric([tier, tenant, name.removesuffix("_tokens")], value)
    errors = CounterMetricFamily(
        f"{PREFIX}_api_errors",
        "Requests the API refused before admission (bad input, auth, not found), by error code.",
        labels=["code"],
    )
    for code, value in sorted(found.api_errors.items()):
        errors.add_metric([code], value)
    republished = CounterMetricFamily(
        f"{PREFIX}_republished_requests",
        "Queued requests published anew because their message had left the broker (Redis lost "
        "its data); each was still queued in the database.",
        value=found.republished,
    )
    yield from (admitted, rejected, ended, tokens, errors, republished)


def latency_metrics(found: readings.Readings) -> Iterator[Metric]:
    for kind, (name, help_text) in HISTOGRAMS.items():
        family = HistogramMetricFamily(f"{PREFIX}_{name}", help_text, labels=["tier"])
        for (seen_kind, tier), h in sorted(found.histograms.items()):
            if seen_kind == kind:
                family.add_metric([tier], h.buckets, h.total)
        yield family
    slo = GaugeMetricFamily(
        f"{PREFIX}_slo_attainment",
        "Share of first tokens within the tier's target over the last "
        "LLMQUEUE_METRICS_SLO_WINDOW_SECONDS (tiers with a target).",
        labels=["tier"],
    )
    for tier, share in sorted(found.slo_attainment.items()):
        slo.add_metric([tier], share)
    yield slo


def worker_metrics(found: readings.Readings) -> Iterator[Metric]:
    alive = GaugeMetricFamily(
        f"{PREFIX}_workers_alive", "Workers beating in a pool.", labels=["pool"]
    )
    for pool, count in sorted(found.workers_alive.items()):
        alive.add_metric([pool], count)
    labels = ["pool", "node"]
    info = InfoMetricFamily(
        f"{PREFIX}_worker", "A live worker: engine, model, slots.", labels=labels
    )
    fill = GaugeMetricFamily(
        f"{PREFIX}_engine_batch_fill", "Requests in the engine ÷ its max-num-seqs.", labels=labels
    )
    budget = GaugeMetricFamily(
        f"{PREFIX}_engine_token_budget_fill",
        "Estimated tokens the worker holds ÷ its token budget.",
        labels=labels,
    )
    steps = CounterMetricFamily(
        f"{PREFIX}_engine_steps", "Engine steps since the worker started.", labels=labels
    )
    for w in found.workers:
        info.add_metric([w.pool, w.node], w.info)
        if w.batch_fill is not None:
            fill.add_metric([w.pool, w.node], w.batch_fill)
        if w.token_budget_fill is not None:
            budget.add_metric([w.pool, w.node], w.token_budget_fill)
        if w.steps is not None:
            steps.add_metric([w.pool, w.node], w.steps)
    yield from (alive, info, fill, budget, steps)


class SystemCollector(Collector):
    """Reads the whole system at every scrape (llmqueue/metrics/readings.py)."""

    def collect(self) -> Iterator[Metric]:
        found = readings.read(get_redis())
        yield from queue_metrics(found)
        yield from counter_metrics(found)
        yield from latency_metrics(found)
        yield from worker_metrics(found)

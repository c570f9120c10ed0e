"""/metrics: the whole system's figures from Redis and the DB, whoever counted them."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
import redis
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from contract import latency
from llmqueue.admission.books import drain_rate, drain_tau_seconds, record_drain
from llmqueue.admission.decision import Limits, admit
from llmqueue.metrics.readings import attainment, cumulative
from llmqueue.models import PromptRequest, Tenant
from tests.conftest import SIMULATED, T0, Seeded, WorkerFactory, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: Any, **headers: str) -> Samples:
    response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def complete(server: Any, key: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": "sim", "prompt": "hello", "max_tokens": max_tokens, **extra}
    return httpx.post(
        f"{server.url}/v1/completions",
        content=json.dumps(body),
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_metrics_count_what_admission_and_the_worker_counted(
    live_server, seeded: Seeded, start_worker: WorkerFactory
):
    Tenant.objects.filter(name="acme").update(track_in_metrics=True)
    start_worker("default", *SIMULATED, "--sim-time-scale", "0")
    answers = [complete(live_server, seeded.key, 4) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    for answer in answers:  # each caller is told how long it waited for a worker
        assert 0 <= float(answer.headers["X-LLMQueue-Queue-Seconds"]) < 5
    assert complete(live_server, seeded.key, 4, top_p=7).status_code == 422
    assert complete(live_server, "sk-nobody", 4).status_code == 401
    # globex is not tracked: it is counted, under tenant="other"
    assert complete(live_server, seeded.other_key, 2).status_code == 200

    got = scrape(live_server)
    mine = {"tier": "interactive", "tenant": "acme"}
    assert value(got, "llmqueue_requests_admitted_total", **mine) == 3
    assert value(got, "llmqueue_requests_finished_total", **mine, outcome="succeeded") == 3
    assert value(got, "llmqueue_tokens_total", **mine, kind="completion") == 12
    assert value(got, "llmqueue_tokens_total", **mine, kind="prompt") == 3 * 2
    other = {"tier": "batch", "tenant": "other"}
    assert value(got, "llmqueue_requests_finished_total", **other, outcome="succeeded") == 1
    assert value(got, "llmqueue_api_errors_total", code="invalid_parameter") == 1
    assert value(got, "llmqueue_api_errors_total", code="invalid_api_key") == 1
    for name in ("queue_wait", "time_to_first_token", "request_duration", "deadline_slack"):
        assert value(got, f"llmqueue_{name}_seconds_count", tier="interactive") == 3
        assert value(got, f"llmqueue_{name}_seconds_bucket", tier="interactive", le="+Inf") == 3
    # the default interactive target is 1 s: three instant first tokens met it
    assert value(got, "llmqueue_slo_attainment", tier="interactive") == 1.0
    assert value(got, "llmqueue_workers_alive", pool="default") == 1
    assert value(got, "llmqueue_workers_alive", pool="tiny") == 0
    [info] = [labels for name, labels in got if name == "llmqueue_worker_info"]
    assert {k: v for k, v in info if k in ("engine", "model", "max_num_seqs")} == {
        "engine": "simulated",
        "model": "sim",
        "max_num_seqs": "16",
    }
    for lane in ({"pool": "default", "tier": "interactive"}, {"pool": "tiny", "tier": "batch"}):
        assert value(got, "llmqueue_queue_depth", **lane, state="waiting") == 0
        assert value(got, "llmqueue_queue_depth", **lane, state="unacked") == 0


def test_queue_depth_counts_waiting_and_delivered_requests_and_the_oldest_age(
    live_server, seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # Batch (no first-token target to shed at), one task slot, ~4 s of steps for the first
    # request: it is delivered (unacked, acks_late) while the next two wait in the broker.
    start_worker("default", *SIMULATED, "--slots", "1", "--sim-time-scale", "1")
    for _ in range(3):
        body = {"model": "sim", "prompt": "p", "max_tokens": 500}
        response = httpx.post(
            f"{live_server.url}/v1/completions",
            content=json.dumps(body),
            headers={"Authorization": f"Bearer {seeded.other_key}", "X-LLMQueue-Background": "1"},
            timeout=30,
        )
        assert response.status_code == 202, response.text
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() == 1, 10, "a claim")
    time.sleep(0.3)
    got = scrape(live_server)
    lane = {"pool": "default", "tier": "batch"}
    waiting = value(got, "llmqueue_queue_depth", **lane, state="waiting")
    unacked = value(got, "llmqueue_queue_depth", **lane, state="unacked")
    assert (waiting, unacked) == (
        clean_redis.llen("default.batch"),
        clean_redis.hlen("unacked"),
    )
    assert waiting + unacked == 3 and unacked >= 1
    oldest = PromptRequest.objects.filter(status=S.QUEUED).earliest("enqueued_at").enqueued_at
    age = value(got, "llmqueue_queue_oldest_age_seconds", **lane)
    assert age == pytest.approx(time.time() - oldest.timestamp(), abs=1.0)
    # the worker's figures are as of its last beat (every 0.5 s here)
    node = {"pool": "default", "node": _node(got)}
    wait_until(
        lambda: value(scrape(live_server), "llmqueue_engine_batch_fill", **node) == 1 / 16,
        5,
        "one of 16 sequences in use",
    )


def _node(got: Samples) -> str:
    [labels] = [dict(labels) for name, labels in got if name == "llmqueue_worker_info"]
    return labels["node"]


def test_metrics_are_only_for_allowed_scrapers(live_server, seeded: Seeded):
    with override_settings(LLMQUEUE_METRICS_ALLOW_IPS=[], LLMQUEUE_METRICS_TOKEN="s3cret"):
        refused = httpx.get(f"{live_server.url}/metrics", timeout=30)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "metrics_forbidden"
        wrong = httpx.get(
            f"{live_server.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=30
        )
        assert wrong.status_code == 403
        assert scrape(live_server, Authorization="Bearer s3cret")  # the token opens it


def test_cumulative_buckets_and_attainment_at_the_target():
    counts = {"0.5": 2, "1.0": 1, "1.5": 1, latency.INF: 1}
    buckets = dict(cumulative(counts))
    assert (buckets["0.25"], buckets["0.5"], buckets["1.0"], buckets["86400.0"]) == (0, 2, 3, 4)
    assert buckets[latency.INF] == 5
    assert attainment(counts, 1.0) == 3 / 5
    assert attainment({}, 1.0) is None


def test_the_drain_rate_metrics_show_is_the_one_admission_decides_with(live, seeded: Seeded):
    pipe = live.pipeline()
    record_drain(pipe, "default.interactive", 5, {}, now=T0 - 4)
    record_drain(pipe, "default.interactive", 7, {}, now=T0 - 1)
    pipe.execute()
    fields = live.hmget("llmqueue:drain:default.interactive", "count", "ts", "since")
    limits = Limits(
        tenant_id=seeded.tenant_id, tier_id=seeded.tier_id, pool="default",
        queue="default.interactive", requests_per_second=100, burst=100,
        tokens_per_minute=10**6, max_queue_depth=100, max_tier_share=1.0, max_wait_seconds=60,
    )  # fmt: skip
    decided = admit(limits, 10, now=T0).drain_rate_per_second
    assert decided > 0
    assert drain_rate(fields, T0, drain_tau_seconds()) == pytest.approx(decided, rel=1e-9)


@pytest.mark.parametrize("counted", [True, False])
def test_with_metrics_off_admission_counts_usage_only(live, seeded: Seeded, counted: bool):
    limits = Limits(
        tenant_id=seeded.tenant_id, tier_id=seeded.tier_id, pool="default",
        queue="default.interactive", requests_per_second=100, burst=100,
        tokens_per_minute=10**6, max_queue_depth=100, max_tier_share=1.0, max_wait_seconds=60,
    )  # fmt: skip
    with override_settings(LLMQUEUE_METRICS=counted):
        assert admit(limits, 10, now=T0).admitted
    usage_keys = live.keys("llmqueue:usage:*")
    metric_keys = live.keys("llmqueue:totals:*") + live.keys("llmqueue:admissions:*")
    assert (len(usage_keys), len(metric_keys)) == (1, 2 if counted else 0)

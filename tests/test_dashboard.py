"""The admin's queue dashboard shows the state it was given: depth, rates, charts, live workers."""

from __future__ import annotations

import re
import time

import pytest
import redis
from django.test import Client
from django.urls import reverse

from contract import latency
from llmqueue import latencies
from llmqueue.metrics.dashboard import quantile
from llmqueue.metrics.svg import line_chart
from llmqueue.models import PromptRequest, Tenant
from tests.conftest import SIMULATED, Seeded, WorkerFactory
from tests.test_cancel import ask
from workers.depth_history import record_depths

pytestmark = pytest.mark.django_db(transaction=True)


def row_cells(page: str, attribute: str, value: str) -> dict[str, str]:
    """The classed cells of the table row marked `attribute="value"`."""
    row = re.search(rf'<tr {attribute}="{re.escape(value)}">(.*?)</tr>', page, re.S)
    assert row is not None, f"no row {value} on the page"
    return {
        name: text.strip()
        for name, text in re.findall(r'<td class="([\w-]+)">(.*?)</td>', row[1], re.S)
    }


def test_the_dashboard_shows_each_queue_its_rates_its_hour_and_the_live_workers(
    live_server, seeded: Seeded, clean_redis: redis.Redis, start_worker: WorkerFactory,
    admin_client: Client,
):  # fmt: skip
    # A worker that serves only the batch tier: interactive requests stay queued.
    worker = start_worker(
        "default", *SIMULATED, "--sim-time-scale", "0", "--queues", "default.batch"
    )
    Tenant.objects.filter(pk=seeded.tenant_id).update(tokens_per_minute=600)
    assert ask(live_server, seeded.key).status_code == 202  # admitted, waits
    assert ask(live_server, seeded.key).status_code == 429  # its tokens are held: rejected
    for _ in range(2):
        assert ask(live_server, seeded.other_key, max_tokens=2, background=False).status_code == 200
    record_depths(clean_redis, ["default.interactive", "default.batch"])
    seen = [(latency.QUEUE, seeded.tier_id, 0.2), (latency.QUEUE, seeded.tier_id, 0.4)]
    latencies_pipe = clean_redis.pipeline()
    latencies.count(latencies_pipe, seen)
    latencies_pipe.execute()

    page = admin_client.get(reverse("llmqueue-dashboard")).content.decode()
    interactive = row_cells(page, "data-queue", "default.interactive")
    assert interactive == {
        "waiting": "1", "unacked": "0", "oldest": interactive["oldest"], "finished": "0.0",
        "rejected": "50%", "slo": "–",
    }  # fmt: skip
    assert re.fullmatch(r"\d+ s", interactive["oldest"])
    batch = row_cells(page, "data-queue", "default.batch")
    assert (batch["waiting"], batch["finished"], batch["rejected"]) == ("0", "0.4", "0%")
    assert row_cells(page, "data-queue", "tiny.interactive")["waiting"] == "0"
    workers = row_cells(page, "data-node", worker.node)
    assert workers["in-engine"] == "0 / 16"
    # The hour: depth sampled for both queues, p99 wait for interactive only.
    assert page.count('data-series="default.interactive"') == 1
    assert page.count('data-series="interactive"') == 1
    assert "batch (no data)" in page


def test_the_dashboard_is_for_staff_only(seeded: Seeded, client: Client):
    answer = client.get(reverse("llmqueue-dashboard"))
    assert answer.status_code == 302 and "/admin/login/" in answer["Location"]


def test_the_admin_index_links_the_dashboard(seeded: Seeded, admin_client: Client):
    page = admin_client.get(reverse("admin:index")).content.decode()
    assert f'href="{reverse("llmqueue-dashboard")}"' in page


def test_quantiles_are_interpolated_within_their_bucket_as_prometheus_does():
    counts = {"0.1": 50, "0.25": 50}
    assert quantile(counts, 0.5) == pytest.approx(0.1)
    assert quantile(counts, 0.99) == pytest.approx(0.1 + 0.15 * 49 / 50)
    assert quantile({latency.INF: 3}, 0.99) == latency.BUCKETS[-1]
    assert quantile({}, 0.99) is None


def test_a_chart_escapes_its_labels_and_plots_each_point(seeded: Seeded):
    from llmqueue.metrics.dashboard import Series

    now = latency.minute_of(time.time())
    svg = line_chart("t", "s", [Series("<x>", [(now - 1, 1.0), (now, 2.0)])], (now - 59, now))
    assert "<x>" not in svg and "&lt;x&gt;" in svg
    [points] = re.findall(r'points="([^"]+)"', svg)
    assert len(points.split()) == 2


def test_the_dashboard_shows_each_unfinished_bulk_job_line_by_line(
    seeded: Seeded, clean_redis: redis.Redis, admin_client: Client
):
    from tests.test_batches import line, submit

    batch = submit(Client(), seeded.key, [line(f"r{i}") for i in range(4)])  # no pacer: held
    PromptRequest.objects.filter(custom_id="r0").update(status=PromptRequest.Status.SUCCEEDED)
    PromptRequest.objects.filter(custom_id="r1").update(status=PromptRequest.Status.RUNNING)
    page = admin_client.get(reverse("llmqueue-dashboard")).content.decode()
    cells = row_cells(page, "data-job", batch["id"])
    assert (cells["status"], cells["held"], cells["running"], cells["succeeded"]) == (
        "in_progress",
        "2",
        "1",
        "1",
    )
    assert '<progress value="25" max="100"></progress> 1 / 4' in cells["progress"]

"""docs/OPERATIONS.md, the alert rules and the Grafana dashboard name only metrics /metrics
exports, and the docs every one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.core import Metric

from llmqueue.metrics import exposition, readings
from tests.conftest import Seeded

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bllmqueue_[a-z_]+\b")


def families() -> list[Metric]:
    empty = readings.Readings()
    return [
        *exposition.queue_metrics(empty),
        *exposition.counter_metrics(empty),
        *exposition.latency_metrics(empty),
        *exposition.worker_metrics(empty),
    ]


def exported_names() -> set[str]:
    suffixes = {
        "counter": ["_total"],
        "histogram": ["", "_bucket", "_count", "_sum"],
        "info": ["_info"],
        "gauge": [""],
    }
    return {f.name + s for f in families() for s in suffixes[f.type]}


def test_every_metric_the_docs_alerts_and_dashboard_name_is_exported():
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    expressions = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    grafana = json.loads((REPO / "deploy/grafana/llmqueue.json").read_text())
    expressions += " ".join(t["expr"] for p in grafana["panels"] for t in p["targets"])
    named = set(NAME.findall(expressions)) | set(
        NAME.findall((REPO / "docs/OPERATIONS.md").read_text())
    )
    assert named - exported_names() == set()


def test_every_exported_metric_is_documented():
    documented = (REPO / "docs/OPERATIONS.md").read_text()
    shown = {f.name + ("_total" if f.type == "counter" else "") for f in families()}
    shown = {name + "_info" if name == "llmqueue_worker" else name for name in shown}
    assert {name for name in shown if f"`{name}" not in documented} == set()


PROMTOOL = shutil.which("promtool")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus")
        pytest.skip("no promtool here (apt-get install prometheus); CI runs this test")
    return subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_accepts_the_alert_rules_and_the_scrape_config():
    rules = promtool("check", "rules", str(REPO / "deploy/prometheus/alerts.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool(
        "check", "config", "--syntax-only", str(REPO / "deploy/prometheus/prometheus.yml")
    )
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.mark.django_db(transaction=True)
def test_promtool_finds_nothing_to_lint_in_a_real_scrape(live_server, seeded: Seeded):
    body = {"model": "sim", "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": "Bearer sk-nobody"}
    httpx.post(f"{live_server.url}/v1/completions", json=body, headers=headers, timeout=30)
    scraped = httpx.get(f"{live_server.url}/metrics", timeout=30)
    assert scraped.status_code == 200 and "llmqueue_api_errors_total" in scraped.text
    lint = promtool("check", "metrics", stdin=scraped.text)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")

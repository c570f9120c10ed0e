"""docs/OPERATIONS.md and the alert rules name only metrics /metrics exports, and every one."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client.core import Metric

from llmqueue.metrics import exposition, readings

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


def test_every_metric_the_docs_and_alerts_name_is_exported():
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    expressions = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    named = set(NAME.findall(expressions)) | set(
        NAME.findall((REPO / "docs/OPERATIONS.md").read_text())
    )
    assert named - exported_names() == set()


def test_every_exported_metric_is_documented():
    documented = (REPO / "docs/OPERATIONS.md").read_text()
    shown = {f.name + ("_total" if f.type == "counter" else "") for f in families()}
    shown = {name + "_info" if name == "llmqueue_worker" else name for name in shown}
    assert {name for name in shown if f"`{name}" not in documented} == set()

"""Isolation between tenants and the secrets around them (issue 14, part 8): one tenant's key
cannot see, cancel, list or delete another's requests, batches or files; keys are stored hashed;
the operator pages are for staff; settings refuse to start production without a secret key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import redis
from django.test import Client

from llmqueue.apikeys import hash_key
from llmqueue.models import ApiKey, BulkJob, PromptRequest, StoredFile
from tests.conftest import REPO, Seeded, pretend_live
from tests.test_batches import auth, jsonl, line, submit, upload

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def owned_by_b(client: Client, b_key: str) -> dict[str, str]:
    """One of each: a background request, a file, a batch (its lines held: no pacer runs)."""
    body = {"model": "sim", "prompt": "b's secret prompt", "max_tokens": 4, "background": True}
    request = client.post(
        "/v1/completions", json.dumps(body), content_type="application/json", **auth(b_key)
    )
    assert request.status_code == 202, request.content
    file_id = upload(client, b_key, jsonl([line("b-1")])).json()["id"]
    batch = submit(client, b_key, [line("b-2")])
    return {"request": request.json()["id"], "file": file_id, "batch": batch["id"]}


def snapshot() -> list[Any]:
    return [
        sorted(PromptRequest.objects.values_list("id", "status")),
        sorted(BulkJob.objects.values_list("id", "status")),
        sorted(StoredFile.objects.values_list("id", flat=True)),
    ]


def test_a_tenant_cannot_read_cancel_list_or_delete_anothers_work(
    seeded: Seeded, clean_redis: redis.Redis
):
    pretend_live(clean_redis, "default")
    client = Client()
    b = owned_by_b(client, seeded.other_key)
    before = snapshot()
    a = auth(seeded.key)
    answers = {
        "GET request": client.get(f"/v1/requests/{b['request']}", **a),
        "cancel request": client.post(f"/v1/requests/{b['request']}/cancel", **a),
        "GET file": client.get(f"/v1/files/{b['file']}", **a),
        "GET file content": client.get(f"/v1/files/{b['file']}/content", **a),
        "DELETE file": client.delete(f"/v1/files/{b['file']}", **a),
        "GET batch": client.get(f"/v1/batches/{b['batch']}", **a),
        "cancel batch": client.post(f"/v1/batches/{b['batch']}/cancel", **a),
    }
    for what, answer in answers.items():
        # As unknown as an id that never existed: nothing says it is someone else's.
        assert answer.status_code == 404, what
        assert answer.json()["error"]["type"] == "invalid_request_error", what
    assert client.get("/v1/files", **a).json()["data"] == []
    assert client.get("/v1/batches", **a).json()["data"] == []
    assert snapshot() == before  # nothing cancelled, deleted or changed
    # B still sees all of it.
    assert client.get(f"/v1/requests/{b['request']}", **auth(seeded.other_key)).status_code == 200
    assert client.get(f"/v1/files/{b['file']}", **auth(seeded.other_key)).status_code == 200
    assert client.get(f"/v1/batches/{b['batch']}", **auth(seeded.other_key)).status_code == 200


def test_keys_are_stored_only_as_their_hash(seeded: Seeded):
    for key, tenant in ((seeded.key, "acme"), (seeded.other_key, "globex")):
        stored = ApiKey.objects.get(tenant__name=tenant)
        values = [str(getattr(stored, f.attname)) for f in ApiKey._meta.concrete_fields]
        assert not any(key in value for value in values)  # the plaintext is nowhere in the row
        assert stored.key_hash == hash_key(key)


@pytest.mark.parametrize(
    "path", ["/admin/", "/admin/queue-dashboard/", "/admin/llmqueue/tenant/", "/metrics"]
)
def test_operator_pages_are_not_for_tenants_or_strangers(seeded: Seeded, path: str):
    # From another host: /metrics trusts only localhost without its token by default.
    client = Client(REMOTE_ADDR="203.0.113.9")
    for headers in ({}, auth(seeded.key)):
        answer = client.get(path, **headers)
        # The admin sends strangers to its login; /metrics wants its own token.
        assert answer.status_code in (302, 401, 403), (path, answer.status_code)
        if answer.status_code == 302:
            assert answer["Location"].startswith("/admin/login/")


def settings_start(**env: str) -> subprocess.CompletedProcess[str]:
    """Load project.settings in a fresh interpreter with exactly `env` for the Django knobs."""
    clean = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    clean.update(DJANGO_SETTINGS_MODULE="project.settings", **env)
    code = "import django; django.setup(); from django.conf import settings; print(settings.DEBUG)"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=clean, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_production_settings_refuse_to_start_without_a_secret_key():
    refused = settings_start()
    assert refused.returncode != 0
    assert "SECRET_KEY is not set" in refused.stderr
    started = settings_start(SECRET_KEY="x" * 50)
    assert started.returncode == 0 and started.stdout.strip() == "False"  # DEBUG off by default
    demo = settings_start(LLMQUEUE_DEMO="true")
    assert demo.returncode == 0

"""The OpenAI Files and Batch APIs: validation before anything is stored, the round trip through
the official SDK on a simulated worker, cancel and expiry, and a 10,000-line batch stored fast."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import openai
import pytest
import redis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.test.utils import override_settings
from django.utils import timezone

from contract.keys import bucket_key
from llmqueue.bulk.finalize import advance_jobs
from llmqueue.bulk.pacer import Pacer
from llmqueue.models import BulkJob, PromptRequest, StoredFile, Tier
from tests.conftest import SIMULATED, Seeded, WorkerFactory, queued_messages, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def line(custom_id: str, prompt: str = "hello there", max_tokens: int = 8, **extra: Any) -> dict:
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def auth(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def upload(client: Client, key: str, data: bytes, purpose: str = "batch") -> Any:
    upload = SimpleUploadedFile("input.jsonl", data, content_type="application/jsonl")
    return client.post("/v1/files", {"purpose": purpose, "file": upload}, **auth(key))


def create_batch(
    client: Client, key: str, file_id: str, tier: str | None = None, **extra: Any
) -> Any:
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    headers = auth(key) | ({"HTTP_X_LLMQUEUE_TIER": tier} if tier else {})
    return client.post("/v1/batches", {**body, **extra}, content_type="application/json", **headers)


def submit(client: Client, key: str, lines: list[Any], **extra: Any) -> dict[str, Any]:
    file_id = upload(client, key, jsonl(lines)).json()["id"]
    response = create_batch(client, key, file_id, **extra)
    assert response.status_code == 200, response.content
    return dict(response.json())


def file_lines(client: Client, key: str, file_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/files/{file_id}/content", **auth(key))
    return [json.loads(x) for x in b"".join(response.streaming_content).splitlines()]


def test_files_upload_list_retrieve_content_delete_and_size_cap(seeded: Seeded, clean_redis):
    client = Client()
    data = jsonl([line("a")])
    made = upload(client, seeded.key, data).json()
    assert made["object"] == "file" and made["purpose"] == "batch" and made["bytes"] == len(data)
    assert made["filename"] == "input.jsonl" and made["id"].startswith("file-")
    listed = client.get("/v1/files", **auth(seeded.key)).json()
    assert [f["id"] for f in listed["data"]] == [made["id"]] and listed["has_more"] is False
    assert client.get(f"/v1/files/{made['id']}", **auth(seeded.key)).json() == made
    content = client.get(f"/v1/files/{made['id']}/content", **auth(seeded.key))
    assert b"".join(content.streaming_content) == data
    # Another tenant's file is as unknown as a missing one.
    other = client.get(f"/v1/files/{made['id']}", **auth(seeded.other_key))
    assert other.status_code == 404 and other.json()["error"]["code"] == "file_not_found"
    bad = upload(client, seeded.key, data, purpose="fine-tune")
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_purpose"
    with override_settings(LLMQUEUE_BULK_MAX_FILE_BYTES=100):
        big = upload(client, seeded.key, jsonl([line(str(i)) for i in range(5)]))
    assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
    assert StoredFile.objects.count() == 1
    deleted = client.delete(f"/v1/files/{made['id']}", **auth(seeded.key)).json()
    assert deleted == {"id": made["id"], "object": "file", "deleted": True}
    assert StoredFile.objects.count() == 0


def test_a_bad_line_fails_the_batch_at_validating_with_its_line_and_nothing_is_queued(
    seeded: Seeded, clean_redis: redis.Redis
):
    client = Client()
    lines = [
        line("ok"),
        b"{not json",
        {**line("wrong-url"), "url": "/v1/embeddings"},
        line("ok"),  # a duplicate custom_id
        line("too-long", max_tokens=100_000),
        {**line("get"), "method": "GET"},
        line("unknown", logprobs=3),
    ]
    batch = submit(client, seeded.key, lines)
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [
        (2, "invalid_json"),
        (3, "invalid_url"),
        (4, "duplicate_custom_id"),
        (5, "invalid_parameter"),
        (6, "invalid_method"),
        (7, "unknown_parameter"),
    ]
    assert batch["errors"]["object"] == "list"
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert PromptRequest.objects.count() == 0 and queued_messages(clean_redis) == 0
    # Refused requests: nothing stored at all.
    missing = create_batch(client, seeded.key, "file-nope")
    assert missing.status_code == 404
    file_id = upload(client, seeded.key, jsonl([line("a")])).json()["id"]
    window = create_batch(client, seeded.key, file_id, completion_window="1h")
    assert window.status_code == 422 and window.json()["error"]["param"] == "completion_window"
    endpoint = create_batch(client, seeded.key, file_id, endpoint="/v1/embeddings")
    assert endpoint.status_code == 422 and endpoint.json()["error"]["code"] == "invalid_endpoint"
    assert BulkJob.objects.count() == 1 and PromptRequest.objects.count() == 0
    assert queued_messages(clean_redis) == 0


def test_batches_list_with_cursor_pagination(seeded: Seeded, clean_redis):
    client = Client()
    ids = [submit(client, seeded.key, [line("a")])["id"] for _ in range(3)]
    page = client.get("/v1/batches?limit=2", **auth(seeded.key)).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    rest = client.get(f"/v1/batches?limit=2&after={page['last_id']}", **auth(seeded.key)).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert client.get("/v1/batches", **auth(seeded.other_key)).json()["data"] == []


def test_openai_sdk_batch_round_trip_on_a_simulated_worker(
    live_server, seeded: Seeded, bulk_tier: Tier, start_worker: WorkerFactory, pacer_thread: None
):
    start_worker("default", *SIMULATED)
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=seeded.key, max_retries=0)
    lines = [line(f"req-{i}", prompt=f"prompt number {i}", max_tokens=4 + i % 3) for i in range(30)]
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"owner": "tests"},
    )
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 30
    assert batch.metadata == {"owner": "tests"}
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.completed == 30 and batch.request_counts.failed == 0
    assert batch.completed_at and batch.finalizing_at and batch.error_file_id is None
    assert batch.output_file_id is not None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(30)]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    usage = [o["response"]["body"]["usage"]["completion_tokens"] for o in out]
    assert usage == [4 + i % 3 for i in range(30)]
    assert {r.tier.name for r in PromptRequest.objects.select_related("tier")} == {"batch"}
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    # A chat batch on the same tier, through the SDK's chat endpoint.
    chats = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat}]
    uploaded = client.files.create(file=("c.jsonl", jsonl(chats)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 60, "chat batch")
    done = client.batches.retrieve(batch.id)
    assert done.output_file_id is not None
    [out_line] = [
        json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()
    ]
    assert out_line["response"]["body"]["object"] == "chat.completion"


def test_cancel_keeps_finished_output_and_no_queued_line_reaches_an_engine(
    seeded: Seeded, bulk_tier: Tier
):
    client = Client()
    bulk_tier.max_queue_depth = 10  # the pacer queues at most 5 lines: the rest stays held
    bulk_tier.save()
    batch = submit(client, seeded.key, [line(f"r{i}") for i in range(20)])
    pacer = Pacer()
    assert pacer.release_once() == 5
    first = PromptRequest.objects.filter(status=S.QUEUED).order_by("line").first()
    assert first is not None
    PromptRequest.objects.filter(pk=first.pk).update(
        status=S.SUCCEEDED, output_text="done", prompt_tokens=3, completion_tokens=1,
        finish_reason="stop", finished_at=timezone.now(),
    )  # fmt: skip
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", **auth(seeded.key)).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    statuses = dict(PromptRequest.objects.values_list("custom_id", "status"))
    assert statuses == {"r0": S.SUCCEEDED, **{f"r{i}": S.CANCELLED for i in range(1, 20)}}
    assert pacer.release_once() == 0
    advance_jobs()
    done = client.get(f"/v1/batches/{batch['id']}", **auth(seeded.key)).json()
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 20, "completed": 1, "failed": 19}
    errors = file_lines(client, seeded.key, done["error_file_id"])
    assert [e["custom_id"] for e in errors] == [f"r{i}" for i in range(1, 20)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    [kept] = file_lines(client, seeded.key, done["output_file_id"])
    assert kept["custom_id"] == "r0"
    assert kept["response"]["body"]["choices"][0]["text"] == "done"
    again = client.post(f"/v1/batches/{batch['id']}/cancel", **auth(seeded.key))
    assert again.status_code == 409


def test_lines_not_done_by_the_window_expire_and_the_batch_ends_expired(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    client = Client()
    bulk_tier.max_queue_depth = 4
    bulk_tier.save()
    batch = submit(client, seeded.key, [line(f"r{i}") for i in range(6)])
    job = BulkJob.objects.get(pk=batch["id"])
    assert set(PromptRequest.objects.values_list("deadline_at", flat=True)) == {job.expires_at}
    assert Pacer().release_once() == 2
    tokens = float(clean_redis.hget(bucket_key("tokens", seeded.tenant_id), "tokens") or 0)
    advance_jobs(job.expires_at + timedelta(seconds=1))
    done = client.get(f"/v1/batches/{batch['id']}", **auth(seeded.key)).json()
    assert done["status"] == "expired" and done["expired_at"] is not None
    assert done["output_file_id"] is None
    errors = file_lines(client, seeded.key, done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"r{i}", "batch_expired") for i in range(6)
    ]
    # The two released lines gave their reservation back.
    after = float(clean_redis.hget(bucket_key("tokens", seeded.tenant_id), "tokens") or 0)
    reserved = PromptRequest.objects.values_list("reserved_tokens", flat=True)[0]
    assert after >= tokens + 2 * reserved - 1


def test_a_10k_line_batch_is_validated_and_stored_within_10_seconds(seeded: Seeded, clean_redis):
    client = Client()
    lines = [line(f"r{i}", prompt=f"summarise item {i} of the list") for i in range(10_000)]
    file_id = upload(client, seeded.key, jsonl(lines)).json()["id"]
    started = time.perf_counter()
    response = create_batch(client, seeded.key, file_id)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200 and response.json()["status"] == "in_progress"
    assert PromptRequest.objects.filter(status=S.HELD).count() == 10_000
    assert queued_messages(clean_redis) == 0  # held: the pacer releases them
    print(f"10k-line POST /v1/batches: {elapsed:.2f} s")
    assert elapsed <= 10


def test_admin_lists_jobs_with_progress_and_counts(seeded: Seeded, admin_client: Client):
    batch = submit(Client(), seeded.key, [line(f"r{i}") for i in range(4)])
    PromptRequest.objects.filter(custom_id="r0").update(status=S.SUCCEEDED)
    page = admin_client.get("/admin/llmqueue/bulkjob/")
    assert page.status_code == 200
    html = page.content.decode()
    assert batch["id"] in html
    assert '<progress value="25" max="100" title="1 of 4 lines done"></progress> 25%' in html


def test_a_held_line_cancelled_alone_is_never_released(seeded: Seeded, clean_redis):
    client = Client()
    submit(client, seeded.key, [line("a"), line("b")])
    held = PromptRequest.objects.get(custom_id="a")
    answer = client.post(f"/v1/requests/{held.id}/cancel", **auth(seeded.key)).json()
    assert answer["status"] == "cancelled"
    assert Pacer().release_once() == 1
    assert dict(PromptRequest.objects.values_list("custom_id", "status")) == {
        "a": S.CANCELLED,
        "b": S.QUEUED,
    }
    assert queued_messages(clean_redis) == 1


def test_a_batch_runs_on_the_flex_tier_unless_the_tier_header_names_another(
    seeded: Seeded, bulk_tier: Tier
):
    client = Client()
    file_id = upload(client, seeded.key, jsonl([line("a")])).json()["id"]
    create_batch(client, seeded.key, file_id)
    named = create_batch(client, seeded.key, file_id, tier="interactive")
    assert named.status_code == 200
    tiers = PromptRequest.objects.order_by("enqueued_at").values_list("tier__name", "queue")
    assert list(tiers) == [("batch", "default.batch"), ("interactive", "default.interactive")]
    # globex may not use the interactive tier: 403, nothing stored.
    other = upload(client, seeded.other_key, jsonl([line("a")])).json()["id"]
    refused = create_batch(client, seeded.other_key, other, tier="interactive")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "tier_not_allowed"
    assert BulkJob.objects.count() == 2

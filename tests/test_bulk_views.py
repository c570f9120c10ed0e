"""The /bulk/ pages: upload (JSONL or CSV) with bad lines refused by number and nothing stored,
tenant isolation, login, exact progress counts, cancel, results in input order, the progress
script served under the production server, and an upload run to its end on a simulated worker."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import redis
from django.contrib.auth import get_user_model
from django.contrib.staticfiles import finders
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from llmqueue.bulk.finalize import advance_jobs, render
from llmqueue.bulk.pacer import Pacer
from llmqueue.bulk.uploads import Upload, operator_caller, submit_upload
from llmqueue.models import BulkJob, PromptRequest, StoredFile, Tenant, Tier
from tests.conftest import (
    REPO,
    SIMULATED,
    Seeded,
    WorkerFactory,
    assert_nothing_enqueued,
    queued_messages,
    wait_until,
)
from tests.test_batches import jsonl, line

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
PASSWORD = "a long pass phrase"


def member(tenant_id: int, username: str = "alice", password: str | None = None) -> Any:
    """A non-staff user who belongs to tenant `tenant_id` (no password: force_login is enough,
    and hashing one costs a good part of a second here)."""
    user = get_user_model().objects.create_user(username, password=password)
    Tenant.objects.get(pk=tenant_id).members.add(user)
    return user


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post_upload(client: Client, name: str, data: bytes, tenant_id: int, **fields: Any) -> Any:
    upload = SimpleUploadedFile(name, data)
    return client.post("/bulk/new/", {"file": upload, "tenant": tenant_id, **fields})


def job_of(tenant_id: int, lines: list[Any], tier: str | None = None) -> BulkJob:
    """A job stored as the upload page stores it."""
    return submit_upload(operator_caller(tenant_id, tier), Upload("in.jsonl", jsonl(lines)))


def assert_nothing_stored(client: redis.Redis) -> None:
    assert (BulkJob.objects.count(), StoredFile.objects.count()) == (0, 0)
    assert_nothing_enqueued(client)


def test_anonymous_visitors_are_sent_to_the_login_page(seeded: Seeded):
    job = job_of(seeded.tenant_id, [line("a")])
    client = Client()
    for url in (
        "/bulk/",
        "/bulk/new/",
        f"/bulk/{job.id}/",
        f"/bulk/{job.id}/progress.json",
        f"/bulk/{job.id}/results.jsonl",
    ):
        response = client.get(url)
        assert (response.status_code, response["Location"]) == (302, f"/bulk/login/?next={url}")
    cancel = client.post(f"/bulk/{job.id}/cancel/")
    assert cancel.status_code == 302 and cancel["Location"].startswith("/bulk/login/")
    assert BulkJob.objects.get().status == BulkJob.Status.IN_PROGRESS
    # The login page takes a user who is not staff (the admin's would not) and sends them on.
    member(seeded.tenant_id, password=PASSWORD)
    page = client.get("/bulk/login/")
    assert page.status_code == 200 and b"/static/admin/css/base.css" in page.content
    login = client.post(
        "/bulk/login/", {"username": "alice", "password": PASSWORD, "next": f"/bulk/{job.id}/"}
    )
    assert (login.status_code, login["Location"]) == (302, f"/bulk/{job.id}/")
    assert client.get(f"/bulk/{job.id}/").status_code == 200


def test_a_bad_line_refuses_the_upload_by_line_number_and_stores_nothing(
    seeded: Seeded, clean_redis: redis.Redis
):
    client = logged_in(member(seeded.tenant_id))
    lines = [
        line("ok"),
        b"{not json",
        line("too-long", max_tokens=100_000),
        line("ok"),  # a repeated custom_id
        line("fine"),
    ]
    response = post_upload(client, "prompts.jsonl", jsonl(lines), seeded.tenant_id)
    assert response.status_code == 400
    found = [(e.line, e.code) for e in response.context["line_errors"]]
    assert found == [(2, "invalid_json"), (3, "invalid_parameter"), (4, "duplicate_custom_id")]
    html = response.content.decode()
    assert "Nothing was stored or queued: 3 problems in the file, listed by line below." in html
    for number in (2, 3, 4):
        assert f'<tr data-line="{number}">' in html and f"<td>line {number}</td>" in html
    assert_nothing_stored(clean_redis)


def test_a_csv_upload_becomes_a_job_of_held_chat_lines(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    client = logged_in(member(seeded.tenant_id))
    data = (
        b"custom_id,prompt,max_tokens,temperature,system\n"
        b"first,Say hello,5,0.5,\n"
        b',"A prompt over\ntwo lines",7,,Be brief.\n'
        b"\n"
        b"last,Bye,3,,\n"
    )
    response = post_upload(client, "prompts.csv", data, seeded.tenant_id, model="sim")
    job = BulkJob.objects.get()
    assert (response.status_code, response["Location"]) == (302, f"/bulk/{job.id}/")
    assert (job.status, job.total, job.model, job.endpoint) == (
        BulkJob.Status.IN_PROGRESS, 3, "sim", "/v1/chat/completions",
    )  # fmt: skip
    assert job.tier == bulk_tier  # acme may use the flex tier: a job's default, as for a batch
    rows = PromptRequest.objects.filter(job=job).order_by("line")
    assert [(r.line, r.custom_id, r.status, r.params["max_tokens"]) for r in rows] == [
        (2, "first", S.HELD, 5),
        (3, "line-3", S.HELD, 7),
        (6, "last", S.HELD, 3),
    ]
    assert rows[1].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "A prompt over\ntwo lines"},
    ]
    assert rows[0].params["temperature"] == 0.5
    # The input is kept as the Batch API's JSONL, a row a line.
    stored = [json.loads(x) for x in job.input_file.content.open("rb").read().splitlines()]
    assert [(x["custom_id"], x["url"], x["body"]["model"]) for x in stored] == [
        ("first", "/v1/chat/completions", "sim"),
        ("line-3", "/v1/chat/completions", "sim"),
        ("last", "/v1/chat/completions", "sim"),
    ]
    assert job.input_file.filename == "prompts.jsonl"
    assert queued_messages(clean_redis) == 0  # held: the pacer releases them


def test_bad_csv_rows_are_reported_by_the_line_they_start_on(
    seeded: Seeded, clean_redis: redis.Redis
):
    client = logged_in(member(seeded.tenant_id))
    data = (
        b"prompt,max_tokens\n"
        b'"two\nlines",many\n'  # lines 2-3: not a number, refused by the body's own validation
        b",4\n"  # line 4: no prompt
        b"fine,4,extra\n"  # line 5: a value too many
        b"ok,4\n"
    )
    response = post_upload(client, "p.csv", data, seeded.tenant_id, model="sim")
    assert response.status_code == 400
    found = [(e.line, e.code, e.param) for e in response.context["line_errors"]]
    assert found == [
        (2, "invalid_type", "max_tokens"),
        (4, "missing_prompt", "prompt"),
        (5, "invalid_csv_row", None),
    ]
    header = post_upload(client, "p.csv", b"question,max_tokens\nhi,3\n", seeded.tenant_id)
    assert header.status_code == 400
    [error] = header.context["line_errors"]
    assert (error.line, error.code) == (1, "invalid_csv_header")
    assert "Unknown column 'question'" in error.message
    assert_nothing_stored(clean_redis)


def test_users_see_only_their_tenants_jobs_and_staff_see_all(
    seeded: Seeded, clean_redis: redis.Redis
):
    globex = Tenant.objects.get(name="globex").pk
    mine, theirs = job_of(seeded.tenant_id, [line("a")]), job_of(globex, [line("b")])
    client = logged_in(member(seeded.tenant_id))
    for url in (f"/bulk/{theirs.id}/", f"/bulk/{theirs.id}/progress.json",
                f"/bulk/{theirs.id}/results.jsonl"):  # fmt: skip
        assert client.get(url).status_code == 404, url
    assert client.post(f"/bulk/{theirs.id}/cancel/").status_code == 404
    assert BulkJob.objects.get(pk=theirs.pk).status == BulkJob.Status.IN_PROGRESS
    listed = client.get("/bulk/")
    assert [j.id for j in listed.context["page"]] == [mine.id]
    assert theirs.id not in listed.content.decode()
    # Another tenant is not among the upload's choices: refused, nothing stored.
    refused = post_upload(client, "in.jsonl", jsonl([line("c")]), globex)
    assert refused.status_code == 400 and "tenant" in refused.context["form"].errors
    assert BulkJob.objects.count() == 2 and PromptRequest.objects.count() == 2
    staff = get_user_model().objects.create_user("ops", is_staff=True)
    everything = logged_in(staff).get("/bulk/")
    assert [j.id for j in everything.context["page"]] == [theirs.id, mine.id]
    assert logged_in(staff).get(f"/bulk/{theirs.id}/progress.json").status_code == 200
    assert queued_messages(clean_redis) == 0


def test_a_tier_the_tenant_may_not_use_is_refused_on_the_page(
    seeded: Seeded, clean_redis: redis.Redis
):
    client = logged_in(member(seeded.tenant_id))
    batch = Tier.objects.get(name="batch")  # acme may not use it (no bulk_tier fixture)
    response = post_upload(client, "in.jsonl", jsonl([line("a")]), seeded.tenant_id, tier=batch.pk)
    assert response.status_code == 400
    [error] = response.context["form"].non_field_errors()
    assert error == "Tenant 'acme' may not use tier 'batch'; its tiers: interactive."
    assert "may not use tier &#x27;batch&#x27;" in response.content.decode()
    assert_nothing_stored(clean_redis)


def test_progress_json_counts_each_status_exactly(seeded: Seeded):
    job = job_of(seeded.tenant_id, [line(f"r{i}") for i in range(7)])
    by_line = dict(
        zip(
            PromptRequest.objects.filter(job=job).order_by("line").values_list("pk", flat=True),
            [S.SUCCEEDED, S.SUCCEEDED, S.FAILED, S.RUNNING, S.QUEUED, S.HELD, S.HELD],
            strict=True,
        )
    )
    for pk, status in by_line.items():
        PromptRequest.objects.filter(pk=pk).update(status=status)
    client = logged_in(member(seeded.tenant_id))
    progress = client.get(f"/bulk/{job.id}/progress.json").json()
    assert progress == {
        "id": job.id,
        "status": "in_progress",
        "finished": False,
        "total": 7,
        "done": 3,
        "percent": 42,
        "counts": {
            "held": 2, "queued": 1, "running": 1, "succeeded": 2, "failed": 1, "expired": 0,
            "cancelled": 0,
        },
    }  # fmt: skip
    page = client.get(f"/bulk/{job.id}/").content.decode()
    assert '<progress value="3" max="7"' in page
    assert '<td data-count="succeeded">2</td>' in page and '<td data-count="held">2</td>' in page
    assert f'data-url="/bulk/{job.id}/progress.json"' in page


def test_the_job_page_loads_its_progress_script_from_static_files(seeded: Seeded):
    job = job_of(seeded.tenant_id, [line("a")])
    page = logged_in(member(seeded.tenant_id)).get(f"/bulk/{job.id}/").content.decode()
    assert '<script src="/static/llmqueue/bulk_progress.js" defer></script>' in page
    assert finders.find("llmqueue/bulk_progress.js") == str(
        REPO / "llmqueue/static/llmqueue/bulk_progress.js"
    )
    scripts = re.findall(r'<script src="([^"]+)"', page)
    assert scripts and all(src.startswith("/static/") for src in scripts)  # no CDN


def test_the_production_server_serves_the_pages_and_their_script(production_server: str):
    login = httpx.get(f"{production_server}/bulk/login/", timeout=10)
    assert login.status_code == 200 and "/static/admin/css/base.css" in login.text
    anonymous = httpx.get(f"{production_server}/bulk/", timeout=10)
    assert (anonymous.status_code, anonymous.headers["location"]) == (
        302,
        "/bulk/login/?next=/bulk/",
    )
    script = httpx.get(f"{production_server}/static/llmqueue/bulk_progress.js", timeout=10)
    assert script.status_code == 200
    assert script.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert script.text == (REPO / "llmqueue/static/llmqueue/bulk_progress.js").read_text()


def csrf_token(client: Client, url: str) -> str:
    match = re.search(
        r'name="csrfmiddlewaretoken" value="([^"]+)"', client.get(url).content.decode()
    )
    assert match, "no CSRF token on the page"
    return match.group(1)


def test_the_cancel_button_posts_with_csrf_and_cancels_the_job(
    seeded: Seeded, bulk_tier: Tier, clean_redis: redis.Redis
):
    bulk_tier.max_queue_depth = 4  # the pacer queues 2 lines, the rest stays held
    bulk_tier.save()
    job = job_of(seeded.tenant_id, [line(f"r{i}") for i in range(5)])
    assert Pacer().release_once() == 2
    client = Client(enforce_csrf_checks=True)
    client.force_login(member(seeded.tenant_id))
    url = f"/bulk/{job.id}/cancel/"
    assert client.post(url).status_code == 403  # no CSRF token: refused, nothing cancelled
    assert BulkJob.objects.get().status == BulkJob.Status.IN_PROGRESS
    token = csrf_token(client, f"/bulk/{job.id}/")
    response = client.post(url, {"csrfmiddlewaretoken": token})
    assert (response.status_code, response["Location"]) == (302, f"/bulk/{job.id}/")
    assert BulkJob.objects.get().status == BulkJob.Status.CANCELLING
    assert set(PromptRequest.objects.values_list("status", flat=True)) == {S.CANCELLED}
    advance_jobs()
    progress = client.get(f"/bulk/{job.id}/progress.json").json()
    assert (progress["status"], progress["finished"], progress["counts"]["cancelled"]) == (
        "cancelled", True, 5,
    )  # fmt: skip
    page = client.get(f"/bulk/{job.id}/").content.decode()
    assert 'id="cancel-form"' not in page  # a finished job has no cancel button
    again = client.post(url, {"csrfmiddlewaretoken": token}, follow=True)
    assert "only a running job is cancelled" in again.content.decode()


def finish(row: PromptRequest, succeeded: bool) -> None:
    """Record an outcome as a worker's recorder would."""
    fields: dict[str, Any] = {"finished_at": timezone.now()}
    if succeeded:
        fields |= {
            "status": S.SUCCEEDED,
            "output_text": f"out {row.custom_id}",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "finish_reason": "length",
        }
    else:
        fields |= {"status": S.FAILED, "error": "engine failure: RuntimeError: boom"}
    PromptRequest.objects.filter(pk=row.pk).update(**fields)


def download(client: Client, job: BulkJob) -> list[dict[str, Any]]:
    response = client.get(f"/bulk/{job.id}/results.jsonl")
    assert response.status_code == 200 and response["Content-Type"] == "application/jsonl"
    assert response["Content-Disposition"] == f'attachment; filename="{job.id}_results.jsonl"'
    return [json.loads(x) for x in b"".join(response.streaming_content).splitlines()]


def test_results_download_in_input_order_as_the_batch_files_render_them(seeded: Seeded):
    job = job_of(seeded.tenant_id, [line(f"r{i}") for i in range(6)])
    rows = list(PromptRequest.objects.filter(job=job).order_by("line"))
    for row in reversed(rows[:4]):  # finished last-first: the order must come from the input
        finish(row, succeeded=row.custom_id != "r2")
    client = logged_in(member(seeded.tenant_id))
    partial = download(client, job)  # r4 and r5 are still held: left out
    assert [(x["custom_id"], x["error"] and x["error"]["code"]) for x in partial] == [
        ("r0", None), ("r1", None), ("r2", "request_failed"), ("r3", None),
    ]  # fmt: skip
    assert partial[0]["response"]["body"]["choices"][0]["text"] == "out r0"
    for row in rows[4:]:
        finish(row, succeeded=True)
    advance_jobs()
    done = download(client, job)
    assert [x["custom_id"] for x in done] == [f"r{i}" for i in range(6)]
    output, errors = render(job)
    by_id = {x["custom_id"]: x for x in done}
    succeeded = [by_id[c] for c in ("r0", "r1", "r3", "r4", "r5")]
    assert [json.loads(x) for x in output.splitlines()] == succeeded
    assert [json.loads(x) for x in errors.splitlines()] == [by_id["r2"]]


def test_the_tenant_form_in_the_admin_edits_its_members(seeded: Seeded, admin_client: Client):
    page = admin_client.get(f"/admin/llmqueue/tenant/{seeded.tenant_id}/change/")
    assert page.status_code == 200 and 'name="members"' in page.content.decode()


def test_an_upload_from_the_page_completes_on_a_simulated_worker(
    seeded: Seeded,
    bulk_tier: Tier,
    clean_redis: redis.Redis,
    start_worker: WorkerFactory,
    pacer_thread: None,
):
    start_worker("default", *SIMULATED)
    client = logged_in(member(seeded.tenant_id))
    rows = "".join(f"q{i},prompt number {i},{2 + i % 3}\n" for i in range(12))
    data = f"custom_id,prompt,max_tokens\n{rows}".encode()
    response = post_upload(client, "q.csv", data, seeded.tenant_id, model="sim")
    assert response.status_code == 302
    job = BulkJob.objects.get()
    wait_until(
        lambda: client.get(f"/bulk/{job.id}/progress.json").json()["finished"], 60, "the job"
    )
    progress = client.get(f"/bulk/{job.id}/progress.json").json()
    assert (progress["status"], progress["done"], progress["counts"]["succeeded"]) == (
        "completed", 12, 12,
    )  # fmt: skip
    results = download(client, job)
    assert [x["custom_id"] for x in results] == [f"q{i}" for i in range(12)]
    tokens = [x["response"]["body"]["usage"]["completion_tokens"] for x in results]
    assert tokens == [2 + i % 3 for i in range(12)]
    assert {x["response"]["body"]["object"] for x in results} == {"chat.completion"}
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "every message to be acked")

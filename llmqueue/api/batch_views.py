"""HTTP views of the OpenAI Files and Batch APIs: thin, the logic is in llmqueue/bulk/."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse

from llmqueue.api import validation
from llmqueue.api.auth import Caller, authenticate
from llmqueue.api.body import declared_length, read_body
from llmqueue.api.errors import BadRequest, Conflict, InvalidParameter, NotFound, PayloadTooLarge
from llmqueue.api.responses import batch_body, file_body, list_body
from llmqueue.api.tiers import TIER_HEADER, caller_on_tier, on_bulk_tier
from llmqueue.api.views import api_endpoint
from llmqueue.bulk import files, jobs
from llmqueue.bulk.cancel import cancel_job
from llmqueue.models import BulkJob, StoredFile

MAX_PAGE = 100


def _page_limit(request: HttpRequest, default: int) -> int:
    raw = request.GET.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise BadRequest("'limit' must be an integer.", param="limit") from None
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidParameter(f"'limit' must be between 1 and {MAX_PAGE}.", param="limit")
    return limit


def _page(request: HttpRequest, rows: QuerySet[Any], default: int) -> tuple[list[Any], bool]:
    """Newest first, after the cursor `after` (an id of the previous page)."""
    limit = _page_limit(request, default)
    after = request.GET.get("after")
    if after:
        cursor = rows.filter(pk=after).first()
        if cursor is None:
            raise NotFound(f"No object {after!r} to list after.", param="after")
        rows = rows.filter(created_at__lte=cursor.created_at).exclude(
            created_at=cursor.created_at, pk__gte=cursor.pk
        )
    page = list(rows.order_by("-created_at", "-pk")[: limit + 1])
    return page[:limit], len(page) > limit


def _upload(request: HttpRequest, caller: Caller) -> HttpResponse:
    if (declared_length(request) or 0) > settings.LLMQUEUE_BULK_MAX_FILE_BYTES:
        raise PayloadTooLarge(
            f"Files take at most {settings.LLMQUEUE_BULK_MAX_FILE_BYTES} bytes.", param="file"
        )
    upload = request.FILES.get("file")
    if upload is None:
        raise BadRequest("Send the file as multipart field 'file'.", code="missing_parameter",
                         param="file")  # fmt: skip
    stored = files.store_upload(
        caller.tenant_id, request.POST.get("purpose", ""), upload, upload.name or "upload.jsonl"
    )
    return JsonResponse(file_body(stored))


@api_endpoint("GET", "POST")
def file_list(request: HttpRequest) -> HttpResponse:
    caller = authenticate(request)
    if request.method == "POST":
        return _upload(request, caller)
    rows = StoredFile.objects.filter(tenant_id=caller.tenant_id)
    if request.GET.get("purpose"):
        rows = rows.filter(purpose=request.GET["purpose"])
    page, more = _page(request, rows, default=MAX_PAGE)
    return JsonResponse(list_body([file_body(f) for f in page], more))


@api_endpoint("GET", "DELETE")
def file_detail(request: HttpRequest, file_id: str) -> HttpResponse:
    caller = authenticate(request)
    stored = files.own_file(caller.tenant_id, file_id)
    if request.method == "DELETE":
        files.delete_file(stored)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_body(stored))


@api_endpoint("GET")
def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    caller = authenticate(request)
    stored = files.own_file(caller.tenant_id, file_id)
    return FileResponse(
        stored.content.open("rb"), content_type="application/jsonl", filename=stored.filename
    )


def _batch_caller(request: HttpRequest) -> Caller:
    """The tenant on its bulk tier: the one its tier header names, else the flex tier when it
    may use one (OpenAI's tier for work that can wait), else its default tier."""
    header = request.headers.get(TIER_HEADER)
    if header is not None:
        return caller_on_tier(lambda fresh: authenticate(request, fresh), None, header)
    return on_bulk_tier(authenticate(request))


def _own_job(caller: Caller, batch_id: str) -> BulkJob:
    job = BulkJob.objects.filter(pk=batch_id, tenant_id=caller.tenant_id).first()
    if job is None:
        raise NotFound(f"No batch with id {batch_id!r}.", code="batch_not_found")
    return job


def _batch_response(job: BulkJob) -> JsonResponse:
    return JsonResponse(batch_body(job, jobs.line_counts(job)))


@api_endpoint("GET", "POST")
def batch_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        caller = _batch_caller(request)
        body = validation.parse_json_object(read_body(request))
        return _batch_response(jobs.create_job(caller, body))
    caller = authenticate(request)
    page, more = _page(request, BulkJob.objects.filter(tenant_id=caller.tenant_id), default=20)
    return JsonResponse(list_body([batch_body(j, jobs.line_counts(j)) for j in page], more))


@api_endpoint("GET")
def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    return _batch_response(_own_job(authenticate(request), batch_id))


@api_endpoint("POST")
def batch_cancel(request: HttpRequest, batch_id: str) -> HttpResponse:
    job = _own_job(authenticate(request), batch_id)
    if job.status not in (BulkJob.Status.VALIDATING, BulkJob.Status.IN_PROGRESS,
                          BulkJob.Status.CANCELLING):  # fmt: skip
        raise Conflict(f"Batch {batch_id} is {job.status}; only a running batch is cancelled.")
    return _batch_response(cancel_job(job))

"""Views of the /bulk/ pages, thin: the logic is in llmqueue/bulk/.

Every page needs a login; staff see every tenant's jobs, other users their tenants'
(llmqueue/bulk/access.py), and another tenant's job is a 404 like a missing one.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from llmqueue.api.errors import ApiError
from llmqueue.bulk.access import visible_jobs, visible_tenants
from llmqueue.bulk.cancel import cancel_job
from llmqueue.bulk.lines import LineError
from llmqueue.bulk.progress import job_progress, with_done
from llmqueue.bulk.results import result_lines
from llmqueue.bulk.uploads import UploadRefused, operator_caller, submit_upload
from llmqueue.bulk_pages.forms import UploadForm
from llmqueue.models import BulkJob

JOBS_PER_PAGE = 50
PROGRESS_POLL_MS = 2000
CANCELLABLE = (BulkJob.Status.VALIDATING, BulkJob.Status.IN_PROGRESS)


@login_required
@require_GET
def job_list(request: HttpRequest) -> HttpResponse:
    page = Paginator(with_done(visible_jobs(request.user)), JOBS_PER_PAGE).get_page(
        request.GET.get("page")
    )
    return render(request, "llmqueue/bulk/job_list.html", {"title": "Bulk jobs", "page": page})


@login_required
@require_http_methods(["GET", "POST"])
def upload(request: HttpRequest) -> HttpResponse:
    posted = request.method == "POST"
    tenants = visible_tenants(request.user)
    form = (
        UploadForm(request.POST, request.FILES, tenants=tenants)
        if posted
        else UploadForm(tenants=tenants)
    )
    errors: list[LineError] = []
    if posted and form.is_valid():
        try:
            job = submit_upload(operator_caller(*form.tenant_and_tier()), form.upload())
        except UploadRefused as refused:
            errors = refused.errors
        except ApiError as error:
            form.add_error(None, error.message)
        else:
            return redirect("bulk-job", job_id=job.pk)
    context = {"title": "New bulk job", "form": form, "line_errors": errors}
    status = 400 if posted else 200
    return render(request, "llmqueue/bulk/upload.html", context, status=status)


@login_required
@require_GET
def job_detail(request: HttpRequest, job_id: str) -> HttpResponse:
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    context = {
        "title": f"Bulk job {job.id}",
        "job": job,
        "progress": job_progress(job),
        "cancellable": job.status in CANCELLABLE,
        "poll_ms": PROGRESS_POLL_MS,
    }
    return render(request, "llmqueue/bulk/job_detail.html", context)


@login_required
@require_GET
def job_progress_json(request: HttpRequest, job_id: str) -> JsonResponse:
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    return JsonResponse(job_progress(job).as_dict())


@login_required
@require_POST
def job_cancel(request: HttpRequest, job_id: str) -> HttpResponse:
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    if job.status in CANCELLABLE:
        cancel_job(job)
        messages.success(request, "Cancelling: queued lines will not run, running ones stop.")
    else:
        messages.warning(request, f"The job is {job.status}; only a running job is cancelled.")
    return redirect("bulk-job", job_id=job.pk)


@login_required
@require_GET
def job_results(request: HttpRequest, job_id: str) -> StreamingHttpResponse:
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    response = StreamingHttpResponse(result_lines(job), content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{job.id}_results.jsonl"'
    return response

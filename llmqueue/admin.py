"""Django admin for tiers, tenants, keys, served models, requests, bulk jobs and files (thin:
logic is elsewhere)."""

from __future__ import annotations

from typing import Any

import redis
from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from llmqueue import usage
from llmqueue.apikeys import assign_new_secret
from llmqueue.bulk.cancel import cancel_job
from llmqueue.bulk.retry import RETRIED_JOBS, retry_failed
from llmqueue.cancellation import cancel_requests
from llmqueue.invalidation import bump_config_version
from llmqueue.models import (
    ApiKey,
    BulkJob,
    PromptRequest,
    ServedModel,
    StoredFile,
    Tenant,
    TenantUsage,
    Tier,
)

USAGE_HOURS = 24


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "priority",
        "weight",
        "max_wait_seconds",
        "max_queue_depth",
        "max_engine_share",
        "default_max_tokens",
        "first_token_target_seconds",
        "completion_target_seconds",
        "service_tier",
    )
    list_editable = (
        "priority", "weight", "max_wait_seconds", "max_queue_depth", "max_engine_share",
    )  # fmt: skip
    search_fields = ("name",)


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ("prefix", "name", "created_at", "revoked_at")
    readonly_fields = ("prefix", "created_at")
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # keys are created on the API key page, where the plaintext is shown once


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "tier",
        "is_active",
        "requests_per_second",
        "burst",
        "tokens_per_minute",
        "max_tokens_per_request",
        "max_tier_share",
        "track_in_metrics",
        "weight",
    )
    list_filter = ("tier", "is_active", "track_in_metrics")
    list_editable = ("is_active", "track_in_metrics")
    search_fields = ("name",)
    filter_horizontal = ("allowed_tiers", "members")
    inlines = [ApiKeyInline]

    @admin.display(description="usage")
    def usage_link(self, tenant: Tenant) -> str:
        return format_html(
            '<a href="{}">usage</a>', reverse("admin:llmqueue_tenant_usage", args=[tenant.pk])
        )

    def get_list_display(self, request: HttpRequest) -> Any:
        return (*super().get_list_display(request), "usage_link")

    def get_urls(self) -> list[Any]:
        usage_url = path(
            "<int:tenant_id>/usage/",
            self.admin_site.admin_view(self.usage_view),
            name="llmqueue_tenant_usage",
        )
        return [usage_url, *super().get_urls()]

    def usage_view(self, request: HttpRequest, tenant_id: int) -> HttpResponse:
        """A tenant's last day of usage, hour by hour, with the counters flushed first."""
        tenant = get_object_or_404(Tenant.objects.select_related("tier"), pk=tenant_id)
        usage.flush()
        rows, totals = usage.recent(tenant.pk, USAGE_HOURS)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Usage of {tenant.name}",
            "tenant": tenant,
            "rows": rows,
            "totals": totals,
            "hours": USAGE_HOURS,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/llmqueue/tenant/usage.html", context)


@admin.action(description="Revoke selected keys")
def revoke_keys(modeladmin: Any, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
    count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
    if count:  # update() sends no post_save: tell the API replicas' caches ourselves
        bump_config_version()
    modeladmin.message_user(request, f"Revoked {count} key(s).")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "name", "tenant", "created_at", "revoked_at")
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("prefix", "name", "tenant__name")
    readonly_fields = ("prefix", "created_at")
    fields = ("tenant", "name", "prefix", "created_at", "revoked_at")
    actions = [revoke_keys]

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if not change:
            plaintext = assign_new_secret(obj)
            messages.warning(
                request, f"New API key — copy it now, it is not shown again: {plaintext}"
            )
        super().save_model(request, obj, form, change)


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ("name", "pool", "context_length", "max_tokens", "is_enabled")
    list_filter = ("pool", "is_enabled")
    search_fields = ("name", "pool")


@admin.register(PromptRequest)
class PromptRequestAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "tenant",
        "tier",
        "model",
        "kind",
        "status",
        "enqueued_at",
        "started_at",
        "finished_at",
        "prompt_tokens",
        "completion_tokens",
        "attempts",
    )
    list_filter = ("status", "tier", "kind", "model", "tenant")
    search_fields = ("id", "tenant__name", "prompt", "worker")
    date_hierarchy = "enqueued_at"
    list_select_related = ("tenant", "tier")
    readonly_fields = [f.name for f in PromptRequest._meta.fields]
    actions = ["cancel_selected"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # requests come in through the API

    @admin.action(description="Cancel selected requests (queued or running)")
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[PromptRequest]) -> None:
        try:
            cancelled = cancel_requests(list(queryset.values_list("pk", flat=True)))
        except redis.RedisError:
            self.message_user(
                request,
                "Cancelled in the database, but Redis could not be told: running ones finish "
                "in their engine, and their reserved tokens come back with the bucket's refill.",
                messages.WARNING,
            )
            return
        self.message_user(request, f"Cancelled {len(cancelled)} request(s); finished ones kept.")


@admin.register(TenantUsage)
class TenantUsageAdmin(admin.ModelAdmin):
    list_display = (
        "hour", "tenant", "tier", "admitted", "succeeded", "failed", "expired", "cancelled",
        "rejected_rate", "rejected_tokens", "rejected_tenant_share", "rejected_queue_full",
        "rejected_no_worker", "rejected_too_slow", "prompt_tokens", "completion_tokens",
    )  # fmt: skip
    list_filter = ("tier", "tenant")
    date_hierarchy = "hour"
    list_select_related = ("tenant", "tier")
    readonly_fields = [f.name for f in TenantUsage._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # counted by admission and the workers


S = PromptRequest.Status
LINE_COUNTS = ("held", "queued", "running", "succeeded", "failed", "expired", "cancelled")


def line_count(status: str) -> Any:
    """A list column: the job's lines in `status` (annotated by BulkJobAdmin.get_queryset)."""

    @admin.display(description=status, ordering=status)
    def count(job: Any) -> int:
        return int(getattr(job, status))

    count.__name__ = f"{status}_lines"
    return count


@admin.register(BulkJob)
class BulkJobAdmin(admin.ModelAdmin):
    """Jobs with their progress: the counts come from one grouped query over the page's lines."""

    list_display = (
        "id", "tenant", "tier", "model", "status", "progress", "total",
        *(line_count(status) for status in LINE_COUNTS),
        "created_at", "expires_at",
    )  # fmt: skip
    list_filter = ("status", "tier", "tenant")
    search_fields = ("id", "tenant__name")
    date_hierarchy = "created_at"
    list_select_related = ("tenant", "tier")
    readonly_fields = [f.name for f in BulkJob._meta.fields]
    actions = ["cancel_selected", "retry_failed_lines"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs come in through the Batch API and the /bulk/ pages

    def get_queryset(self, request: HttpRequest) -> QuerySet[BulkJob]:
        counts = {name: Count("lines", filter=Q(lines__status=name)) for name in LINE_COUNTS}
        return super().get_queryset(request).annotate(**counts)

    @admin.display(description="progress")
    def progress(self, job: Any) -> str:
        done = job.succeeded + job.failed + job.expired + job.cancelled
        percent = round(100 * done / job.total) if job.total else 0
        return format_html(
            '<progress value="{}" max="100" title="{} of {} lines done"></progress> {}%',
            percent, done, job.total, percent,
        )  # fmt: skip

    @admin.action(description="Cancel selected jobs (finished output is kept)")
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        jobs = [cancel_job(job) for job in queryset]
        cancelling = sum(job.status == BulkJob.Status.CANCELLING for job in jobs)
        self.message_user(request, f"Cancelling {cancelling} job(s).")

    @admin.action(description="Retry failed and expired lines of selected finished jobs")
    def retry_failed_lines(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        retried = [retry_failed(job) for job in queryset]
        jobs = sum(1 for lines in retried if lines)
        kinds = " or ".join(RETRIED_JOBS)
        note = (
            f"; {len(retried) - jobs} left as they are (retried: the failed and expired lines of "
            f"{kinds} jobs)"
            if jobs < len(retried)
            else ""
        )
        self.message_user(request, f"Retrying {sum(retried)} line(s) of {jobs} job(s){note}.")


@admin.register(StoredFile)
class StoredFileAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "purpose", "filename", "bytes", "created_at")
    list_filter = ("purpose", "tenant")
    search_fields = ("id", "filename", "tenant__name")
    readonly_fields = [f.name for f in StoredFile._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # files come in through the Files API

"""Tenants, service tiers, API keys, served models, prompt requests, bulk jobs and their files."""

from __future__ import annotations

import secrets
import uuid

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class Tier(models.Model):
    """A service class: its share of the GPU, its waiting bound and its queue cap."""

    name = models.SlugField(max_length=40, unique=True, help_text="Part of the queue name.")
    priority = models.PositiveSmallIntegerField(
        default=5, help_text="0 is the most urgent; passed to vLLM's priority scheduler."
    )
    weight = models.PositiveIntegerField(default=1, help_text="Relative share of engine slots.")
    max_wait_seconds = models.PositiveIntegerField(
        default=60, help_text="Deadline from enqueue; also how long a blocking call waits."
    )
    max_queue_depth = models.PositiveIntegerField(
        default=10_000, help_text="Requests waiting per (pool, tier) queue; beyond it: 503."
    )
    default_max_tokens = models.PositiveIntegerField(default=256)
    max_engine_share = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Below 1, this tier's requests join an engine only while it leaves the more "
        "urgent tiers their headroom free: their recent peak above what they hold now, plus one "
        "sequence, and at most (1 - this share) of the sequences (batch 0.75: up to a quarter "
        "for interactive traffic; a bulk backlog alone runs on all sequences but one).",
    )
    first_token_target_seconds = models.FloatField(
        null=True, blank=True, help_text="SLO: seconds from enqueue to the first token."
    )
    completion_target_seconds = models.FloatField(
        null=True, blank=True, help_text="SLO: seconds from enqueue to the last token."
    )
    service_tier = models.CharField(
        max_length=16,
        blank=True,
        choices=[("default", "default"), ("flex", "flex"), ("priority", "priority")],
        help_text="The OpenAI `service_tier` value that picks this tier (each value names at "
        "most one tier). `auto`, and `default` when no tier claims it, pick the tenant's "
        "default tier.",
    )

    class Meta:
        ordering = ["priority", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["service_tier"],
                condition=~models.Q(service_tier=""),
                name="one_tier_per_service_tier",
            )
        ]

    def __str__(self) -> str:
        return self.name


class Tenant(models.Model):
    """A customer of the queue: a default tier and the others it may pick per request, limited
    by its quotas."""

    name = models.CharField(max_length=100, unique=True)
    tier = models.ForeignKey(
        Tier,
        on_delete=models.PROTECT,
        related_name="tenants",
        verbose_name="default tier",
        help_text="Where its requests go unless one picks another of its allowed tiers.",
    )
    allowed_tiers = models.ManyToManyField(
        Tier,
        blank=True,
        related_name="allowed_tenants",
        help_text="Tiers a request may pick besides the default, with OpenAI's `service_tier` "
        "field or the X-LLMQueue-Tier header.",
    )
    is_active = models.BooleanField(default=True)
    requests_per_second = models.FloatField(default=10.0)
    burst = models.PositiveIntegerField(default=20, help_text="Requests allowed at once.")
    tokens_per_minute = models.PositiveIntegerField(default=1_000_000)
    max_tokens_per_request = models.PositiveIntegerField(default=4096)
    max_tier_share = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Share of its tier's queue depth this tenant's waiting requests may fill.",
    )
    track_in_metrics = models.BooleanField(
        default=False,
        help_text="Give this tenant its own label in /metrics (others are counted as "
        'tenant="other"): labels stay bounded however many tenants there are.',
    )
    weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="Share of its bulk tiers' service, in tokens, against other tenants' bulk jobs "
        "on the same tier (2: twice the tokens of a tenant of weight 1 while both wait).",
    )
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL,
        blank=True,
        related_name="tenants",
        help_text="Users who may run and watch this tenant's bulk jobs on the /bulk/ pages "
        "(staff see every tenant's).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """A tenant's secret: only its SHA-256 is stored; the prefix identifies it in lists."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, db_index=True, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class ServedModel(models.Model):
    """A model name callers may ask for, and the worker pool that serves it."""

    name = models.CharField(max_length=200, unique=True, help_text="The API's `model` value.")
    pool = models.SlugField(max_length=60, help_text="Worker pool whose queues carry it.")
    context_length = models.PositiveIntegerField(default=2048)
    max_tokens = models.PositiveIntegerField(default=1024, help_text="Cap on max_tokens.")
    is_enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PromptRequest(models.Model):
    """One caller request; its id is the Celery task id. The row is the source of truth."""

    class Status(models.TextChoices):
        # A bulk line accepted and stored, not yet released into the broker (llmqueue/bulk/pacer).
        HELD = "held"
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        EXPIRED = "expired"
        CANCELLED = "cancelled"

    class Kind(models.TextChoices):
        COMPLETION = "completion"
        CHAT = "chat"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="requests")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="requests")
    model = models.CharField(max_length=200)
    queue = models.CharField(max_length=200, blank=True, help_text="(pool, tier) broker queue.")
    kind = models.CharField(max_length=12, choices=Kind.choices)
    prompt = models.TextField(blank=True)
    messages = models.JSONField(null=True, blank=True)
    params = models.JSONField(default=dict, help_text="Sampling parameters as sent to the engine.")
    status = models.CharField(
        max_length=12, choices=Status.choices, default=Status.QUEUED, db_index=True
    )
    attempts = models.PositiveSmallIntegerField(default=0, help_text="Claims by workers.")
    worker_losses = models.PositiveSmallIntegerField(
        default=0,
        help_text="Claims that took the request over from a worker that never finished nor "
        "handed it back (it died): LLMQUEUE_MAX_WORKER_LOSSES of them fail the request.",
    )
    worker = models.CharField(max_length=200, blank=True)
    enqueued_at = models.DateTimeField(db_index=True)
    deadline_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    reserved_tokens = models.PositiveIntegerField(
        default=0, help_text="Tokens held against the tenant's tokens per minute at admission."
    )
    first_token_at = models.DateTimeField(null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_text = models.TextField(blank=True)
    finish_reason = models.CharField(max_length=20, blank=True)
    error = models.TextField(blank=True)
    job = models.ForeignKey(
        "BulkJob", null=True, blank=True, on_delete=models.CASCADE, related_name="lines"
    )
    custom_id = models.CharField(max_length=200, blank=True, help_text="A bulk line's own id.")
    line = models.PositiveIntegerField(null=True, blank=True, help_text="Input line number.")

    class Meta:
        ordering = ["-enqueued_at"]
        indexes = [
            models.Index(fields=["tenant", "-enqueued_at"]),
            # The workers' deadline sweep finds overdue queued rows without reading the queue.
            models.Index(fields=["status", "deadline_at"], name="request_status_deadline"),
            # A job's output is rendered in input order; its counts are grouped by status.
            models.Index(fields=["job", "line"], name="request_job_line"),
        ]

    def __str__(self) -> str:
        return str(self.id)


class TenantUsage(models.Model):
    """One hour of a tenant's traffic on one tier: what admission and the workers counted."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    tier = models.ForeignKey(Tier, on_delete=models.CASCADE, related_name="usage")
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    admitted = models.PositiveBigIntegerField(default=0)
    rejected_rate = models.PositiveBigIntegerField(default=0, help_text="429: requests/s.")
    rejected_tokens = models.PositiveBigIntegerField(default=0, help_text="429: tokens/min.")
    rejected_tenant_share = models.PositiveBigIntegerField(
        default=0, help_text="503: the tenant's share of the tier's queue was full."
    )
    rejected_queue_full = models.PositiveBigIntegerField(default=0, help_text="503: tier full.")
    rejected_no_worker = models.PositiveBigIntegerField(default=0, help_text="503: no worker.")
    rejected_too_slow = models.PositiveBigIntegerField(
        default=0, help_text="503: the estimated wait exceeded the deadline."
    )
    succeeded = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)
    expired = models.PositiveBigIntegerField(default=0)
    cancelled = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-hour", "tenant__name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "tier", "hour"], name="usage_per_hour")
        ]
        verbose_name_plural = "tenant usage"

    def __str__(self) -> str:
        return f"{self.tenant} / {self.tier} @ {self.hour:%Y-%m-%d %H:00}"


def _file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class StoredFile(models.Model):
    """A file of the Files API (`/v1/files`): a batch's input, output or errors, kept through
    Django's storage API (local MEDIA_ROOT by default, any django-storages backend)."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    content = models.FileField(upload_to="files/%Y/%m/%d/")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class BulkJob(models.Model):
    """A bulk job (an OpenAI batch): many prompts of one tenant, each a PromptRequest line with
    its own row, claim, deadline and result. Counts are read from the lines (one GROUP BY), not
    kept here: workers finishing lines never write this row."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=40, default=_batch_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="jobs")
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="jobs")
    model = models.CharField(max_length=200, blank=True)
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=10, default="24h")
    status = models.CharField(
        max_length=12, choices=Status.choices, default=Status.VALIDATING, db_index=True
    )
    total = models.PositiveIntegerField(default=0, help_text="Lines in the input file.")
    input_file = models.ForeignKey(StoredFile, on_delete=models.PROTECT, related_name="input_of")
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="output_of"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="errors_of"
    )
    errors = models.JSONField(null=True, blank=True, help_text="Why validation failed, by line.")
    metadata = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self) -> str:
        return self.id

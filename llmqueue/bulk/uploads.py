"""An operator's upload (a JSONL batch file or a CSV of prompts) → a bulk job, or its bad lines.

Used by the /bulk/ upload page and `manage.py bulk_submit`. The lines go through the Batch API's
own steps (lines.py, jobs.py); one bad line refuses the upload with every bad line by number, and
nothing is stored or queued.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePath
from typing import Any

from django.conf import settings
from django.core.files.base import ContentFile
from django.utils import timezone

from llmqueue.api.auth import Caller, caller_for_tenant
from llmqueue.api.tiers import on_bulk_tier
from llmqueue.bulk.csv_input import CHAT, csv_rows, row_decoder
from llmqueue.bulk.files import store_upload
from llmqueue.bulk.jobs import new_job, start_job
from llmqueue.bulk.lines import (
    ENDPOINTS,
    LineError,
    Parsed,
    jsonl_entries,
    line_object,
    parse_entries,
)
from llmqueue.models import BulkJob, StoredFile

COMPLETION_WINDOW = "24h"  # the Batch API's only window


@dataclass(frozen=True)
class Upload:
    filename: str  # a name ending in .csv is read as CSV, any other as JSONL
    data: bytes
    endpoint: str | None = None  # None: a JSONL file's own lines' url; chat for a CSV
    model: str | None = None  # for the lines that name none


class UploadRefused(Exception):
    """Nothing of the upload was stored: why, by line."""

    def __init__(self, errors: list[LineError]) -> None:
        super().__init__(f"{len(errors)} bad line(s)")
        self.errors = errors


def operator_caller(tenant_id: int, tier: str | None = None) -> Caller:
    """The tenant, under its own limits, on the job's tier: the one named, else the Batch API's
    default for a batch (llmqueue/api/tiers.py on_bulk_tier). ApiError (403, 404, 422) when the
    tenant is unknown or deactivated, or may not use that tier."""
    return on_bulk_tier(caller_for_tenant(tenant_id), tier)


def is_csv(filename: str) -> bool:
    return PurePath(filename).suffix.lower() == ".csv"


def submit_upload(caller: Caller, upload: Upload, now: datetime | None = None) -> BulkJob:
    """A job of the upload's lines on the caller's tenant and tier, in progress with every line
    held for the pacer; UploadRefused, with nothing stored, when any line is bad. Its input file
    is kept as the JSONL the Batch API takes (a CSV row per line, in order)."""
    if len(upload.data) > settings.LLMQUEUE_BULK_MAX_FILE_BYTES:
        limit = settings.LLMQUEUE_BULK_MAX_FILE_BYTES
        raise UploadRefused([LineError("file_too_large", f"Files take at most {limit} bytes.")])
    endpoint, entries, decode, refused = read_upload(upload)
    if refused:
        raise UploadRefused(refused)
    parsed: Parsed = parse_entries(entries, decode, caller, endpoint)
    if parsed.errors or parsed.route is None:
        raise UploadRefused(parsed.errors)
    content = b"".join(json.dumps(decode(raw)).encode() + b"\n" for _, raw in entries)
    name = f"{PurePath(upload.filename).stem or 'upload'}.jsonl"
    stored = store_upload(caller.tenant_id, StoredFile.Purpose.BATCH, ContentFile(content), name)
    now = now or timezone.now()
    job = new_job(caller, stored, endpoint, COMPLETION_WINDOW, None, now)
    return start_job(job, caller, parsed.route, parsed.lines, now)


def read_upload(
    upload: Upload,
) -> tuple[str, Sequence[tuple[int, Any]], Callable[[Any], dict[str, Any]], list[LineError]]:
    """The upload's endpoint, its numbered entries and how each becomes a line object; or why
    the file cannot be read at all."""
    if is_csv(upload.filename):
        endpoint = upload.endpoint or CHAT
        rows, refused = csv_rows(upload.data)
        numbered = [(number, (number, row)) for number, row in rows]
        return endpoint, numbered, row_decoder(endpoint, upload.model), refused
    entries = jsonl_entries(upload.data)
    endpoint = upload.endpoint or jsonl_endpoint(entries)
    return endpoint, entries, jsonl_decoder(upload.model), []


def jsonl_endpoint(entries: Sequence[tuple[int, bytes]]) -> str:
    """The url of the file's first readable line (every line must name the same), else chat."""
    for _, raw in entries:
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            continue
        return url if isinstance(url, str) and url in ENDPOINTS else CHAT
    return CHAT


def jsonl_decoder(model: str | None) -> Callable[[bytes], dict[str, Any]]:
    """JSONL lines as they are, with `model` in the bodies that name none."""

    def decode(raw: bytes) -> dict[str, Any]:
        obj = line_object(raw)
        body = obj.get("body")
        if model and isinstance(body, dict) and "model" not in body:
            obj["body"] = {**body, "model": model}
        return obj

    return decode

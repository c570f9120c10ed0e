"""`python manage.py bulk_submit FILE --tenant T`: a bulk job from a file, watched to its end.

The same steps as the /bulk/ upload page (llmqueue/bulk/uploads.py), then the job's progress on
stderr until it ends; the exit status says how it ended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmqueue.api.errors import ApiError
from llmqueue.bulk.lines import ENDPOINTS, LineError
from llmqueue.bulk.progress import watch
from llmqueue.bulk.uploads import Upload, UploadRefused, operator_caller, submit_upload
from llmqueue.models import BulkJob, Tenant

REFUSED, ENDED_UNCOMPLETED = 2, 1  # exit statuses; 0: completed (or submitted, --no-wait)


def tenant_id(name_or_id: str) -> int:
    tenant = Tenant.objects.filter(name=name_or_id).first()
    if tenant is None and name_or_id.isdigit():
        tenant = Tenant.objects.filter(pk=int(name_or_id)).first()
    if tenant is None:
        raise CommandError(f"No tenant named {name_or_id!r}.", returncode=REFUSED)
    return tenant.pk


def describe(error: LineError) -> str:
    where = f"line {error.line}" if error.line else "file"
    field = f" ({error.param})" if error.param else ""
    return f"{where}: {error.code}{field}: {error.message}"


class Command(BaseCommand):
    help = (
        "Submit a bulk job from FILE (JSONL: the Batch API's lines; .csv: a header row, `prompt` "
        "required) for a tenant, print its id on stdout, then show its progress on stderr until "
        "it ends. Exit status: 0 completed, 1 failed, expired or cancelled, 2 nothing submitted "
        "(bad lines, listed by number; unknown tenant or tier). The bulk pacer "
        "(manage.py bulk_pacer) must be running for the job to progress."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path, help="a .jsonl or .csv file")
        parser.add_argument("--tenant", required=True, help="the tenant's name (or id)")
        parser.add_argument(
            "--tier", help="a tier the tenant may use (default: flex if allowed, else its own)"
        )
        parser.add_argument("--model", help="for the lines that name no model")
        parser.add_argument(
            "--endpoint", choices=sorted(ENDPOINTS), help="default: a JSONL file's url; CSV: chat"
        )
        parser.add_argument(
            "--no-wait", action="store_true", help="exit once the job is stored, status 0"
        )
        parser.add_argument("--poll-seconds", type=float, default=1.0)

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        try:
            upload = Upload(path.name, path.read_bytes(), options["endpoint"], options["model"])
        except OSError as exc:
            raise CommandError(f"{path}: {exc.strerror}", returncode=REFUSED) from exc
        job = self.submit(tenant_id(options["tenant"]), options["tier"], upload)
        self.stdout.write(job.id)
        self.stdout.flush()
        if options["no_wait"]:
            return
        try:
            progress = watch(job, self.show, options["poll_seconds"], self.stderr.isatty())
        except KeyboardInterrupt:
            raise CommandError(f"Stopped watching; job {job.id} goes on.", returncode=130) from None
        if progress.status != BulkJob.Status.COMPLETED:
            raise CommandError(
                f"Job {job.id} ended {progress.status}.", returncode=ENDED_UNCOMPLETED
            )

    def show(self, text: str) -> None:
        # style_func=str: progress in the terminal's own colour, not the red of stderr's errors.
        self.stderr.write(text, style_func=str, ending="")
        self.stderr.flush()

    def submit(self, tenant: int, tier: str | None, upload: Upload) -> BulkJob:
        try:
            return submit_upload(operator_caller(tenant, tier), upload)
        except UploadRefused as refused:
            for error in refused.errors:
                self.stderr.write(describe(error))
            raise CommandError(
                f"{upload.filename}: nothing submitted, {len(refused.errors)} bad line(s).",
                returncode=REFUSED,
            ) from None
        except ApiError as error:
            raise CommandError(error.message, returncode=REFUSED) from None

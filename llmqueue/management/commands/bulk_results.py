"""`python manage.py bulk_results JOB -o out.jsonl`: a job's results in input order."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmqueue.bulk.progress import FINAL
from llmqueue.bulk.results import write_results
from llmqueue.models import BulkJob


class Command(BaseCommand):
    help = (
        "Write a bulk job's finished lines in input order: every one (output or error line) to "
        "-o, or with --errors the succeeded ones to -o and the others to --errors, as the Batch "
        "API's output and error files. '-o -' writes to stdout. Lines of a running job that "
        "are not finished yet are left out."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job", help="the job's id (batch_...)")
        parser.add_argument("-o", "--output", required=True, help="a file, or - for stdout")
        parser.add_argument("--errors", type=Path, help="a file for the lines that failed")

    def handle(self, *args: Any, **options: Any) -> None:
        job = BulkJob.objects.filter(pk=options["job"]).first()
        if job is None:
            raise CommandError(f"No bulk job {options['job']!r}.")
        with ExitStack() as files:
            output: IO[bytes] = (
                sys.stdout.buffer
                if options["output"] == "-"
                else files.enter_context(Path(options["output"]).open("wb"))
            )
            errors = (
                files.enter_context(options["errors"].open("wb")) if options["errors"] else None
            )
            written, failed = write_results(job, output, errors)
        where = f"; {failed} to {options['errors']}" if options["errors"] else ""
        # style_func=str: a summary, not an error (stderr: stdout may carry the results).
        summary = f"{written} line(s) to {options['output']}{where} (job {job.status})."
        self.stderr.write(summary, style_func=str)
        if job.status not in FINAL:
            self.stderr.write(f"Job {job.id} is {job.status}: lines not finished yet are left out.")

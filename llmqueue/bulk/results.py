"""A job's results as JSONL in input order, for the /bulk/ download and `manage.py bulk_results`.

The Batch API's output and error lines (llmqueue/bulk/finalize.py renders them), read from the
lines now, so a running job's results so far can be had too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

from llmqueue.bulk.finalize import rendered_lines
from llmqueue.models import BulkJob


def result_lines(job: BulkJob) -> Iterator[bytes]:
    """Every finished line, output or error, in input order; one JSON object a line."""
    for _, text in rendered_lines(job, finished_only=True):
        yield text.encode() + b"\n"


def write_results(
    job: BulkJob, output: IO[bytes], errors: IO[bytes] | None = None
) -> tuple[int, int]:
    """Finished lines in input order into `output`, or, given `errors`, the succeeded ones into
    `output` and the others into `errors` (the Batch API's two files); returns how many each."""
    into_output = into_errors = 0
    for succeeded, text in rendered_lines(job, finished_only=True):
        if errors is not None and not succeeded:
            errors.write(text.encode() + b"\n")
            into_errors += 1
        else:
            output.write(text.encode() + b"\n")
            into_output += 1
    return into_output, into_errors

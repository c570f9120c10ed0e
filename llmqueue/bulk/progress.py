"""A job's progress: its lines by status and how many are done, as JSON or a line of text.

Read by the /bulk/ job page (through its progress JSON) and by `manage.py bulk_submit`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q, QuerySet

from llmqueue.bulk.jobs import line_counts
from llmqueue.models import BulkJob, PromptRequest

S = PromptRequest.Status
J = BulkJob.Status
LINE_STATUSES: tuple[str, ...] = tuple(S.values)
DONE = frozenset({S.SUCCEEDED, S.FAILED, S.EXPIRED, S.CANCELLED})
FINAL = frozenset({J.COMPLETED, J.FAILED, J.EXPIRED, J.CANCELLED})


@dataclass(frozen=True)
class Progress:
    job_id: str
    status: str
    total: int
    counts: dict[str, int]  # every line status, zeros included

    @property
    def done(self) -> int:
        return sum(n for status, n in self.counts.items() if status in DONE)

    @property
    def percent(self) -> int:
        """Rounded down: 100 only once every line is done."""
        return 100 * self.done // self.total if self.total else 0

    @property
    def finished(self) -> bool:
        """The job will not change any more (no line left to run, files rendered)."""
        return self.status in FINAL

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.job_id,
            "status": self.status,
            "finished": self.finished,
            "total": self.total,
            "done": self.done,
            "percent": self.percent,
            "counts": self.counts,
        }


def job_progress(job: BulkJob) -> Progress:
    """`job`'s progress as of its row (read it fresh) and its lines now (one grouped query)."""
    counts = line_counts(job)
    return Progress(job.id, job.status, job.total, {s: counts.get(s, 0) for s in LINE_STATUSES})


def with_done(jobs: QuerySet[BulkJob]) -> QuerySet[BulkJob]:
    """Jobs annotated with `done`, their lines done, in the same query (a list page's bars)."""
    return jobs.annotate(done=Count("lines", filter=Q(lines__status__in=DONE)))


def text_bar(progress: Progress, width: int = 30) -> str:
    """`[#########---------]  45%  45/100 done: succeeded 40, failed 5; running 4, ...  status`,
    plain ASCII so a log under CI shows it as a terminal does."""
    filled = width * progress.done // progress.total if progress.total else 0
    parts = [f"{status} {n}" for status, n in progress.counts.items() if n]
    return (
        f"[{'#' * filled}{'-' * (width - filled)}] {progress.percent:3d}%  "
        f"{progress.done}/{progress.total} done: {', '.join(parts) or 'no lines'}  "
        f"{progress.status}"
    )


def watch(job: BulkJob, show: Callable[[str], None], poll_seconds: float, redraw: bool) -> Progress:
    """Show `job`'s progress with `show` (writes text as it is) until the job is finished;
    returns the last. `redraw` (a terminal): one bar rewritten in place; otherwise a new line
    whenever the counts change, so a CI log gets a readable history, not carriage returns."""
    shown = ""
    while True:
        job.refresh_from_db(fields=["status", "total"])
        progress = job_progress(job)
        bar = text_bar(progress)
        if redraw:
            show(f"\r{bar}\033[K" + ("\n" if progress.finished else ""))
        elif bar != shown:
            show(f"{bar}\n")
        shown = bar
        if progress.finished:
            return progress
        time.sleep(poll_seconds)

"""When a request was enqueued, claimed, gave its first token and ended: what latency metrics time.

The lifecycle's UPDATEs return these columns of the rows they change, so the recorder counts
each ended request's latencies (contract/latency.py) without reading the row again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils.dateparse import parse_datetime


@dataclass(frozen=True)
class Timing:
    """Epoch seconds; None where the request never got there (an expired one has no claim)."""

    enqueued: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def since_enqueued(self, at: float | None) -> float | None:
        if at is None or self.enqueued is None:
            return None
        return max(0.0, at - self.enqueued)


NO_TIMING = Timing()


def epoch(value: object) -> float | None:
    """A DB timestamp as epoch seconds: PostgreSQL returns aware datetimes, SQLite's raw cursor
    may return text; a naive one is UTC (Django stores UTC with USE_TZ)."""
    if value is None:
        return None
    moment = value if isinstance(value, datetime) else parse_datetime(str(value))
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def timing_of(enqueued: object, started: object, first_token: object, finished: object) -> Timing:
    return Timing(epoch(enqueued), epoch(started), epoch(first_token), epoch(finished))

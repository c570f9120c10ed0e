"""The latency histograms both programs share: what is timed, and the buckets it falls in.

The worker's recorder counts each ended request in Redis hashes (contract/keys.py latency_key
and a per-minute copy); any API replica's /metrics exports them as Prometheus histograms, and
the dashboard reads the per-minute copies for its hour of plots and SLO attainment. One set of
bounds for every kind, so a tier's first-token target (1 s, 600 s by default) is a bound itself
and attainment at it is exact, not interpolated.
"""

from __future__ import annotations

import bisect

QUEUE = "queue"  # enqueued → claimed by a worker (time in queue)
FIRST_TOKEN = "first_token"  # enqueued → first token (what a tier's target is about)
TOTAL = "total"  # enqueued → finished (end to end)
SLACK = "deadline_slack"  # deadline − claim time: how close dispatch came to expiring it
KINDS = (QUEUE, FIRST_TOKEN, TOTAL, SLACK)

BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 86400.0,
)  # fmt: skip
INF = "+Inf"
SUM = "sum"
# Per-minute copies live this long: the dashboard's hour and a margin for a late reader.
WINDOW_TTL_SECONDS = 2 * 3600


def bucket_field(seconds: float) -> str:
    """The hash field an observation of `seconds` counts in: the smallest bound ≥ it."""
    index = bisect.bisect_left(BUCKETS, seconds)
    return INF if index == len(BUCKETS) else repr(BUCKETS[index])


def minute_of(epoch: float) -> int:
    return int(epoch // 60)

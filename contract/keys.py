"""The Redis keys both programs touch: admission's books that workers settle, usage, worker beats.

Admission (API) reserves from a tenant's buckets and counts its waiting requests; the worker's
recorder refunds, feeds each queue's drain rate and engine lead, and uncounts the waiting. Every
key is built here so the two sides cannot drift apart.
"""

from __future__ import annotations

PREFIX = "llmqueue"
CONFIG_VERSION_KEY = f"{PREFIX}:config-version"


def bucket_key(kind: str, tenant_id: int) -> str:
    """A tenant's token bucket: `kind` "requests" (rate + burst) or "tokens" (per minute)."""
    return f"{PREFIX}:bucket:{kind}:{tenant_id}"


def drain_key(queue: str) -> str:
    """A queue's measured drain rate and engine lead (a hash)."""
    return f"{PREFIX}:drain:{queue}"


def waiting_key(queue: str, tenant_id: int) -> str:
    """How many of the tenant's requests were admitted to `queue` and not claimed yet."""
    return f"{PREFIX}:waiting:{queue}:{tenant_id}"


def workers_key(pool: str) -> str:
    """A pool's workers by their last beat (a sorted set)."""
    return f"{PREFIX}:workers:{pool}"


# Sets of the names of a key family, kept by whoever writes the family, so that readers of the
# whole family never SCAN: broker, result backend and these books share one Redis database,
# whose result keys alone number a day of requests (contract/key_index.py).
WORKERS_INDEX_KEY = f"{PREFIX}:index:workers"
"""workers_key names of the pools any worker has beaten in."""
USAGE_INDEX_KEY = f"{PREFIX}:index:usage"
"""usage_key names counted in and not flushed yet."""
TOTALS_INDEX_KEY = f"{PREFIX}:index:totals"
"""totals_key names ever counted in."""


def worker_stats_key(pool: str) -> str:
    """A pool's workers' counters as of their last beat (a hash by node)."""
    return f"{PREFIX}:worker-stats:{pool}"


USAGE_PREFIX = f"{PREFIX}:usage"


def usage_key(tenant_id: int, tier_id: int, hour: int) -> str:
    """A tenant's usage counters in a tier for one hour (epoch seconds at the hour's start):
    admission counts rejections, the worker's recorder outcomes and tokens."""
    return f"{USAGE_PREFIX}:{tenant_id}:{tier_id}:{hour}"


# Pub/sub channel: each message is the id of a request just cancelled; every worker that holds
# it in its engine aborts it at the next step.
CANCEL_CHANNEL = f"{PREFIX}:cancelled"


TOTALS_PREFIX = f"{PREFIX}:totals"


def totals_key(tenant_id: int, tier_id: int) -> str:
    """A tenant's counters in a tier since the start, never flushed: the same fields as usage
    (admission and the recorder count both in one go), read by /metrics as Prometheus counters."""
    return f"{TOTALS_PREFIX}:{tenant_id}:{tier_id}"


LATENCY_PREFIX = f"{PREFIX}:latency"


def latency_key(kind: str, tier_id: int) -> str:
    """A tier's histogram of one latency `kind` since the start (contract/latency.py)."""
    return f"{LATENCY_PREFIX}:{kind}:{tier_id}"


def latency_window_key(kind: str, tier_id: int, minute: int) -> str:
    """The same histogram for one minute only (epoch minute): sliding windows, the hour's plot."""
    return f"{LATENCY_PREFIX}:{kind}:{tier_id}:{minute}"


# API errors that are not admission's (4xx of bad input, 401, 404 ...), by code: a hash.
API_ERRORS_KEY = f"{PREFIX}:totals:api-errors"
# Queued requests the reconciler published anew because their message had left the broker.
RECONCILED_KEY = f"{PREFIX}:totals:republished"


def admissions_window_key(tier_id: int, minute: int) -> str:
    """A tier's admissions and rejections in one minute (epoch minute): the dashboard's rates."""
    return f"{PREFIX}:admissions:{tier_id}:{minute}"


def depth_history_key(queue: str) -> str:
    """A queue's waiting messages by epoch minute (a hash), sampled by its workers: the
    dashboard's hour of depth."""
    return f"{PREFIX}:depth-history:{queue}"

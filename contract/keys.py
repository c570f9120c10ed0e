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

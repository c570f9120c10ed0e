"""Which broker queue each of a pool's tiers uses, as configured: read by the API and workers."""

from __future__ import annotations

from django.conf import settings

from contract.queues import SHARED_QUEUE_TIER, lane
from llmqueue.models import Tier


def queue_name(pool: str, tier: str) -> str:
    """The broker queue of `tier`'s requests in `pool` (contract.queues.Lane, as configured:
    under LLMQUEUE_SHARED_QUEUE every tier of a pool shares one)."""
    return lane(pool, tier, settings.LLMQUEUE_SHARED_QUEUE).queue


def pool_queues(pool: str) -> list[str]:
    """Every tier's queue of `pool`, most urgent tier first."""
    if settings.LLMQUEUE_SHARED_QUEUE:
        return [queue_name(pool, SHARED_QUEUE_TIER)]
    return [queue_name(pool, name) for name in Tier.objects.values_list("name", flat=True)]

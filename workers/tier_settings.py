"""Tiers in a running worker: settings re-read and new tier queues consumed, without a restart."""

from __future__ import annotations

import logging
from typing import Any

from django.db import close_old_connections

from workers.dispatch import TierPolicy

log = logging.getLogger(__name__)


def load_tier_policies() -> list[TierPolicy]:
    """Every tier's dispatch settings as the admin has them now."""
    from llmqueue.models import Tier

    close_old_connections()  # this thread's connection may have been dropped meanwhile
    return [
        TierPolicy(t.name, t.priority, t.weight, t.max_engine_share) for t in Tier.objects.all()
    ]


class QueueFollower:
    """Keeps a running worker consuming every tier queue of its pool: a tier added in the admin
    is served from the next refresh on, a deleted one is let go. Celery's consumer changes its
    queues only on its own thread, so the change is handed to its event loop (`call_soon`, as
    Celery's own `add_consumer` control command does); the next BRPOP includes it."""

    def __init__(self, pool: str, queues: list[str]) -> None:
        self.pool = pool
        self.queues = list(queues)
        self.consumer: Any = None  # Celery's Consumer, once the worker is ready

    def refresh(self) -> None:
        consumer = self.consumer
        if consumer is None:
            return
        from llmqueue.queueing.lanes import pool_queues

        wanted = pool_queues(self.pool)
        for queue in [q for q in wanted if q not in self.queues]:
            log.info("serving new tier queue %s", queue)
            consumer.call_soon(consumer.add_task_queue, queue)
        for queue in [q for q in self.queues if q not in wanted]:
            log.info("no longer serving tier queue %s (tier deleted)", queue)
            consumer.call_soon(consumer.cancel_task_queue, queue)
        self.queues = wanted

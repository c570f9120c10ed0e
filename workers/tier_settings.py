"""Tier settings in a running worker: re-read every few seconds, so admin edits need no restart."""

from __future__ import annotations

from django.db import close_old_connections

from workers.dispatch import TierPolicy


def load_tier_policies() -> list[TierPolicy]:
    """Every tier's dispatch settings as the admin has them now."""
    from llmqueue.models import Tier

    close_old_connections()  # this thread's connection may have been dropped meanwhile
    return [
        TierPolicy(t.name, t.priority, t.weight, t.max_engine_share) for t in Tier.objects.all()
    ]

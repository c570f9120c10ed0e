"""Admin edits reach every API replica's caches at once: a config version in Redis, bumped on save.

Each replica caches keys, tenants, tiers and models (no DB query per request). A save or delete of
any of them bumps the version; every admission decision reads it in the same round trip, and a
replica that sees a new version drops its caches before the next request. The caches' TTL
(LLMQUEUE_AUTH_CACHE_SECONDS) still bounds staleness when Redis could not be told.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from django.db.models.signals import m2m_changed, post_delete, post_save

from contract.keys import CONFIG_VERSION_KEY
from llmqueue.redis_client import get_redis

__all__ = ["CONFIG_VERSION_KEY", "bump_config_version", "connect_signals", "note_config_version"]

log = logging.getLogger(__name__)

_seen: str | None = None
_lock = threading.Lock()
_forgetters: list[Callable[[], None]] = []


def forget_on_config_change(forget: Callable[[], None]) -> Callable[[], None]:
    """Register a cache's `forget` (a decorator): it runs when an admission sees a new version."""
    _forgetters.append(forget)
    return forget


def bump_config_version(**_: Any) -> None:
    """Signal handler: a cached model changed."""
    try:
        get_redis().incr(CONFIG_VERSION_KEY)
    except redis.RedisError:
        log.warning("could not bump the config version; replicas catch up within the cache TTL")


def note_config_version(version: str) -> bool:
    """Record the version an admission read; drop this process's caches if it changed. True if
    they were dropped."""
    global _seen
    with _lock:
        if version == _seen:
            return False
        first, _seen = _seen is None, version
    if first:
        return False
    for forget in _forgetters:
        forget()
    return True


def connect_signals() -> None:
    from llmqueue.models import ApiKey, ServedModel, Tenant, Tier

    for model in (ApiKey, ServedModel, Tenant, Tier):
        post_save.connect(bump_config_version, sender=model, dispatch_uid=f"bump-{model.__name__}")
        post_delete.connect(
            bump_config_version, sender=model, dispatch_uid=f"bump-del-{model.__name__}"
        )
    # A tenant's allowed tiers change without a save of the tenant row.
    m2m_changed.connect(
        bump_config_version, sender=Tenant.allowed_tiers.through, dispatch_uid="bump-m2m-tiers"
    )

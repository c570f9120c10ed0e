"""Routing: which pool serves a model, and which broker queue carries a (pool, tier)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from contract import liveness
from llmqueue.api.errors import NotFound
from llmqueue.invalidation import forget_on_config_change
from llmqueue.models import ServedModel
from llmqueue.queueing.lanes import pool_queues
from llmqueue.redis_client import get_redis
from llmqueue.ttl_cache import TtlCache


@dataclass(frozen=True)
class ModelRoute:
    name: str
    pool: str
    context_length: int
    max_tokens: int


def all_queues() -> list[str]:
    """Every (pool, tier) queue callers can reach now: each pool of an enabled model, each tier."""
    pools = ServedModel.objects.filter(is_enabled=True).values_list("pool", flat=True)
    return [q for pool in sorted(set(pools)) for q in pool_queues(pool)]


def _load_route(name: str) -> ModelRoute | None:
    model = ServedModel.objects.filter(name=name, is_enabled=True).first()
    if model is None:
        return None
    return ModelRoute(model.name, model.pool, model.context_length, model.max_tokens)


_routes: TtlCache[str, ModelRoute | None] = TtlCache(settings.LLMQUEUE_AUTH_CACHE_SECONDS)


def resolve_model(name: str) -> ModelRoute:
    """The route for model `name`, or 404 when no enabled ServedModel has that name."""
    route = _routes.get(name, _load_route)
    if route is None:
        raise NotFound(f"The model {name!r} does not exist.", code="model_not_found", param="model")
    return route


def live_models() -> list[ServedModel]:
    """Enabled models whose pool has at least one worker beating now."""
    models = list(ServedModel.objects.filter(is_enabled=True))
    live = liveness.live_pools(
        get_redis(), (m.pool for m in models), settings.LLMQUEUE_WORKER_STALE_SECONDS
    )
    return [m for m in models if m.pool in live]


@forget_on_config_change
def forget_cached_routes() -> None:
    _routes.clear()

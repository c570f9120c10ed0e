"""Authentication: a bearer key becomes a Caller, a cached snapshot of its tenant and tiers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from django.conf import settings
from django.http import HttpRequest

from llmqueue.api.errors import Forbidden, NotFound, Unauthenticated
from llmqueue.apikeys import hash_key
from llmqueue.invalidation import forget_on_config_change
from llmqueue.models import ApiKey, Tenant, Tier
from llmqueue.ttl_cache import TtlCache


@dataclass(frozen=True)
class TierView:
    """What the request path needs of a tier."""

    id: int
    name: str
    priority: int
    max_wait_seconds: int
    first_token_target_seconds: float | None
    default_max_tokens: int
    max_queue_depth: int
    service_tier: str  # the OpenAI `service_tier` value that picks it, or ""

    @classmethod
    def of(cls, tier: Tier) -> TierView:
        return cls(
            tier.pk,
            tier.name,
            tier.priority,
            tier.max_wait_seconds,
            tier.first_token_target_seconds,
            tier.default_max_tokens,
            tier.max_queue_depth,
            tier.service_tier,
        )


@dataclass(frozen=True)
class Caller:
    """What admission needs about the key's tenant and the tier a request runs on (its default
    tier until llmqueue/api/tiers.py picks another), read from the DB at most every
    LLMQUEUE_AUTH_CACHE_SECONDS."""

    key_id: int | None  # None: an operator's bulk job (web pages, command line), no key
    tenant_id: int
    tenant_name: str
    tenant_active: bool
    key_revoked: bool
    max_tokens_per_request: int
    requests_per_second: float
    burst: int
    tokens_per_minute: int
    max_tier_share: float
    tier_id: int
    tier_name: str
    tier_priority: int
    max_wait_seconds: int
    first_token_target_seconds: float | None
    default_max_tokens: int
    max_queue_depth: int
    tiers: tuple[TierView, ...] = ()  # every tier there is, as of the snapshot
    allowed_tiers: frozenset[str] = frozenset()  # the default tier and the tenant's others

    def tier_named(self, name: str) -> TierView | None:
        return next((t for t in self.tiers if t.name == name), None)

    def on_tier(self, tier: TierView) -> Caller:
        """This caller with its request on `tier` instead."""
        return replace(self, **tier_fields(tier))


def tier_fields(tier: TierView) -> dict[str, Any]:
    """A Caller's fields that describe the tier its request runs on."""
    return {
        "tier_id": tier.id,
        "tier_name": tier.name,
        "tier_priority": tier.priority,
        "max_wait_seconds": tier.max_wait_seconds,
        "first_token_target_seconds": tier.first_token_target_seconds,
        "default_max_tokens": tier.default_max_tokens,
        "max_queue_depth": tier.max_queue_depth,
    }


_callers: TtlCache[str, Caller | None] = TtlCache(settings.LLMQUEUE_AUTH_CACHE_SECONDS)


def _load_caller(key_hash: str) -> Caller | None:
    key = ApiKey.objects.select_related("tenant__tier").filter(key_hash=key_hash).first()
    if key is None:
        return None
    return _caller(key.tenant, key.pk, key.is_revoked)


def _caller(tenant: Tenant, key_id: int | None, key_revoked: bool) -> Caller:
    tier = tenant.tier
    allowed = {tier.name, *tenant.allowed_tiers.values_list("name", flat=True)}
    return Caller(
        key_id=key_id,
        tenant_id=tenant.pk,
        tenant_name=tenant.name,
        tenant_active=tenant.is_active,
        key_revoked=key_revoked,
        max_tokens_per_request=tenant.max_tokens_per_request,
        requests_per_second=tenant.requests_per_second,
        burst=tenant.burst,
        tokens_per_minute=tenant.tokens_per_minute,
        max_tier_share=tenant.max_tier_share,
        **tier_fields(TierView.of(tier)),
        tiers=tuple(TierView.of(t) for t in Tier.objects.all()),
        allowed_tiers=frozenset(allowed),
    )


def bearer_token(request: HttpRequest) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("Missing API key: send 'Authorization: Bearer <key>'.")
    return token.strip()


def authenticate(request: HttpRequest, fresh: bool = False) -> Caller:
    """The request's Caller, or 401 (unknown/revoked key) / 403 (inactive tenant)."""
    return caller_for_key(bearer_token(request), fresh)


def caller_for_key(plaintext: str, fresh: bool = False) -> Caller:
    """The Caller of an API key, or 401 / 403 as for an HTTP request; `fresh`: read from the
    database now rather than from this process's cache."""
    key_hash = hash_key(plaintext)
    caller = (_callers.reload if fresh else _callers.get)(key_hash, _load_caller)
    if caller is None:
        raise Unauthenticated("Incorrect API key provided.")
    if caller.key_revoked:
        raise Unauthenticated("This API key has been revoked.", code="revoked_api_key")
    if not caller.tenant_active:
        raise Forbidden(f"Tenant {caller.tenant_name!r} is deactivated.")
    return caller


def caller_for_tenant(tenant_id: int) -> Caller:
    """The Caller of a tenant itself, read from the database now: an operator's bulk job from
    the web pages or the command line, under the tenant's limits. 404 for an unknown tenant,
    403 for a deactivated one, as for its keys."""
    tenant = Tenant.objects.select_related("tier").filter(pk=tenant_id).first()
    if tenant is None:
        raise NotFound(f"No tenant with id {tenant_id}.", code="tenant_not_found")
    if not tenant.is_active:
        raise Forbidden(f"Tenant {tenant.name!r} is deactivated.")
    return _caller(tenant, None, False)


@forget_on_config_change
def forget_cached_callers() -> None:
    """Drop this process's cached callers (tests; an admin save in this same process)."""
    _callers.clear()

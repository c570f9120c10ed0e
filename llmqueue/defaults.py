"""Default tiers and the idempotent setup of a served model + tenant, used by the demo and tests."""

from __future__ import annotations

from llmqueue.apikeys import create_api_key
from llmqueue.models import ServedModel, Tenant, Tier

# name → (priority, weight, max_wait_seconds, default_max_tokens)
DEFAULT_TIERS: dict[str, tuple[int, int, int, int]] = {
    "interactive": (0, 8, 30, 256),
    "batch": (6, 1, 600, 256),
}


def ensure_default_tiers() -> dict[str, Tier]:
    tiers = {}
    for name, (priority, weight, max_wait, max_tokens) in DEFAULT_TIERS.items():
        tiers[name], _ = Tier.objects.get_or_create(
            name=name,
            defaults={
                "priority": priority,
                "weight": weight,
                "max_wait_seconds": max_wait,
                "default_max_tokens": max_tokens,
            },
        )
    return tiers


def ensure_served_model(name: str, pool: str, context_length: int, max_tokens: int) -> ServedModel:
    model, _ = ServedModel.objects.update_or_create(
        name=name,
        defaults={"pool": pool, "context_length": context_length, "max_tokens": max_tokens},
    )
    return model


def create_tenant_with_key(name: str, tier: Tier, **limits: object) -> tuple[Tenant, str]:
    """Create (or reuse) tenant `name` on `tier` and give it a new key; returns the plaintext."""
    tenant, _ = Tenant.objects.update_or_create(name=name, defaults={"tier": tier, **limits})
    _, plaintext = create_api_key(tenant, name="created by setup")
    return tenant, plaintext

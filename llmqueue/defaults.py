"""Default tiers and the idempotent setup of a served model + tenant, used by the demo and tests."""

from __future__ import annotations

from llmqueue.apikeys import create_api_key
from llmqueue.models import ServedModel, Tenant, Tier

# The two tiers every install starts with; operators edit them (or add more) in the admin.
DEFAULT_TIERS: dict[str, dict[str, object]] = {
    "interactive": {
        "priority": 0,
        "weight": 8,
        "max_wait_seconds": 30,
        "default_max_tokens": 256,
        "first_token_target_seconds": 1.0,
    },
    "batch": {
        "priority": 6,
        "weight": 1,
        "max_wait_seconds": 600,
        "default_max_tokens": 256,
        # A quarter of every engine stays free for interactive requests.
        "max_engine_share": 0.75,
        "completion_target_seconds": 600.0,
        # OpenAI's flex processing: cheaper, slower, for work that can wait.
        "service_tier": "flex",
    },
}


def ensure_default_tiers() -> dict[str, Tier]:
    return {
        name: Tier.objects.get_or_create(name=name, defaults=fields)[0]
        for name, fields in DEFAULT_TIERS.items()
    }


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

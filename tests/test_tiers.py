"""Tiers per request: OpenAI's `service_tier` or X-LLMQueue-Tier picks one of the tenant's tiers;
anything else is 403/422 with nothing stored or queued. Background calls: no worker needed."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from llmqueue.models import PromptRequest, Tenant, Tier
from tests.conftest import Seeded, assert_nothing_enqueued, pretend_live
from tests.test_api import post

pytestmark = pytest.mark.django_db(transaction=True)


def ask(server: Any, key: str, tier_header: str | None = None, **body: Any) -> Any:
    payload = {"model": "sim", "prompt": "hi", "max_tokens": 2, "background": True, **body}
    headers = {} if tier_header is None else {"X-LLMQueue-Tier": tier_header}
    return post(server, "/v1/completions", key, payload, **headers)


def allow(tenant_id: int, *tiers: str) -> None:
    """As the admin's tenant form does: the allowed tiers' M2M changes, the row is not saved."""
    Tenant.objects.get(pk=tenant_id).allowed_tiers.set(Tier.objects.filter(name__in=tiers))


def queued_on(client: redis.Redis, queue: str) -> int:
    return int(client.llen(queue))


@pytest.fixture
def batch_is_flex(seeded: Seeded, clean_redis: redis.Redis) -> Seeded:
    Tier.objects.filter(name="batch").update(service_tier="flex")
    pretend_live(clean_redis, "default")
    return seeded


def test_service_tier_flex_runs_on_the_tier_marked_flex_when_the_tenant_may_use_it(
    live_server, batch_is_flex: Seeded, clean_redis: redis.Redis
):
    allow(batch_is_flex.tenant_id, "batch")
    response = ask(live_server, batch_is_flex.key, service_tier="flex")
    assert response.status_code == 202, response.text
    row = PromptRequest.objects.get(pk=response.json()["id"])
    assert (row.tier.name, row.queue) == ("batch", "default.batch")
    assert queued_on(clean_redis, "default.batch") == 1
    assert queued_on(clean_redis, "default.interactive") == 0


def test_the_tier_header_names_a_tier_and_auto_or_default_keep_the_default_tier(
    live_server, batch_is_flex: Seeded, clean_redis: redis.Redis
):
    allow(batch_is_flex.tenant_id, "batch")
    by_header = ask(live_server, batch_is_flex.key, tier_header="batch")
    both = ask(live_server, batch_is_flex.key, tier_header="batch", service_tier="flex")
    auto = ask(live_server, batch_is_flex.key, service_tier="auto")
    default = ask(live_server, batch_is_flex.key, service_tier="default")  # no tier marked
    assert [r.status_code for r in (by_header, both, auto, default)] == [202] * 4
    tiers = [PromptRequest.objects.get(pk=r.json()["id"]).tier.name for r in (by_header, both)]
    assert tiers == ["batch", "batch"]
    tiers = [PromptRequest.objects.get(pk=r.json()["id"]).tier.name for r in (auto, default)]
    assert tiers == ["interactive", "interactive"]
    assert (
        queued_on(clean_redis, "default.batch")
        == queued_on(clean_redis, "default.interactive")
        == 2
    )


@pytest.mark.parametrize(
    ("header", "body", "status", "code", "says"),
    [
        ("batch", {}, 403, "tier_not_allowed", "Tenant 'acme' may not use tier 'batch'"),
        (None, {"service_tier": "flex"}, 403, "tier_not_allowed", "its tiers: interactive"),
        ("gold", {}, 422, "tier_not_found", "there is no tier 'gold'; tiers: interactive, batch"),
        (None, {"service_tier": "turbo"}, 422, "invalid_service_tier", "got 'turbo'"),
        (None, {"service_tier": 3}, 422, "invalid_service_tier", "got 3"),
        (None, {"service_tier": "priority"}, 422, "service_tier_unavailable", "'priority'"),
        ("interactive", {"service_tier": "flex"}, 422, "conflicting_tier", "picks tier 'batch'"),
    ],
)
def test_a_tier_the_tenant_may_not_use_or_that_does_not_exist_is_refused_and_nothing_stored(
    live_server,
    batch_is_flex: Seeded,
    clean_redis: redis.Redis,
    header: str | None,
    body: dict[str, Any],
    status: int,
    code: str,
    says: str,
):
    refused = ask(live_server, batch_is_flex.key, tier_header=header, **body)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert error["code"] == code and says in error["message"], error
    assert_nothing_enqueued(clean_redis)


def test_allowing_a_tier_in_the_admin_reaches_the_running_server_without_a_restart(
    live_server, batch_is_flex: Seeded, clean_redis: redis.Redis
):
    assert ask(live_server, batch_is_flex.key, tier_header="batch").status_code == 403
    allow(batch_is_flex.tenant_id, "batch")  # the M2M changes: the config version is bumped
    assert ask(live_server, batch_is_flex.key, tier_header="batch").status_code == 202
    assert PromptRequest.objects.get().tier.name == "batch"

"""The admin's per-tenant usage view: decisions and outcomes counted in Redis, shown per hour."""

from __future__ import annotations

import pytest
import redis
from django.test import Client
from django.urls import reverse

from llmqueue.models import PromptRequest, TenantUsage
from tests.conftest import Seeded, pretend_live
from tests.test_api_admission import ask, limit_tenant

pytestmark = pytest.mark.django_db(transaction=True)


def test_usage_view_shows_admitted_and_rejected_requests_of_the_tenant(
    live_server, seeded: Seeded, clean_redis: redis.Redis, admin_client: Client
):
    pretend_live(clean_redis, "default")
    limit_tenant(requests_per_second=0.01, burst=2)
    assert [ask(live_server, seeded.key, max_tokens=3).status_code for _ in range(3)] == [
        202,
        202,
        429,
    ]
    page = admin_client.get(reverse("admin:llmqueue_tenant_usage", args=[seeded.tenant_id]))
    assert page.status_code == 200
    totals = page.context["totals"]
    assert (totals["admitted"], totals["rejected_rate"], totals["succeeded"]) == (2, 1, 0)
    assert [(row.tier_id, row.admitted) for row in page.context["rows"]] == [(seeded.tier_id, 2)]
    assert b"Usage of acme" in page.content
    assert TenantUsage.objects.count() == 1 and PromptRequest.objects.count() == 2


def test_tenant_list_links_each_tenant_to_its_usage(seeded: Seeded, admin_client: Client):
    page = admin_client.get(reverse("admin:llmqueue_tenant_changelist"))
    usage_url = reverse("admin:llmqueue_tenant_usage", args=[seeded.tenant_id])
    assert page.status_code == 200 and usage_url.encode() in page.content

"""The admin's per-tenant usage view: decisions and outcomes counted in Redis, shown per hour."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.test import Client
from django.urls import reverse

from llmqueue.models import ApiKey, PromptRequest, Tenant, TenantUsage
from llmqueue.ttl_cache import TtlCache
from tests.conftest import Seeded, pretend_live
from tests.test_api_admission import ask, limit_tenant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def long_auth_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached callers outlive the test: only the admin's invalidation can make them go."""
    monkeypatch.setattr("llmqueue.api.auth._callers", TtlCache(3600.0))


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


def test_keys_revoked_in_the_admin_are_refused_by_the_running_server(
    live_server, seeded: Seeded, clean_redis: redis.Redis, admin_client: Client, long_auth_cache
):
    pretend_live(clean_redis, "default")
    # The first admission notes the version the fixtures' saves left; the second caches the key.
    assert [ask(live_server, seeded.key).status_code for _ in range(2)] == [202, 202]
    keys = ApiKey.objects.filter(tenant_id=seeded.tenant_id)
    changelist = reverse("admin:llmqueue_apikey_changelist")
    form = {"action": "revoke_keys", ACTION_CHECKBOX_NAME: [str(k.pk) for k in keys]}
    assert admin_client.post(changelist, form).status_code == 302
    # The next admission reads the bumped version and drops the cache: the one after is refused.
    statuses = [ask(live_server, seeded.key).status_code for _ in range(2)]
    assert statuses == [202, 401]
    assert PromptRequest.objects.count() == 3


def test_a_tenant_deactivated_in_the_admin_is_refused_by_the_running_server(
    live_server, seeded: Seeded, clean_redis: redis.Redis, admin_client: Client, long_auth_cache
):
    pretend_live(clean_redis, "default")
    assert [ask(live_server, seeded.key).status_code for _ in range(2)] == [202, 202]
    tenant = Tenant.objects.get(pk=seeded.tenant_id)
    change = reverse("admin:llmqueue_tenant_change", args=[tenant.pk])
    page = admin_client.get(change).context
    form, keys = page["adminform"].form, page["inline_admin_formsets"][0].formset.prefix
    data = {name: form[name].value() for name in form.fields if form[name].value() is not None}
    # Unchecked: the box is absent from the post. The keys' inline is left out of the form.
    del data["is_active"]
    data.update({f"{keys}-TOTAL_FORMS": "0", f"{keys}-INITIAL_FORMS": "0", "_save": "Save"})
    saved = admin_client.post(change, data)
    assert saved.status_code == 302, saved.context["adminform"].form.errors
    statuses = [ask(live_server, seeded.key).status_code for _ in range(2)]
    assert statuses == [202, 403]


def test_the_admin_cancels_queued_requests_and_keeps_finished_ones(
    live_server, seeded: Seeded, clean_redis: redis.Redis, admin_client: Client
):
    pretend_live(clean_redis, "default")
    ids = [ask(live_server, seeded.key, max_tokens=3).json()["id"] for _ in range(2)]
    PromptRequest.objects.filter(pk=ids[1]).update(status=PromptRequest.Status.SUCCEEDED)
    page = admin_client.post(
        reverse("admin:llmqueue_promptrequest_changelist"),
        {"action": "cancel_selected", ACTION_CHECKBOX_NAME: ids},
        follow=True,
    )
    assert b"Cancelled 1 request(s); finished ones kept." in page.content
    statuses = dict(PromptRequest.objects.values_list("pk", "status"))
    assert [statuses[uuid.UUID(i)] for i in ids] == ["cancelled", "succeeded"]

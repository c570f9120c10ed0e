"""The prebuilt single-row INSERT stores exactly what Model.save would."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers
from llmqueue.models import PromptRequest
from llmqueue.queueing.row_insert import insert_request

pytestmark = pytest.mark.django_db


NOW = timezone.now()


def a_request(**fields: object) -> PromptRequest:
    tier = ensure_default_tiers()["interactive"]
    tenant, _ = create_tenant_with_key("acme", tier)
    now = NOW
    values: dict[str, object] = {
        "tenant": tenant,
        "tier": tier,
        "model": "sim",
        "queue": "default.interactive",
        "kind": PromptRequest.Kind.CHAT,
        "messages": [{"role": "user", "content": "héllo"}],
        "params": {"max_tokens": 7, "stop": ["\n"], "temperature": 0.5},
        "enqueued_at": now,
        "deadline_at": now + timedelta(seconds=30),
        "reserved_tokens": 12,
    }
    return PromptRequest(**{**values, **fields})


def test_insert_request_stores_what_save_would():
    fast, orm = a_request(), a_request()
    insert_request(fast)
    orm.save(force_insert=True)
    stored = {row.pk: model_to_dict(row) for row in PromptRequest.objects.all()}
    assert stored[fast.pk] == stored[orm.pk] == model_to_dict(orm)
    assert model_to_dict(orm)["params"] == {"max_tokens": 7, "stop": ["\n"], "temperature": 0.5}
    again = PromptRequest.objects.get(pk=fast.pk)
    assert (again.status, again.kind, again.enqueued_at) == ("queued", "chat", fast.enqueued_at)
    assert not fast._state.adding


def test_insert_request_keeps_nulls_and_empty_strings():
    row = a_request(kind=PromptRequest.Kind.COMPLETION, messages=None, prompt="")
    insert_request(row)
    again = PromptRequest.objects.get(pk=row.pk)
    assert (again.messages, again.prompt, again.started_at, again.prompt_tokens) == (
        None,
        "",
        None,
        None,
    )


def test_a_refused_insert_raises_djangos_database_error():
    row = a_request()
    insert_request(row)
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_request(a_request(id=row.pk))  # the same primary key
    assert PromptRequest.objects.count() == 1

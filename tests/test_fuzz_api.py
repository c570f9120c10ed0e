"""Fuzzing the API from its own OpenAPI document: schemathesis builds requests for every operation
(valid ones and ones that break the schema) and sends them to the production WSGI app with a
valid tenant key. No answer is a 5xx, every error is OpenAI-shaped, and a refused request stores
and enqueues nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from llmqueue.models import BulkJob, PromptRequest, StoredFile, Tenant
from project.wsgi import application
from tests.conftest import Seeded, pretend_live, queued_messages
from tests.fuzz_tally import count_generated
from tests.reliability_record import record

pytestmark = pytest.mark.django_db(transaction=True)
# bench/reliability.py asks for more than the suite runs (the 5,000).
FUZZ_EXAMPLES = int(os.environ.get("LLMQUEUE_FUZZ_EXAMPLES", "2000"))
ERROR_KEYS = ["code", "message", "param", "type"]


@pytest.fixture
def fuzz_tenant(seeded: Seeded, clean_redis: redis.Redis) -> Iterator[Seeded]:
    """The seeded tenant with its pools live. What it gets admitted is bounded by its own quota
    (20 at once, then 2 a second): the fuzz never fills the tier's queue, whose refusal would be
    a 503; the rows go with the test database, the files are deleted here."""
    pretend_live(clean_redis, "default")
    pretend_live(clean_redis, "tiny")
    Tenant.objects.filter(pk=seeded.tenant_id).update(requests_per_second=2.0, burst=20)
    yield seeded
    for stored in StoredFile.objects.all():
        stored.content.delete(save=False)


def stored_and_enqueued(client: redis.Redis) -> tuple[int, ...]:
    return (
        PromptRequest.objects.count(),
        StoredFile.objects.count(),
        BulkJob.objects.count(),
        queued_messages(client),
    )


def assert_openai_error(content: bytes, what: str) -> None:
    body = json.loads(content)
    assert sorted(body) == ["error"], what
    error = body["error"]
    assert sorted(error) == ERROR_KEYS, what
    assert isinstance(error["message"], str) and error["message"], what
    assert isinstance(error["type"], str), what
    assert error["param"] is None or isinstance(error["param"], str), what
    assert error["code"] is None or isinstance(error["code"], str), what


# Fields and headers whose valid values still depend on the tenant, tier or model (the schema
# cannot bound them): a random one is nearly always a 422.
TENANT_BOUND_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "deadline_seconds",
                       "service_tier", "prompt")  # fmt: skip
TENANT_BOUND_HEADERS = ("X-LLMQueue-Tier", "X-LLMQueue-Deadline-Seconds")


def make_plausible(case: Any) -> None:
    """A prompt for the served model within the tenant's limits: half the prompt requests then
    get past routing to admission, and some are admitted, stored and enqueued."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "sim"
        for name in TENANT_BOUND_FIELDS:
            case.body.pop(name, None)
        if "messages" not in case.body:
            case.body["prompt"] = "hello"
    for name in TENANT_BOUND_HEADERS:
        (case.headers or {}).pop(name, None)


def every_operation(schema: Any) -> st.SearchStrategy[Any]:
    """Cases for every operation: valid by the schema, and (where it has inputs) not."""
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        strategies.append(operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
        if operation.body or operation.path_parameters or operation.query or operation.headers:
            strategies.append(operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    return st.one_of(strategies)


def test_no_generated_request_gets_a_5xx_or_leaves_a_trace_when_refused(
    fuzz_tenant: Seeded, clean_redis: redis.Redis
):
    # The key is ours: generated (and removed) Authorization headers would only test the 401.
    config = SchemathesisConfig.from_dict({"generation": {"with-security-parameters": False}})
    schema = schemathesis.openapi.from_wsgi("/v1/openapi.json", application, config=config)
    headers = {"Authorization": f"Bearer {fuzz_tenant.key}", "X-LLMQueue-Background": "true"}
    baseline = [stored_and_enqueued(clean_redis)]
    answers: dict[int, int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=every_operation(schema), plausible=st.booleans())
    def fuzz(case: Any, plausible: bool) -> None:
        if plausible:
            make_plausible(case)
        count_generated("fuzzed over WSGI")
        response = case.call(headers=headers)
        what = f"{case.method} {case.formatted_path} {response.status_code}: "
        what += repr(response.content[:300])
        answers[response.status_code] = answers.get(response.status_code, 0) + 1
        assert response.status_code < 500, what
        if response.status_code >= 400:
            assert_openai_error(response.content, what)
            assert stored_and_enqueued(clean_redis) == baseline[0], what
        else:
            baseline[0] = stored_and_enqueued(clean_redis)

    fuzz()
    print(f"fuzz answers by status: {dict(sorted(answers.items()))}")
    assert sum(answers.values()) >= FUZZ_EXAMPLES * 0.9
    assert answers.get(202, 0) > 0, answers  # some prompts were admitted, stored and enqueued
    server_errors = sum(n for status, n in answers.items() if status >= 500)
    record("fuzz", requests=sum(answers.values()), server_errors=server_errors)

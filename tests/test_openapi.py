"""GET /v1/openapi.json: served without a key, generated from the request models, covering every
endpoint; and the models agree with the validator the request path runs (validation.py) on
which bodies are accepted and which refused."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from llmqueue.api import validation
from llmqueue.api.auth import Caller, TierView
from llmqueue.api.errors import ApiError
from llmqueue.api.openapi import OPERATIONS, REF, openapi_document
from llmqueue.api.request_models import BatchRequest, ChatCompletionRequest, CompletionRequest
from llmqueue.api.tiers import choose_tier
from llmqueue.api.urls import urlpatterns
from llmqueue.bulk import jobs
from llmqueue.queueing.routing import ModelRoute
from tests.fuzz_tally import count_generated
from tests.test_bad_input import Call, call

INT32_MAX = 2**31 - 1


def test_the_document_is_served_without_a_key_and_built_from_the_models(db: None):
    answer = call(Call("GET", "/v1/openapi.json"))
    assert answer.status == 200
    document = json.loads(answer.body)
    assert document["openapi"] == "3.1.0"
    assert document == json.loads(json.dumps(openapi_document()))
    schemas = document["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest, BatchRequest):
        generated = model.model_json_schema(ref_template=REF)
        generated.pop("$defs", None)  # shared in components.schemas
        assert schemas[model.__name__] == json.loads(json.dumps(generated))
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0] == {
        "type": "integer",
        "minimum": -(2**63),
        "maximum": 2**63 - 1,
    }
    assert schemas["CompletionRequest"]["additionalProperties"] is False


def _documented_path(route: str) -> str:
    return "/v1/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def test_every_route_is_documented_and_every_documented_path_is_a_route():
    routes = {_documented_path(str(p.pattern)) for p in urlpatterns if p.name != "unknown-route"}
    assert routes == {op.path for op in OPERATIONS}


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: f"{op.method} {op.path}")
def test_each_documented_method_is_served_and_no_other(db: None, op: Any):
    path = op.path.replace("{request_id}", "00000000-0000-0000-0000-000000000000")
    path = re.sub(r"\{\w+\}", "x", path)
    documented = {o.method.upper() for o in OPERATIONS if o.path == op.path}
    for method in ("GET", "POST", "DELETE", "PUT"):
        answer = call(Call(method, path))
        assert (answer.status == 405) == (method not in documented), (method, path, answer.body)


# --- the models agree with validation.py --------------------------------------------------------

# A max wait beyond any number: deadline_seconds is then bounded by the schema's rules alone.
ENDLESS = 10**400
INTERACTIVE = TierView(1, "interactive", 0, ENDLESS, None, INT32_MAX, 10, "")
FLEX = TierView(2, "flex-tier", 6, ENDLESS, None, INT32_MAX, 10, "flex")
PRIORITY = TierView(3, "priority-tier", 0, ENDLESS, None, INT32_MAX, 10, "priority")
# Limits that depend on the tenant, tier or model set beyond anything the schema bounds: what
# is left to compare is what the schema states for every tenant.
CALLER = Caller(
    key_id=1, tenant_id=1, tenant_name="t", tenant_active=True, key_revoked=False,
    max_tokens_per_request=INT32_MAX, requests_per_second=1.0, burst=1,
    tokens_per_minute=2**62, max_tier_share=1.0, tier_id=1, tier_name="interactive",
    tier_priority=0, max_wait_seconds=ENDLESS, first_token_target_seconds=None,
    default_max_tokens=INT32_MAX, max_queue_depth=10, tiers=(INTERACTIVE, FLEX, PRIORITY),
    allowed_tiers=frozenset({"interactive", "flex-tier", "priority-tier"}),
)  # fmt: skip
ROUTE = ModelRoute("sim", "default", context_length=2**62, max_tokens=INT32_MAX)
PARSERS = {
    CompletionRequest: validation.parse_completion,
    ChatCompletionRequest: validation.parse_chat,
}


def hand_accepts(model: type[BaseModel], raw: bytes) -> bool:
    """What the request path decides on `raw` up to admission (the model's name taken as found)."""
    try:
        body = validation.parse_json_object(raw)
        caller = choose_tier(CALLER, body.get("service_tier"), None)
        validation.model_name(body)
        PARSERS[model](body, caller, ROUTE, None)
    except ApiError:
        return False
    return True


def batch_accepts(raw: bytes) -> bool:
    try:
        body = validation.parse_json_object(raw)
        jobs.check_endpoint(body.get("endpoint"))
        jobs.completion_window_seconds(body.get("completion_window"))
        jobs.check_metadata(body.get("metadata"))
    except ApiError:
        return False
    file_id = body.get("input_file_id")
    return isinstance(file_id, str) and bool(file_id)


def model_accepts(model: type[BaseModel], raw: bytes) -> bool:
    try:
        model.model_validate_json(raw)
    except ValidationError:
        return False
    return True


def raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


GOOD = {"model": "sim", "prompt": "hello"}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION_EXAMPLES = [
    (GOOD, True),
    ({**GOOD, "prompt": ["hello"]}, True),
    ({**GOOD, "prompt": ["a", "b"]}, False),
    ({**GOOD, "prompt": " \t"}, False),
    ({**GOOD, "prompt": "\x1c"}, False),
    ({**GOOD, "prompt": "\ud800"}, False),
    ({**GOOD, "prompt": "a\x00"}, False),
    ({"prompt": "x"}, False),
    ({**GOOD, "model": ""}, False),
    ({**GOOD, "max_tokens": 0}, False),
    ({**GOOD, "max_tokens": 1}, True),
    ({**GOOD, "max_tokens": "4"}, False),
    ({**GOOD, "max_tokens": 2**31}, False),
    ({**GOOD, "temperature": True}, False),
    ({**GOOD, "temperature": 2}, True),
    ({**GOOD, "temperature": 2.0001}, False),
    ({**GOOD, "top_p": 0}, False),
    ({**GOOD, "top_k": -1}, True),
    ({**GOOD, "top_k": 0}, False),
    ({**GOOD, "top_k": -1.0}, False),
    ({**GOOD, "top_k": -2}, False),
    ({**GOOD, "top_k": INT32_MAX}, True),
    ({**GOOD, "n": 1}, True),
    ({**GOOD, "n": 2}, False),
    ({**GOOD, "n": True}, False),
    ({**GOOD, "seed": 2**63 - 1}, True),
    ({**GOOD, "seed": -(2**63)}, True),
    ({**GOOD, "seed": 99999999999999999999999}, False),
    ({**GOOD, "stop": "x"}, True),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, False),
    ({**GOOD, "stop": [1]}, False),
    ({**GOOD, "stream": True}, False),
    ({**GOOD, "stream": False}, True),
    ({**GOOD, "stream": 0}, False),
    ({**GOOD, "min_tokens": 5, "max_tokens": 4}, False),
    ({**GOOD, "min_tokens": 4, "max_tokens": 4}, True),
    ({**GOOD, "deadline_seconds": 0}, False),
    ({**GOOD, "deadline_seconds": 0.5}, True),
    ({**GOOD, "service_tier": "flex"}, True),
    ({**GOOD, "service_tier": "fast"}, False),
    ({**GOOD, "logprobs": 1}, False),
    (b'{"model": "sim", "prompt": "hi", "temperature": NaN}', False),
    (b'{"model": "sim", "prompt": "hi", "deadline_seconds": Infinity}', False),
]
CHAT_EXAMPLES = [
    (CHAT, True),
    ({**CHAT, "messages": []}, False),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, False),
    ({**CHAT, "messages": [{"role": [], "content": "x"}]}, False),
    ({**CHAT, "messages": [{"role": "user"}]}, False),
    ({**CHAT, "messages": [{"role": "user", "content": " "}]}, False),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, True),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}, False),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, True),
    ({**CHAT, "max_completion_tokens": 3}, True),
    ({**CHAT, "max_completion_tokens": 0}, False),
    ({**CHAT, "min_tokens": 9, "max_completion_tokens": 3}, False),
    ({**CHAT, "prompt": "x"}, False),
]
BATCH = {"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h"}
BATCH_EXAMPLES = [
    (BATCH, True),
    ({**BATCH, "endpoint": "/v1/embeddings"}, False),
    ({**BATCH, "endpoint": {}}, False),
    ({**BATCH, "completion_window": []}, False),
    ({**BATCH, "completion_window": "48h"}, False),
    ({**BATCH, "metadata": {"a": "b"}}, True),
    ({**BATCH, "metadata": {"a": 1}}, False),
    ({**BATCH, "metadata": {str(i): "v" for i in range(17)}}, False),
    ({**BATCH, "metadata": {"k" * 65: "v"}}, False),
    ({**BATCH, "input_file_id": ""}, False),
    ({**BATCH, "anything": "else"}, True),
]


@pytest.mark.parametrize(
    ("model", "body", "accepted"),
    [(CompletionRequest, b, a) for b, a in COMPLETION_EXAMPLES]
    + [(ChatCompletionRequest, b, a) for b, a in CHAT_EXAMPLES],
)
def test_the_models_and_the_validator_agree_on_examples(
    model: type[BaseModel], body: Any, accepted: bool
):
    assert hand_accepts(model, raw(body)) is accepted
    assert model_accepts(model, raw(body)) is accepted


@pytest.mark.parametrize(("body", "accepted"), BATCH_EXAMPLES)
def test_the_batch_model_and_the_batch_checks_agree_on_examples(body: Any, accepted: bool):
    assert batch_accepts(raw(body)) is accepted
    assert model_accepts(BatchRequest, raw(body)) is accepted


# Bodies valid by the schema, then (half the time) one field given any JSON value or dropped:
# about half are accepted, and the refused ones sit next to the accepted ones.
# Any value: near every bound the schema states, of every JSON type, and strings that are not
# text (a lone surrogate, NUL) or are blank by Python's rules but not a regex's (\x1c).
ODD_TEXT = st.text(alphabet=st.sampled_from("ab é\t\n\x1c\x00\ud800"), max_size=4)
SCALARS = st.one_of(
    st.none(), st.booleans(), ODD_TEXT,
    st.integers(-3, 6), st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1]),
    st.floats(-3, 3, allow_nan=False), st.sampled_from([1e-9, 1e-10, 0.0, 2.0, 1e300]),
)  # fmt: skip
ANY = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=5), st.dictionaries(ODD_TEXT, SCALARS, max_size=2)
)
TEXT = st.text(alphabet=st.sampled_from("ab é\t"), max_size=6)
WORDS = st.text(alphabet=st.sampled_from("ab é"), max_size=5).map(lambda t: t + "x")
INT32 = st.integers(1, INT32_MAX)
SAMPLING = {
    "max_tokens": st.one_of(INT32, st.integers(1, 9)),
    "temperature": st.one_of(st.floats(0, 2), st.integers(0, 2)),
    "top_p": st.floats(1e-9, 1),
    "top_k": st.one_of(st.just(-1), INT32),
    "n": st.just(1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.just(False),
    "user": TEXT,
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_tokens": st.integers(0, 9),
    "ignore_eos": st.booleans(),
    "background": st.booleans(),
    "deadline_seconds": st.one_of(st.floats(0, 10**6, exclude_min=True), st.integers(1, 10**6)),
    "service_tier": st.sampled_from(["auto", "default", "flex", "priority"]),
}
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(sorted(validation.CHAT_ROLES)),
     "content": st.one_of(WORDS, TEXT, st.lists(PART, max_size=2))},
    optional={"name": TEXT},
)  # fmt: skip
CHAT_FIELDS = {"messages": st.lists(MESSAGE, min_size=1, max_size=3),
               "max_completion_tokens": INT32, **SAMPLING}  # fmt: skip
COMPLETION_FIELDS = {"prompt": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=1)),
                     **SAMPLING}  # fmt: skip
BATCH_FIELDS = {
    "input_file_id": WORDS,
    "endpoint": st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    "completion_window": st.just("24h"),
    "metadata": st.dictionaries(WORDS, TEXT, max_size=4),
    "extra": TEXT,
}


@st.composite
def near_valid(draw: Any, fields: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    optional = {name: value for name, value in fields.items() if name not in required}
    body = draw(st.fixed_dictionaries({name: fields[name] for name in required}, optional=optional))
    if draw(st.booleans()):
        field = draw(st.sampled_from([*sorted(fields), "logprobs"]))
        if draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(ANY)
    return body


COMPLETIONS = near_valid({"model": WORDS, **COMPLETION_FIELDS}, ("model", "prompt"))
CHATS = near_valid({"model": WORDS, **CHAT_FIELDS}, ("model", "messages"))
BATCHES = near_valid(BATCH_FIELDS, ("input_file_id", "endpoint", "completion_window"))
AGREE = settings(max_examples=600, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@AGREE
@given(body=COMPLETIONS)
def test_the_completion_model_and_the_validator_agree(body: dict[str, Any]):
    count_generated("validator agreement")
    assert hand_accepts(CompletionRequest, raw(body)) is model_accepts(CompletionRequest, raw(body))


@AGREE
@given(body=CHATS)
def test_the_chat_model_and_the_validator_agree(body: dict[str, Any]):
    # With both, the validator reads max_completion_tokens alone (as vLLM does); the model
    # checks both.
    assume(body.get("max_completion_tokens") is None or body.get("max_tokens") is None)
    count_generated("validator agreement")
    assert hand_accepts(ChatCompletionRequest, raw(body)) is model_accepts(
        ChatCompletionRequest, raw(body)
    )


@AGREE
@given(body=BATCHES)
def test_the_batch_model_and_the_batch_checks_agree(body: dict[str, Any]):
    count_generated("validator agreement")
    assert batch_accepts(raw(body)) is model_accepts(BatchRequest, raw(body))

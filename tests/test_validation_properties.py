"""Properties of the request validators on generated input: any bytes, any JSON body become a
PromptSpec the engine can take or a 4xx in OpenAI's shape, never another exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmqueue.api import validation
from llmqueue.api.errors import ApiError, error_response
from tests.fuzz_tally import count_generated
from tests.test_openapi import CALLER, ROUTE
from tests.test_openapi import CHATS as near_valid_chats
from tests.test_openapi import COMPLETIONS as near_valid_completions

PROPERTIES = settings(max_examples=600, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
TEXT = st.text(max_size=6)  # every code point, lone surrogates and NUL included
JSON = st.recursive(
    st.none() | st.booleans() | TEXT | st.floats() | st.integers()
    | st.integers(min_value=2**62, max_value=2**70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
FIELDS = sorted(validation.CHAT_FIELDS | validation.COMPLETION_FIELDS)


def assert_refusal(error: ApiError) -> None:
    assert 400 <= error.status < 500, error
    body = json.loads(error_response(error).content)["error"]
    assert sorted(body) == ["code", "message", "param", "type"]
    assert body["message"]


def assert_engine_can_take(spec: validation.PromptSpec) -> None:
    """What reaches the row, the task message and the engine: text that encodes, integers
    within their bounds, a JSON round trip that changes nothing."""
    texts = [spec.prompt, *(m["content"] for m in spec.messages or [])]
    assert all(validation.is_storable_text(t) for t in texts)
    for field, (low, high) in validation.INTEGER_BOUNDS.items():
        value = spec.params.get(field)
        assert value is None or low <= value <= high
    assert json.loads(json.dumps(spec.params, allow_nan=False)) == spec.params


def any_body(required: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies with the required fields of any JSON value, every known field (and one nobody
    knows) sometimes present with any JSON value."""
    optional = {name: JSON for name in [*FIELDS, "unknown"] if name not in required}
    return st.fixed_dictionaries({name: JSON for name in required}, optional=optional)


# Near-valid bodies (tests/test_openapi.py: about half accepted) and bodies of anything.
COMPLETIONS = st.one_of(near_valid_completions, any_body(("model", "prompt")))
CHATS = st.one_of(near_valid_chats, any_body(("model", "messages")))


@PROPERTIES
@given(raw=st.one_of(st.binary(max_size=64), JSON.map(lambda v: json.dumps(v).encode())))
def test_any_bytes_are_a_json_object_or_a_400(raw: bytes):
    count_generated("validator properties")
    try:
        body = validation.parse_json_object(raw)
    except ApiError as error:
        assert error.status == 400
        assert_refusal(error)
        return
    assert isinstance(body, dict)


def check_spec_or_refusal(body: dict[str, Any], parse: Any) -> None:
    """`body` parses to a spec the engine can take, or is refused as a 4xx."""
    count_generated("validator properties")
    try:
        parsed = validation.parse_json_object(json.dumps(body).encode())
        spec = parse(parsed, CALLER, ROUTE, None)
    except ApiError as error:
        assert_refusal(error)
        return
    assert_engine_can_take(spec)


@PROPERTIES
@given(body=COMPLETIONS)
def test_any_completion_body_is_a_spec_or_a_4xx(body: dict[str, Any]):
    check_spec_or_refusal(body, validation.parse_completion)


@PROPERTIES
@given(body=CHATS)
def test_any_chat_body_is_a_spec_or_a_4xx(body: dict[str, Any]):
    check_spec_or_refusal(body, validation.parse_chat)


def faulty(value: Any, depth: int = 0) -> bool:
    """The rule check_text applies, written as plainly as it reads: a string that is not text,
    or a container MAX_NESTING or more levels down."""
    if isinstance(value, str):
        return not validation.is_storable_text(value)
    if isinstance(value, dict | list):
        if depth >= validation.MAX_NESTING:
            return True
        items = [*value, *value.values()] if isinstance(value, dict) else value
        return any(faulty(item, depth + 1) for item in items)
    return False


def wrapped(value: Any, times: int) -> Any:
    for _ in range(times):
        value = [value]
    return value


@settings(PROPERTIES, max_examples=400)
@given(body=st.dictionaries(TEXT, st.tuples(JSON, st.integers(0, 40)).map(lambda v: wrapped(*v))))
def test_check_text_refuses_exactly_what_the_rule_says(body: dict[str, Any]):
    count_generated("validator properties")
    try:
        validation.check_text(body)
    except ApiError as error:
        assert error.status == 400
        assert faulty(body)
        return
    assert not faulty(body)


FINITE_JSON = st.recursive(
    st.none() | st.booleans() | TEXT | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=10,
)  # fmt: skip


@settings(PROPERTIES, max_examples=400)
@given(
    body=st.dictionaries(
        TEXT, st.tuples(FINITE_JSON, st.integers(0, 34)).map(lambda v: wrapped(*v)), max_size=3
    ),
    ascii_only=st.booleans(),
    encoding=st.sampled_from(["utf-8", "utf-16"]),
)
def test_a_body_is_refused_exactly_when_the_rule_says_whatever_its_bytes(
    body: dict[str, Any], ascii_only: bool, encoding: str
):
    """The shortcut that reads a body's bytes (surely_storable) never lets a fault through:
    escaped or raw surrogates and NUL, UTF-8 or UTF-16."""
    count_generated("validator properties")
    raw = json.dumps(body, ensure_ascii=ascii_only).encode(encoding, "surrogatepass")
    try:
        validation.parse_json_object(raw)
    except ApiError as error:
        assert error.status == 400
        assert faulty(body)
        return
    assert not faulty(body)

"""Request bodies → PromptSpec: OpenAI-compatible parsing with a clear 4xx for every bad input."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn

from django.conf import settings

from llmqueue.api.auth import Caller
from llmqueue.api.errors import BadRequest, InvalidParameter, PromptTooLarge
from llmqueue.queueing.routing import ModelRoute

# OpenAI fields we honour, shared by both endpoints. Others are rejected, as OpenAI does, rather
# than silently ignored: a caller relying on `logprobs` must learn it got none.
_SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "background",
    "deadline_seconds",
}
# service_tier picks the request's tier before validation (llmqueue/api/tiers.py).
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS | {"model", "prompt", "service_tier"})
CHAT_FIELDS = frozenset(
    _SAMPLING_FIELDS | {"model", "messages", "max_completion_tokens", "service_tier"}
)
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
MAX_STOP_SEQUENCES = 4
# OpenAI's bodies nest four deep (messages[].content[].text); refusing far deeper ones here keeps
# every later recursive step (the row's JSON, the task message, the engine) within its stack.
MAX_NESTING = 32
# What each integer may hold on its way to the engine: vLLM keeps seeds as int64 and its batch's
# top_k and token counts in int32 tensors; a larger value crashes there, after admission.
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
INTEGER_BOUNDS = {
    "seed": INT64,
    "top_k": INT32,
    "n": INT32,
    "min_tokens": INT32,
    "max_tokens": INT32,
    "max_completion_tokens": INT32,
}


@dataclass(frozen=True)
class PromptSpec:
    """A validated prompt: what the engine runs and what admission counts."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    messages: list[dict[str, str]] | None
    params: dict[str, Any]
    estimated_prompt_tokens: int
    background: bool
    # A tighter deadline than the tier's max wait, in seconds from submission (None: the tier's).
    deadline_seconds: float | None = None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Python's json takes NaN and Infinity, which JSON has not: refused as the syntax errors they are.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def decode_json(raw: bytes, what: str = "body") -> Any:
    """`raw` as JSON, or BadRequest: bad syntax or encoding, NaN, an integer of more than 4300
    digits (Python's limit), nesting deeper than the interpreter's recursion limit."""
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"The {what} is not valid JSON: {exc}.", code="invalid_json") from exc
    except RecursionError:
        raise BadRequest(
            f"The {what} nests too deeply (at most {MAX_NESTING} levels).", code="invalid_json"
        ) from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    body = decode_json(raw or b"null")
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.", code="invalid_json")
    if not surely_storable(raw):
        check_text(body)
    return body


def surely_storable(raw: bytes) -> bool:
    """Whether JSON `raw` cannot hold what check_text refuses, read off its bytes in C (most
    bodies: then the walk is skipped). In UTF-8 a NUL or a lone surrogate takes a \\u escape or
    a surrogate's lead byte 0xED, and MAX_NESTING levels take as many brackets; a body in
    UTF-16 or UTF-32 (which JSON allows) has NUL bytes, and is walked."""
    return (
        b"\\u" not in raw
        and b"\xed" not in raw
        and b"\x00" not in raw
        and raw.count(b"[") + raw.count(b"{") <= MAX_NESTING
    )


def is_storable_text(text: str) -> bool:
    """Text the database and the tokenizer take: UTF-8 encodable (no lone surrogate such as
    "\\ud800") and without NUL, which PostgreSQL's text and jsonb refuse."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return False
    return "\x00" not in text


def _field_path(path: tuple[str | int, ...]) -> str:
    """`messages[0].content`: how params name a field deep in the body."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


def check_text(body: dict[str, Any]) -> None:
    """Every string of `body` (keys too) storable, every container within MAX_NESTING levels;
    else BadRequest naming the field. Level by level in C-speed extends, without recursion (the
    input chooses the depth); only a body that fails is walked again to name where."""
    level: list[Any] = [body]
    depth = 0
    while level:
        below: list[Any] = []
        for value in level:
            if isinstance(value, str):
                # isascii() is a flag lookup: most strings cost no more than that and a memchr.
                if (not value.isascii() or "\x00" in value) and not is_storable_text(value):
                    _name_the_fault(body)
            elif isinstance(value, dict):
                if depth >= MAX_NESTING:
                    _name_the_fault(body)
                below.extend(value)  # its keys
                below.extend(value.values())
            elif isinstance(value, list):
                if depth >= MAX_NESTING:
                    _name_the_fault(body)
                below.extend(value)
        level = below
        depth += 1


def _name_the_fault(body: dict[str, Any]) -> NoReturn:
    """Raise the BadRequest for `body`'s first unstorable string or too-deep container."""
    pending: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if not is_storable_text(value):
                raise _bad_text(path)
            continue
        if isinstance(value, dict | list) and len(path) >= MAX_NESTING:
            raise BadRequest(
                f"'{_field_path(path)}' nests deeper than {MAX_NESTING} levels.",
                code="invalid_request",
                param=_field_path(path),
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if not is_storable_text(key):
                    raise _bad_text(path)
                pending.append((item, (*path, key)))
        elif isinstance(value, list):
            pending.extend((item, (*path, index)) for index, item in enumerate(value))
    raise AssertionError("check_text found a fault that is not there")


def _bad_text(path: tuple[str | int, ...]) -> BadRequest:
    field = _field_path(path) or None
    return BadRequest(
        f"'{field or 'body'}' holds a lone UTF-16 surrogate or a NUL character: send text "
        "that encodes as UTF-8, without NUL.",
        code="invalid_text",
        param=field,
    )


def estimate_tokens(text: str) -> int:
    """Tokens a prompt will take, before the worker's tokenizer counts them exactly."""
    return max(1, math.ceil(len(text.encode()) / settings.LLMQUEUE_BYTES_PER_TOKEN))


def _reject_unknown(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(
            f"Unrecognized request argument supplied: {', '.join(unknown)}.",
            code="unknown_parameter",
            param=unknown[0],
        )


def _typed(body: dict[str, Any], field: str, kinds: tuple[type, ...], label: str) -> Any:
    value = body.get(field)
    if value is None:
        return None
    # bool is an int subclass in Python; JSON's true is not a number.
    is_bool_mismatch = isinstance(value, bool) and bool not in kinds
    if is_bool_mismatch or not isinstance(value, kinds):
        raise BadRequest(f"'{field}' must be {label}.", code="invalid_type", param=field)
    return value


def _integer(body: dict[str, Any], field: str) -> int | None:
    """An integer field within what the engine can hold (INTEGER_BOUNDS); None when absent."""
    value: int | None = _typed(body, field, (int,), "an integer")
    low, high = INTEGER_BOUNDS[field]
    if value is not None and not low <= value <= high:
        raise BadRequest(
            f"'{field}' must be an integer from {low} to {high}.",
            code="integer_out_of_range",
            param=field,
        )
    return value


def _in_range(field: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidParameter(f"'{field}' must be between {low} and {high}.", param=field)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings.", param="stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidParameter(
            f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences.", param="stop"
        )
    return stop


def _max_tokens_limit(caller: Caller, route: ModelRoute) -> int:
    return min(caller.max_tokens_per_request, route.max_tokens)


def _sampling_params(
    body: dict[str, Any], caller: Caller, route: ModelRoute, max_tokens_field: str
) -> dict[str, Any]:
    if _typed(body, "stream", (bool,), "a boolean"):
        raise BadRequest("Streaming is not supported; omit 'stream'.", param="stream")
    n = _integer(body, "n")
    if n not in (None, 1):
        raise InvalidParameter("Only n=1 is supported.", param="n")
    _typed(body, "user", (str,), "a string")
    limit = _max_tokens_limit(caller, route)
    max_tokens = _integer(body, max_tokens_field)
    if max_tokens is None:
        max_tokens = min(caller.default_max_tokens, limit)
    if not 1 <= max_tokens <= limit:
        raise InvalidParameter(
            f"'{max_tokens_field}' must be between 1 and {limit} for this tenant and model.",
            param=max_tokens_field,
        )
    params: dict[str, Any] = {"max_tokens": max_tokens, "stop": _stop(body)}
    for field, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 1e-9, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = _typed(body, field, (int, float), "a number")
        _in_range(field, value, low, high)
        if value is not None:
            params[field] = float(value)
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise InvalidParameter("'top_k' must be -1 or at least 1.", param="top_k")
    min_tokens = _integer(body, "min_tokens")
    _in_range("min_tokens", min_tokens, 0, max_tokens)
    seed = _integer(body, "seed")
    ignore_eos = _typed(body, "ignore_eos", (bool,), "a boolean")
    for field, value in (("top_k", top_k), ("min_tokens", min_tokens), ("seed", seed)):
        if value is not None:
            params[field] = value
    if ignore_eos:
        params["ignore_eos"] = True
    return params


def _check_context(tokens: int, params: dict[str, Any], route: ModelRoute) -> None:
    if tokens > route.context_length:
        raise PromptTooLarge(
            f"The prompt is about {tokens} tokens; model {route.name!r} takes at most "
            f"{route.context_length}.",
            param="prompt",
        )
    if tokens + params["max_tokens"] > route.context_length:
        raise InvalidParameter(
            f"The prompt (about {tokens} tokens) plus max_tokens ({params['max_tokens']}) exceeds "
            f"model {route.name!r}'s context of {route.context_length} tokens.",
            code="context_length_exceeded",
            param="max_tokens",
        )


def wants_background(body: dict[str, Any], header: str | None) -> bool:
    """Background mode: body `"background": true` or header `X-LLMQueue-Background: true`."""
    flag = _typed(body, "background", (bool,), "a boolean")
    return bool(flag) or (header or "").strip().lower() in {"1", "true", "yes"}


def deadline_seconds(body: dict[str, Any], header: str | None, caller: Caller) -> float | None:
    """A per-request deadline: body `"deadline_seconds": 2.5` or header
    `X-LLMQueue-Deadline-Seconds: 2.5`; at most the tier's max wait (None: the tier's)."""
    value = _typed(body, "deadline_seconds", (int, float), "a number")
    if value is None and header is not None:
        try:
            value = float(header)
        except ValueError:
            raise BadRequest(
                "Header X-LLMQueue-Deadline-Seconds must be a number.", param="deadline_seconds"
            ) from None
    if value is None:
        return None
    if not 0 < value <= caller.max_wait_seconds or math.isnan(value):
        raise InvalidParameter(
            f"'deadline_seconds' must be above 0 and at most tier {caller.tier_name!r}'s max "
            f"wait of {caller.max_wait_seconds} s.",
            param="deadline_seconds",
        )
    return float(value)


def wait_seconds(spec: PromptSpec, caller: Caller) -> float:
    """How long the request may wait for an engine: its own deadline, or its tier's max wait."""
    return spec.deadline_seconds or float(caller.max_wait_seconds)


def model_name(body: dict[str, Any]) -> str:
    name = _typed(body, "model", (str,), "a string")
    if not name:
        raise BadRequest("'model' is required.", code="missing_parameter", param="model")
    return str(name)


def parse_completion(
    body: dict[str, Any],
    caller: Caller,
    route: ModelRoute,
    background_header: str | None,
    deadline_header: str | None = None,
) -> PromptSpec:
    _reject_unknown(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise BadRequest("'prompt' is required.", code="missing_parameter", param="prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string (batches: one request each).", param="prompt")
    if not prompt.strip():
        raise InvalidParameter("'prompt' must not be empty.", param="prompt")
    params = _sampling_params(body, caller, route, "max_tokens")
    tokens = estimate_tokens(prompt)
    _check_context(tokens, params, route)
    return PromptSpec(
        "completion",
        route.name,
        prompt,
        None,
        params,
        tokens,
        wants_background(body, background_header),
        deadline_seconds(body, deadline_header, caller),
    )


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadRequest(
        f"messages[{index}].content must be a string or a list of text parts.",
        param=f"messages[{index}].content",
    )


def parse_messages(raw: Any) -> list[dict[str, str]]:
    if raw is None:
        raise BadRequest("'messages' is required.", code="missing_parameter", param="messages")
    if not isinstance(raw, list):
        raise BadRequest("'messages' must be a list.", param="messages")
    if not raw:
        raise InvalidParameter("'messages' must not be empty.", param="messages")
    messages = []
    for index, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{index}] must be an object with a role in {sorted(CHAT_ROLES)}.",
                param=f"messages[{index}]",
            )
        messages.append({"role": role, "content": _message_text(message.get("content"), index)})
    if not any(m["content"].strip() for m in messages):
        raise InvalidParameter("'messages' must not all be empty.", param="messages")
    return messages


def parse_chat(
    body: dict[str, Any],
    caller: Caller,
    route: ModelRoute,
    background_header: str | None,
    deadline_header: str | None = None,
) -> PromptSpec:
    _reject_unknown(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    field = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    params = _sampling_params(body, caller, route, field)
    # Role markers cost a few tokens per message on top of the text.
    tokens = sum(estimate_tokens(m["content"]) + 4 for m in messages)
    _check_context(tokens, params, route)
    return PromptSpec(
        "chat",
        route.name,
        "",
        messages,
        params,
        tokens,
        wants_background(body, background_header),
        deadline_seconds(body, deadline_header, caller),
    )

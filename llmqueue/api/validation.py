"""Request bodies → PromptSpec: OpenAI-compatible parsing with a clear 4xx for every bad input."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

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


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"The body is not valid JSON: {exc}.", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.", code="invalid_json")
    return body


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
    if body.get("stream"):
        raise BadRequest("Streaming is not supported; omit 'stream'.", param="stream")
    n = _typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise InvalidParameter("Only n=1 is supported.", param="n")
    _typed(body, "user", (str,), "a string")
    limit = _max_tokens_limit(caller, route)
    max_tokens = _typed(body, max_tokens_field, (int,), "an integer")
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
    top_k = _typed(body, "top_k", (int,), "an integer")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise InvalidParameter("'top_k' must be -1 or at least 1.", param="top_k")
    min_tokens = _typed(body, "min_tokens", (int,), "an integer")
    _in_range("min_tokens", min_tokens, 0, max_tokens)
    seed = _typed(body, "seed", (int,), "an integer")
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
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{index}] must be an object with a role in {sorted(CHAT_ROLES)}.",
                param=f"messages[{index}]",
            )
        messages.append(
            {"role": message["role"], "content": _message_text(message.get("content"), index)}
        )
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

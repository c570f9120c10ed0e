"""A batch input file's lines → validated prompts, with the same validation as single requests.

Each line is `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}` (a JSONL
line, or a CSV row made one by llmqueue/bulk/csv_input.py); its body is
checked by the API's own parser for that endpoint (llmqueue/api/validation.py), so a line is
accepted exactly when the same body sent alone would be (and could ever fit the tenant's tokens
per minute). Every line is checked before anything is stored: one bad line fails the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.conf import settings

from llmqueue.admission.request import tokens_needed
from llmqueue.api import validation
from llmqueue.api.auth import Caller
from llmqueue.api.errors import ApiError
from llmqueue.api.validation import PromptSpec
from llmqueue.queueing.routing import ModelRoute, resolve_model

ENDPOINTS: dict[str, Callable[..., PromptSpec]] = {
    "/v1/chat/completions": validation.parse_chat,
    "/v1/completions": validation.parse_completion,
}
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
T = TypeVar("T")


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as an editor shows it
    custom_id: str
    spec: PromptSpec


@dataclass(frozen=True)
class LineError:
    """Why a batch failed validation: OpenAI's `errors.data` item."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class LineInvalid(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Parsed:
    """A whole file's lines, or why it was refused; `route` is the model every line names."""

    lines: list[Line]
    errors: list[LineError]
    route: ModelRoute | None


def line_object(raw: bytes) -> dict[str, Any]:
    """One JSONL line as a line object, or why it is not one."""
    try:
        obj = validation.decode_json(raw, "line")
        if isinstance(obj, dict) and not validation.surely_storable(raw):
            validation.check_text(obj)
    except ApiError as error:
        raise LineInvalid(error.code or "invalid_json", error.message, error.param) from error
    if not isinstance(obj, dict):
        raise LineInvalid("invalid_json", "The line must be a JSON object.")
    unknown = sorted(set(obj) - LINE_FIELDS)
    if unknown:
        raise LineInvalid("invalid_request", f"Unknown field {unknown[0]!r}.", unknown[0])
    return obj


def _check_envelope(obj: dict[str, Any], endpoint: str) -> str:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineInvalid(
            "missing_custom_id", "'custom_id' must be a non-empty string.", "custom_id"
        )
    if len(custom_id) > 200:
        raise LineInvalid(
            "invalid_custom_id", "'custom_id' takes at most 200 characters.", "custom_id"
        )
    if obj.get("method") != "POST":
        raise LineInvalid("invalid_method", "'method' must be 'POST'.", "method")
    if obj.get("url") != endpoint:
        raise LineInvalid("invalid_url", f"'url' must be the batch's endpoint {endpoint!r}.", "url")
    if not isinstance(obj.get("body"), dict):
        raise LineInvalid("invalid_body", "'body' must be a JSON object.", "body")
    return custom_id


def _spec(body: dict[str, Any], caller: Caller, route: ModelRoute, endpoint: str) -> PromptSpec:
    try:
        spec = ENDPOINTS[endpoint](body, caller, route, None)
    except ApiError as error:
        raise LineInvalid(error.code or "invalid_request", error.message, error.param) from error
    if tokens_needed(spec) > caller.tokens_per_minute:
        raise LineInvalid(
            "tokens_per_minute_exceeded",
            f"The prompt (about {spec.estimated_prompt_tokens} tokens) plus max_tokens "
            f"({spec.params['max_tokens']}) exceeds the tenant's limit of "
            f"{caller.tokens_per_minute} tokens per minute.",
            "body.max_tokens",
        )
    return spec


def _route(body: dict[str, Any], current: ModelRoute | None) -> ModelRoute:
    try:
        name = validation.model_name(body)
        if current is not None and name != current.name:
            raise LineInvalid(
                "mismatched_model",
                f"Every line of a batch must use one model: {current.name!r}, not {name!r}.",
                "body.model",
            )
        return current or resolve_model(name)
    except ApiError as error:
        raise LineInvalid(error.code or "invalid_request", error.message, "body.model") from error


def jsonl_entries(data: bytes) -> list[tuple[int, bytes]]:
    """A JSONL file's non-blank lines with their 1-based numbers."""
    return [(n, raw) for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]


def parse_lines(data: bytes, caller: Caller, endpoint: str) -> Parsed:
    """Every line of a JSONL file validated; the first LLMQUEUE_BULK_MAX_ERRORS errors if any."""
    return parse_entries(jsonl_entries(data), line_object, caller, endpoint)


def parse_entries(
    entries: Sequence[tuple[int, T]],
    decode: Callable[[T], dict[str, Any]],
    caller: Caller,
    endpoint: str,
) -> Parsed:
    """Numbered entries of any input format, each made a line object by `decode` (which raises
    LineInvalid), then validated as one batch: a JSONL file's lines, a CSV file's rows."""
    limit = settings.LLMQUEUE_BULK_MAX_ERRORS
    if not entries:
        return Parsed([], [LineError("empty_file", "The input file has no lines.")], None)
    if len(entries) > settings.LLMQUEUE_BULK_MAX_LINES:
        message = (
            f"The input file has {len(entries)} lines; a batch takes at most "
            f"{settings.LLMQUEUE_BULK_MAX_LINES}."
        )
        return Parsed([], [LineError("too_many_lines", message)], None)
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    route: ModelRoute | None = None
    for number, raw in entries:
        try:
            obj = decode(raw)
            custom_id = _check_envelope(obj, endpoint)
            if custom_id in seen:
                raise LineInvalid(
                    "duplicate_custom_id",
                    f"custom_id {custom_id!r} appears more than once; each line needs its own.",
                    "custom_id",
                )
            seen.add(custom_id)
            route = _route(obj["body"], route)
            lines.append(Line(number, custom_id, _spec(obj["body"], caller, route, endpoint)))
        except LineInvalid as invalid:
            errors.append(LineError(invalid.code, invalid.message, number, invalid.param))
            if len(errors) >= limit:
                break
    return Parsed(lines, errors, route)

"""The API's request bodies as pydantic models: the source of its OpenAPI document.

validation.py stays the validator on the request path (its messages, params and codes are the
API's); these models state the same rules as a schema, and tests/test_openapi.py checks that both
accept and refuse the same bodies. What depends on the tenant, tier or model (the max_tokens cap,
the context, the deadline's bound) is checked on top, as a 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from django.conf import settings
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from llmqueue.api.errors import BadRequest
from llmqueue.api.tiers import SERVICE_TIERS
from llmqueue.api.validation import (
    CHAT_ROLES,
    INT32,
    INT64,
    MAX_STOP_SEQUENCES,
    check_text,
    is_storable_text,
)
from llmqueue.bulk.jobs import METADATA_KEY_CHARS, METADATA_PAIRS, METADATA_VALUE_CHARS
from llmqueue.bulk.lines import ENDPOINTS


def _storable(text: str) -> str:
    if not is_storable_text(text):
        raise ValueError("text must encode as UTF-8 and hold no NUL character")
    return text


class StorableBody(BaseModel):
    """A body whose every string is storable and whose nesting is bounded, extra fields and
    message parts included (validation.check_text, run on the raw input)."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            try:
                check_text(data)
            except BadRequest as error:
                raise ValueError(error.message) from None
        return data


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


# Strings the database and the engine's tokenizer take (validation.is_storable_text).
Text = Annotated[str, AfterValidator(_storable)]
# Python's str.strip() decides blankness; the pattern says the same for the schema's readers.
NonBlankText = Annotated[
    Text, AfterValidator(_not_blank), Field(json_schema_extra={"pattern": r"[^\s\x1c-\x1f]"})
]
TokenCount = Annotated[int, Field(ge=1, le=INT32[1])]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be -1 (no limit) or at least 1")
    return value


def _not_true(value: bool) -> bool:
    if value:
        raise ValueError("streaming is not supported")
    return value


# Refinements as validators, not Literal: a strict Literal[False] still takes JSON's 0.
TopK = Annotated[
    int,
    Field(ge=-1, le=INT32[1], json_schema_extra={"not": {"const": 0}}),
    AfterValidator(_not_zero),
]
NoStream = Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_not_true)]
Number = float  # strict: a JSON number, never a boolean


class TextPart(BaseModel):
    """One part of a message's content; only text parts are taken."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: Literal[tuple(sorted(CHAT_ROLES))]  # type: ignore[valid-type]
    content: Text | list[TextPart]


class SamplingFields(StorableBody):
    """Fields both prompt endpoints take. Unknown fields are refused, as OpenAI does."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: Annotated[Text, Field(min_length=1)]
    max_tokens: TokenCount | None = Field(
        None, description="At most the tenant's and the model's cap (else 422)."
    )
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(ge=1e-9, le=1.0)] | None = None
    top_k: TopK | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(None, description="Only 1.")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = None
    stream: NoStream | None = Field(None, description="Streaming is not supported.")
    user: Text | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32[1])] | None = Field(
        None, description="At most max_tokens."
    )
    ignore_eos: bool | None = None
    background: bool | None = Field(
        None, description="Answer 202 at once with the request's status; poll it."
    )
    deadline_seconds: Annotated[Number, Field(gt=0.0)] | None = Field(
        None, description="A tighter deadline than the tier's max wait (at most that wait)."
    )
    service_tier: Literal[SERVICE_TIERS] | None = None  # type: ignore[valid-type]

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingFields:
        limit = self._max_tokens()
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must be at most max_tokens")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: NonBlankText | Annotated[list[NonBlankText], Field(min_length=1, max_length=1)]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = Field(
        None, description="Takes the place of max_tokens when given."
    )

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _not_all_blank(self) -> ChatCompletionRequest:
        texts = (
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            for m in self.messages
        )
        if not any(text.strip() for text in texts):
            raise ValueError("messages must not all be empty")
        return self


class BatchRequest(StorableBody):
    """POST /v1/batches: a batch of the lines of an uploaded file (purpose "batch")."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    input_file_id: Annotated[Text, Field(min_length=1)]
    endpoint: Literal[tuple(ENDPOINTS)]  # type: ignore[valid-type]
    completion_window: Literal[tuple(settings.LLMQUEUE_BULK_COMPLETION_WINDOWS)]  # type: ignore[valid-type]
    metadata: (
        Annotated[
            dict[
                Annotated[Text, Field(max_length=METADATA_KEY_CHARS)],
                Annotated[Text, Field(max_length=METADATA_VALUE_CHARS)],
            ],
            Field(max_length=METADATA_PAIRS),
        ]
        | None
    ) = None


class FileUpload(BaseModel):
    """POST /v1/files, multipart/form-data: a JSONL file of batch lines."""

    model_config = ConfigDict(extra="forbid")

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error's body, OpenAI's shape."""

    error: ErrorDetail

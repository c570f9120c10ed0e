"""The engine adapter interface: what a worker hands an engine and what comes back."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt for the engine. Exactly one of `prompt` / `messages` is used."""

    request_id: str
    prompt: str = ""
    messages: list[dict[str, str]] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0  # 0 is the most urgent, as in vLLM's priority scheduling
    lane: str = ""  # the queue it came from, for the worker's admission to the engine


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    first_token_step: int  # engine step (1-based count) that produced the first output token
    finished_step: int
    first_token_at: float | None = None  # wall-clock epoch seconds that step ended, if known


class EngineError(Exception):
    """The engine rejected a request as invalid: the request's fault, not the engine's."""


class PromptTooLong(EngineError):
    """The prompt (with max_tokens) does not fit the model's context."""


class Engine(Protocol):
    """One warm engine per worker process; many task threads submit to it at once."""

    model_name: str

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]: ...

    def abort(self, request_id: str) -> None:
        """Drop a submitted request; its future fails (workers.batching.RequestAborted)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def generation_request(
    request_id: str,
    prompt: str,
    messages: Any,
    params: dict[str, Any],
    priority: int,
    lane: str = "",
) -> GenerationRequest:
    """Build a GenerationRequest from a task's JSON fields (unknown params are ignored)."""
    known = {k: v for k, v in params.items() if k in GenerationRequest.__dataclass_fields__}
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        messages=messages,
        priority=priority,
        lane=lane,
        **known,
    )

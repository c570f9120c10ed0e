"""The generate task: its Celery name, its one argument (a list of payloads), and its options."""

from __future__ import annotations

from typing import Any, TypedDict

GENERATE_TASK = "llmqueue.generate"
# The worker's recorder publishes each request's outcome under the request's own id, so the
# task's own result is never stored: the API's hand-built message says so in its header, as
# apply_async would from the task's setting, and the worker's task is declared with it.
GENERATE_IGNORE_RESULT = True


class TaskPayload(TypedDict):
    """All a worker needs to run one request without reading the DB first."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    messages: list[dict[str, str]] | None
    params: dict[str, Any]
    priority: int
    deadline_ts: float  # wall-clock epoch seconds

"""The JSON arguments of one generate task: all a worker needs without reading the DB first."""

from __future__ import annotations

from typing import Any, TypedDict


class TaskPayload(TypedDict):
    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    messages: list[dict[str, str]] | None
    params: dict[str, Any]
    priority: int
    deadline_ts: float  # wall-clock epoch seconds

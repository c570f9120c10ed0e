"""Lifecycle events as structured logs: one JSON line per event, the same shape from both programs.

The API logs `admitted`, `rejected` and `cancelled`; a worker's recorder logs `dispatched`,
`first_token`, `finished` and `expired` once the rows say so. Each line holds the request id,
tenant, tier, pool and the event's timings, never the prompt or the output (the caller passes
text only when LLMQUEUE_EVENT_LOG_TEXT says so). Logger `llmqueue.events` at INFO; set
LLMQUEUE_EVENT_LOG_LEVEL=WARNING to turn the lines off.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

LOGGER = "llmqueue.events"
ADMITTED, REJECTED, CANCELLED = "admitted", "rejected", "cancelled"
DISPATCHED, FIRST_TOKEN, FINISHED, EXPIRED = "dispatched", "first_token", "finished", "expired"

_log = logging.getLogger(LOGGER)


def enabled() -> bool:
    """Whether event lines are written: callers skip building their fields when not."""
    return _log.isEnabledFor(logging.INFO)


def emit(event: str, fields: Mapping[str, object], at: float | None = None) -> None:
    """Log one event line; `at` (epoch seconds) is when it happened, now by default. Fields
    that are None are left out."""
    if not _log.isEnabledFor(logging.INFO):
        return
    line = {"event": event, "ts": round(time.time() if at is None else at, 6)}
    line.update(
        (k, round(v, 6) if isinstance(v, float) else v) for k, v in fields.items() if v is not None
    )
    _log.info(json.dumps(line, separators=(",", ":"), default=str))

"""The model names one worker serves, and its refusal of a request routed to it for another model.

A ServedModel maps a model name to a pool, and every worker of the pool takes the pool's queues
whatever it loaded: two served models mapped to one pool by mistake, or a worker started with
the wrong `--model`, would have its engine answer for a model it is not. So each request's model
is checked against the worker's names before the request reaches the engine (one set lookup per
request, on the hot path); a request for another model is claimed and recorded failed
(contract.failures.ModelNotServed), never generated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)


def served_model_names(flag: str, model_name: str) -> frozenset[str]:
    """The names of `--served-model-name` (comma-separated), or the engine's own model name
    (its `--model`), as vLLM's flag of that name defaults."""
    names = frozenset(name.strip() for name in flag.split(",") if name.strip())
    return names or frozenset([model_name])


class ServedModels:
    """What one worker (`node` of `pool`) answers for. Thread-safe: asked on the consumer's
    thread and on task threads."""

    def __init__(self, names: Iterable[str], pool: str, node: str) -> None:
        self.names = frozenset(names)
        if not self.names:
            raise ValueError("a worker serves at least one model name")
        self.pool = pool
        self.node = node
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def refusal(self, model: str) -> str | None:
        """None when this worker serves `model`; else why it will not run a request for it."""
        if model in self.names:
            return None
        served = ", ".join(repr(name) for name in sorted(self.names))
        noun = "model" if len(self.names) == 1 else "models"
        reason = (
            f"pool {self.pool!r} worker {self.node} serves {noun} {served}, not {model!r}: "
            "check ServedModel routing / the worker's --model (--served-model-name)"
        )
        self._warn_once(model, reason)
        return reason

    def _warn_once(self, model: str, reason: str) -> None:
        # Misrouting sends every request of that model here: one line says it, not one per request.
        with self._lock:
            if model in self._warned:
                return
            self._warned.add(model)
        log.warning("refusing requests for a model this worker does not serve: %s", reason)

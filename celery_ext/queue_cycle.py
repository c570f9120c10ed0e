"""kombu's queue-order hook: the order of each BRPOP over a worker's queues, decided by a plugin.

kombu's Redis channel asks a "cycle" (broker_transport_options["queue_order_strategy"], a dotted
path: project/settings.py names `TierCycle`) for the queue order of each BRPOP and tells it which
queue delivered. Celery stays in charge of fetching, acking and redelivery (Flower sees the same
queues and workers); only the order changes. The GPU worker plugs its dispatcher in
(`use_queue_order`, workers/queue_order.py); every other process (the API, Flower, Celery's own
commands) gets kombu's round robin, and loads no worker code for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class QueueOrder(Protocol):
    """What a worker's dispatcher answers kombu (all on Celery's consumer thread)."""

    def order(self, queues: Sequence[str]) -> list[str]:
        """The queues the next BRPOP asks, in order (a queue left out is not fetched from)."""
        ...

    def served(self, queue: str) -> None:
        """`queue` delivered the last message."""
        ...

    def poll_timeout(self, queues: Sequence[str], default: float) -> float:
        """The next BRPOP's timeout (kombu's `default` unless the order wants it sooner)."""
        ...


_order: QueueOrder | None = None


def use_queue_order(order: QueueOrder | None) -> None:
    """Have this process's BRPOPs ordered by `order` (None: kombu's round robin again)."""
    global _order
    _order = order


class TierCycle:
    """kombu's cycle (its round robin's interface) that delegates to the process's QueueOrder."""

    def __init__(self, it: Iterable[str] | None = None) -> None:
        self.items: list[str] = list(it) if it is not None else []

    def update(self, it: Iterable[str]) -> None:
        self.items[:] = it

    def consume(self, n: int) -> list[str]:
        order = _order
        return self.items[:n] if order is None else order.order(self.items[:n])

    def rotate(self, last_used: str) -> str:
        order = _order
        if order is not None:
            order.served(last_used)
        elif last_used in self.items:
            self.items.append(self.items.pop(self.items.index(last_used)))
        return last_used

    def poll_timeout(self, default: float) -> float:
        order = _order
        return default if order is None else order.poll_timeout(self.items, default)

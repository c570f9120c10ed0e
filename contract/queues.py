"""A lane: one (pool, tier) pair and the broker queue that carries it, named in one place."""

from __future__ import annotations

from dataclasses import dataclass

# The one queue of a pool under LLMQUEUE_SHARED_QUEUE (a hyphen: no tier slug is likely to be it).
SHARED_QUEUE_TIER = "all-tiers"


@dataclass(frozen=True, order=True)
class Lane:
    """Where a request waits: a pool of GPU workers and one of its tiers. Its queue is visible
    in Flower and ordered by the worker's dispatch policy."""

    pool: str
    tier: str

    @property
    def queue(self) -> str:
        return f"{self.pool}.{self.tier}"

    @classmethod
    def of_queue(cls, queue: str) -> Lane:
        """The lane a broker queue carries (queue names are only ever built by `queue`)."""
        pool, _, tier = queue.partition(".")
        return cls(pool, tier) if tier else cls("", pool)


def lane(pool: str, tier: str, shared_queue: bool = False) -> Lane:
    """The lane of `tier`'s requests in `pool`. With a shared queue (LLMQUEUE_SHARED_QUEUE, the
    fifo baseline of the dispatch benchmarks) every tier of a pool waits in one arrival order."""
    return Lane(pool, SHARED_QUEUE_TIER if shared_queue else tier)


def queue_name(pool: str, tier: str, shared_queue: bool = False) -> str:
    return lane(pool, tier, shared_queue).queue

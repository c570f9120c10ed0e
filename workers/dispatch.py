"""The dispatch policy: in which order a GPU worker asks its tier queues for the next request.

Pure and worker-free: `workers/queue_order.py` plugs it into kombu's BRPOP. A policy gets the
queues it may take from (tiers over their engine budget already left out, see
`workers/engine_budget.py`) and returns the order for one BRPOP, which pops from the first
non-empty queue; `served` then tells it which queue delivered. Three policies:

- `fifo`: one order regardless of tier. With every tier on one shared queue
  (LLMQUEUE_SHARED_QUEUE) that is arrival order; with per-tier queues the closest Celery-native
  equivalent is kombu's own round robin (each queue in turn), which is what this does.
- `strict`: always the most urgent tier first (lowest Tier.priority): lower tiers wait while it
  has anything queued.
- `ours`: smooth weighted round robin by Tier.weight, so every backlogged tier progresses in its
  weight's ratio however long a more urgent backlog lasts; FIFO within a tier (one list each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class DispatchMode(StrEnum):
    FIFO = "fifo"
    STRICT = "strict"
    OURS = "ours"


@dataclass(frozen=True)
class TierPolicy:
    """What the dispatch policy needs of a tier (the admin's Tier row)."""

    name: str
    priority: int = 5  # 0 is the most urgent
    weight: int = 1  # relative share of fetches while several tiers are backlogged
    max_engine_share: float = 1.0  # share of the engine's sequences the tier may hold


# A queue whose tier the worker does not know (deleted, or not loaded yet): served last by strict,
# with the smallest weight by ours, and without an engine cap.
UNKNOWN_TIER = TierPolicy("", priority=1000, weight=1, max_engine_share=1.0)


class QueueOrder(Protocol):
    def order(self, queues: Sequence[str], tiers: Mapping[str, TierPolicy]) -> list[str]:
        """The order in which one BRPOP asks `queues` (`tiers` maps queue → its tier)."""
        ...

    def served(self, queue: str, asked: Sequence[str], tiers: Mapping[str, TierPolicy]) -> None:
        """A message came from `queue` out of a BRPOP that asked `asked` in that order."""
        ...


class RoundRobinOrder:
    """kombu's round robin: the queue that delivered goes to the back of the line."""

    def __init__(self) -> None:
        self._line: list[str] = []

    def order(self, queues: Sequence[str], tiers: Mapping[str, TierPolicy]) -> list[str]:
        wanted = set(queues)
        self._line = [q for q in self._line if q in wanted]
        self._line += [q for q in queues if q not in self._line]
        return list(self._line)

    def served(self, queue: str, asked: Sequence[str], tiers: Mapping[str, TierPolicy]) -> None:
        if queue in self._line:
            self._line.remove(queue)
            self._line.append(queue)


class StrictOrder:
    """The most urgent tier first, always; ties keep the worker's queue order."""

    def order(self, queues: Sequence[str], tiers: Mapping[str, TierPolicy]) -> list[str]:
        rank = {q: i for i, q in enumerate(queues)}
        return sorted(queues, key=lambda q: (tiers.get(q, UNKNOWN_TIER).priority, rank[q]))

    def served(self, queue: str, asked: Sequence[str], tiers: Mapping[str, TierPolicy]) -> None:
        pass


class WeightedOrder:
    """Smooth weighted round robin (nginx's) over the backlogged tiers.

    Each fetch, every backlogged tier earns its weight in credit and the tier served pays the sum
    of their weights; the next BRPOP asks the tier with the most credit first (ties: the more
    urgent). With tiers weighted 3 and 1 both backlogged the fetches go A A B A, A A B A, ...:
    exactly the weights per round of 4, interleaved rather than in bursts, so a tier waits at
    most (sum of weights / its weight) fetches. Which tiers are backlogged is learnt from what a
    BRPOP returned: the queues asked before the one that delivered were empty. An empty tier
    keeps no surplus credit (it cannot bank service while idle and then burst), and a tier over
    its engine budget is simply not asked (its credit is left as it was).
    """

    def __init__(self) -> None:
        self.credit: dict[str, int] = {}

    def order(self, queues: Sequence[str], tiers: Mapping[str, TierPolicy]) -> list[str]:
        rank = {q: i for i, q in enumerate(queues)}

        def key(q: str) -> tuple[int, int, int]:
            tier = tiers.get(q, UNKNOWN_TIER)
            return (-(self.credit.get(q, 0) + _weight(tier)), tier.priority, rank[q])

        return sorted(queues, key=key)

    def served(self, queue: str, asked: Sequence[str], tiers: Mapping[str, TierPolicy]) -> None:
        if queue not in asked:
            return
        at = list(asked).index(queue)
        for empty in asked[:at]:
            self.credit[empty] = min(self.credit.get(empty, 0), 0)
        backlogged = asked[at:]
        weights = {q: _weight(tiers.get(q, UNKNOWN_TIER)) for q in backlogged}
        total = sum(weights.values())
        for q, weight in weights.items():
            self.credit[q] = self.credit.get(q, 0) + weight
        self.credit[queue] -= total
        # Bounded whatever the arrivals do: in steady state SWRR credit stays within ±total.
        for q in backlogged:
            self.credit[q] = max(-total, min(total, self.credit[q]))


def _weight(tier: TierPolicy) -> int:
    return max(1, tier.weight)  # weight 0 would never be served: treat it as the smallest


def queue_order(mode: DispatchMode) -> QueueOrder:
    """The order policy of a dispatch mode."""
    if mode is DispatchMode.OURS:
        return WeightedOrder()
    if mode is DispatchMode.STRICT:
        return StrictOrder()
    return RoundRobinOrder()

"""The engine budget: how many requests and estimated tokens each tier holds in this worker.

A request counts from the moment its message is delivered to the worker until its outcome is
recorded (or it was dropped before the engine). vLLM does not give up running slots to more
urgent arrivals (DESIGN.md decision 2), so a tier with max_engine_share < 1 takes a new request
only while the whole engine (every tier together) holds fewer than floor(share × max_num_seqs):
the rest of the sequences stays free for more urgent tiers, on top of whatever they already hold.
The headroom so follows their load: a busy interactive tier leaves batch fewer slots, an idle one
leaves it the whole share. A capped tier may always hold its weight's share of the sequences
(`guaranteed_requests`), so it progresses however busy the more urgent tiers are. All tiers
together may hold at most `token_budget` estimated tokens (prompt + max_tokens), and a capped
tier at most its share of it, so sixteen long prompts do not take the memory sixteen short ones
would. Limits are checked before a fetch, so one message (a bulk chunk, a long prompt) may go
past them; nothing more is fetched for that tier until it is back under.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmqueue.payload import TaskPayload


@dataclass(frozen=True)
class EngineLimits:
    """The worker's engine, as the budget sees it."""

    max_num_seqs: int
    task_slots: int
    token_budget: int


def default_token_budget(max_num_seqs: int, typical_request_tokens: int) -> int:
    """Estimated tokens a worker holds at once when --token-budget is not given: a full engine of
    typical requests (prompt + max_tokens), so short requests never hit it and long ones do."""
    return max_num_seqs * typical_request_tokens


def tier_request_cap(share: float, limits: EngineLimits) -> int:
    """Requests a tier may hold: its share of the engine's sequences (at least one, so a tier
    always progresses); a share of 1 is every task slot, the engine's waiting queue included."""
    if share >= 1.0:
        return limits.task_slots
    return max(1, math.floor(share * limits.max_num_seqs))


def tier_token_cap(share: float, limits: EngineLimits) -> int:
    if share >= 1.0:
        return limits.token_budget
    return max(1, math.floor(share * limits.token_budget))


def estimated_tokens(payload: TaskPayload, bytes_per_token: float) -> int:
    """Prompt tokens (estimated from UTF-8 bytes, as admission does) + max_tokens."""
    if payload.get("messages"):
        prompt = sum(
            math.ceil(len(str(m.get("content", "")).encode()) / bytes_per_token) + 4
            for m in payload["messages"] or ()
        )
    else:
        prompt = math.ceil(len(payload.get("prompt", "").encode()) / bytes_per_token)
    max_tokens = payload.get("params", {}).get("max_tokens") or 16
    return max(1, prompt) + int(max_tokens)


def guaranteed_requests(weight: int, total_weight: int, limits: EngineLimits) -> int:
    """Requests a capped tier may hold however busy the others are: its weight's share of the
    engine's sequences, at least one."""
    share = max(1, weight) / max(1, total_weight)
    return max(1, math.floor(share * limits.max_num_seqs))


def admits(
    usage: TierUsage, held: TierUsage, share: float, guaranteed: int, limits: EngineLimits
) -> bool:
    """May this tier fetch another message now? `usage` is what it holds, `held` what every
    tier holds together."""
    if held.tokens >= limits.token_budget or usage.tokens >= tier_token_cap(share, limits):
        return False
    cap = tier_request_cap(share, limits)
    if share >= 1.0:
        return usage.requests < cap
    return held.requests < cap or usage.requests < min(guaranteed, cap)


@dataclass
class TierUsage:
    requests: int = 0
    tokens: int = 0


class Hold:
    """One delivered request's place in the budget; `release` gives it back (once)."""

    __slots__ = ("_budget", "queue", "request_id", "tokens")

    def __init__(self, budget: EngineBudget | None, queue: str, request_id: str, tokens: int):
        self._budget, self.queue, self.request_id, self.tokens = budget, queue, request_id, tokens

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._release(self)


NO_HOLD = Hold(None, "", "", 0)


class EngineBudget:
    """Holdings per queue (a tier of a pool). Thread-safe: the consumer thread holds at
    delivery; task and engine threads release."""

    def __init__(self, limits: EngineLimits, on_release: Callable[[], None] | None = None):
        self.limits = limits
        self._on_release = on_release
        self._lock = threading.Lock()
        self._usage: dict[str, TierUsage] = {}
        self._held = TierUsage()  # every tier together
        # Delivered, not yet taken by the task that runs it (a redelivered duplicate may wait
        # behind its first copy: one entry per delivery).
        self._pending: dict[str, list[Hold]] = {}

    def hold(self, queue: str, request_id: str, tokens: int) -> None:
        hold = Hold(self, queue, request_id, tokens)
        with self._lock:
            usage = self._usage.setdefault(queue, TierUsage())
            usage.requests += 1
            usage.tokens += tokens
            self._held.requests += 1
            self._held.tokens += tokens
            self._pending.setdefault(request_id, []).append(hold)

    def take(self, request_ids: Iterable[str]) -> list[Hold]:
        """The holds of a message's requests, for the task that runs them to release; a request
        delivered some other way gets NO_HOLD."""
        taken = []
        with self._lock:
            for request_id in request_ids:
                waiting = self._pending.get(request_id)
                if not waiting:
                    taken.append(NO_HOLD)
                    continue
                taken.append(waiting.pop(0))
                if not waiting:
                    del self._pending[request_id]
        return taken

    def admits(self, queue: str, share: float, guaranteed: int = 1) -> bool:
        with self._lock:
            usage = self._usage.get(queue, TierUsage())
            return admits(usage, self._held, share, guaranteed, self.limits)

    def usage(self, queue: str) -> TierUsage:
        with self._lock:
            found = self._usage.get(queue, TierUsage())
            return TierUsage(found.requests, found.tokens)

    @property
    def tokens(self) -> int:
        return self._held.tokens

    @property
    def requests(self) -> int:
        return self._held.requests

    def _release(self, hold: Hold) -> None:
        with self._lock:
            usage = self._usage[hold.queue]
            usage.requests -= 1
            usage.tokens -= hold.tokens
            self._held.requests -= 1
            self._held.tokens -= hold.tokens
        if self._on_release is not None:
            self._on_release()

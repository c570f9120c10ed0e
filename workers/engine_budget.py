"""The engine budget: how many requests and estimated tokens each tier holds in this worker.

A request counts from the moment its message is delivered to the worker until its outcome is
recorded (or it was dropped before the engine). vLLM does not give up running slots to more
urgent arrivals (measured: max_num_seqs 64 full of bulk work, an interactive request added at
step 3 finished at step 39; it preempts only under KV-cache pressure). So a capped tier
(max_engine_share < 1) leaves the more urgent tiers their headroom free: room for as many more
of their requests as they held at their recent peak (`LLMQUEUE_HEADROOM_WINDOW_SECONDS`) above
what they hold now, plus one, and never more than (1 - share) of the sequences. Its requests
join the engine only while that many sequences stay free (`joins_engine`; the others wait in
the worker, parked, and join at the first step with room), and it fetches only while that many
task slots stay free (`admits`). The headroom so follows the urgent tiers' measured demand: with
no urgent traffic a bulk backlog runs on all sequences but one (a fixed quarter kept idle cost
the engine ~20% of its throughput, bench/throughput.py), with steady interactive traffic it
keeps that traffic's peak free, under a heavy one the share's rest. A capped tier may always
hold its weight's share of the sequences (`guaranteed_requests`), so it progresses however busy
the more urgent tiers are. All tiers together may hold at most `token_budget` estimated tokens
(prompt + max_tokens), and a capped tier at most its share of it, so sixteen long prompts do not
take the memory sixteen short ones would. Limits are checked before a fetch, so one message (a
bulk chunk, a long prompt) may go past them; nothing more is fetched for that tier until it is
back under.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from contract.task import TaskPayload


@dataclass(frozen=True)
class EngineLimits:
    """The worker's engine, as the budget sees it."""

    max_num_seqs: int
    task_slots: int  # every task slot, the bulk reserve included
    token_budget: int
    reserve: int = 0  # of the task slots, those only capped tiers may hold (parked)
    joins_per_step: int = 0  # a capped tier's requests joining the engine per step (0: any)


def default_token_budget(max_num_seqs: int, typical_request_tokens: int) -> int:
    """Estimated tokens a worker holds at once when --token-budget is not given: a full engine of
    typical requests (prompt + max_tokens), so short requests never hit it and long ones do."""
    return max_num_seqs * typical_request_tokens


def tier_request_cap(share: float, limits: EngineLimits) -> int:
    """Requests a tier may hold: its share of the engine's sequences (at least one, so a tier
    always progresses); a share of 1 is every task slot but the bulk reserve: the engine's
    sequences and its short waiting queue."""
    if share >= 1.0:
        return limits.task_slots - limits.reserve
    return max(1, math.floor(share * limits.max_num_seqs))


def headroom(share: float, limits: EngineLimits, urgent_spare: int | None) -> int:
    """Sequences a capped tier leaves free: one more than the more urgent tiers' `urgent_spare`
    (their recent peak above what they hold now), at most what its share leaves; none where
    this worker serves no more urgent tier (None)."""
    if urgent_spare is None:
        return 0
    return max(0, min(limits.max_num_seqs - tier_request_cap(share, limits), 1 + urgent_spare))


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
    usage: TierUsage,
    held: TierUsage,
    share: float,
    guaranteed: int,
    limits: EngineLimits,
    urgent_spare: int | None = 0,
    parked: int = 0,
) -> bool:
    """May this tier fetch another message now? `usage` is what it holds, `held` what every
    tier holds together, `urgent_spare` how far below their recent peak the more urgent tiers
    are (see `headroom`), `parked` how many of the held requests wait parked in the worker."""
    if held.tokens >= limits.token_budget or usage.tokens >= tier_token_cap(share, limits):
        return False
    cap = tier_request_cap(share, limits)
    if share >= 1.0:
        if limits.reserve == 0:  # Celery's prefetch (one message per task slot) is the line
            return usage.requests < cap
        # The reserve's task slots lift Celery's prefetch bound, so the short line counts every
        # tier's requests bound for the engine (parked ones not): an urgent request fetched past
        # it waits in vLLM's queue, out of admission's and the deadline sweep's sight
        # (bench.scheduling --policies ours --loads 1.5 --quick: 0.67 of interactive requests
        # on time with the reserve and only the tier's own line; 0.84 and 0.85 with this one;
        # 0.86 with no reserve).
        return usage.requests < cap and held.requests - parked < cap
    # Fetched beyond what may run, a capped tier's requests wait in the worker (parked, see
    # `joins_engine`), and still leave the headroom's task slots to the urgent tiers.
    line = limits.task_slots - headroom(share, limits, urgent_spare)
    return held.requests < line or usage.requests < min(guaranteed, cap)


def joins_engine(
    in_engine: int,
    tier_in_engine: int,
    share: float,
    guaranteed: int,
    limits: EngineLimits,
    urgent_spare: int | None = 0,
    tier_joined: int = 0,
) -> bool:
    """May a delivered request of this tier join the engine now, given how many requests the
    engine holds (`in_engine`), how many of them are this tier's and how many of those joined
    since the last step (`tier_joined`)? A capped tier's request joins only while the engine
    leaves the more urgent tiers' headroom free (or the tier holds less than its guaranteed
    share); vLLM would otherwise fill a freed slot from its own waiting queue, whoever it was
    kept for. And at most `limits.joins_per_step` of them join in one step (see
    `joins_per_step`)."""
    if share >= 1.0:
        return True
    if limits.joins_per_step and tier_joined >= limits.joins_per_step:
        return False
    line = limits.max_num_seqs - headroom(share, limits, urgent_spare)
    return in_engine < line or tier_in_engine < min(guaranteed, tier_request_cap(share, limits))


class RecentPeak:
    """The most requests a tier held at once over the last `window_seconds` (per-second maxima
    in a ring; the current count always counts, so a level held unchanged never ages out)."""

    def __init__(self, window_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.window_seconds, self._clock = window_seconds, clock
        self._seconds: deque[tuple[int, int]] = deque()  # (whole second, max held in it)
        self.now = 0

    def observe(self, held: int) -> None:
        # The level before this change was held up to now, so it counts in this second too.
        level, self.now = max(self.now, held), held
        second = int(self._clock())
        if self._seconds and self._seconds[-1][0] == second:
            if level > self._seconds[-1][1]:
                self._seconds[-1] = (second, level)
        else:
            self._seconds.append((second, level))
            self._forget_before(second)

    def peak(self) -> int:
        self._forget_before(int(self._clock()))
        return max(self.now, max((held for _, held in self._seconds), default=0))

    def _forget_before(self, second: int) -> None:
        oldest = second - math.ceil(self.window_seconds)
        while self._seconds and self._seconds[0][0] < oldest:
            self._seconds.popleft()


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


def _none_parked() -> int:
    return 0


class EngineBudget:
    """Holdings per queue (a tier of a pool). Thread-safe: the consumer thread holds at
    delivery; task and engine threads release."""

    def __init__(
        self,
        limits: EngineLimits,
        on_release: Callable[[], None] | None = None,
        headroom_window_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits = limits
        self._on_release = on_release
        self._window = headroom_window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, TierUsage] = {}
        self._peaks: dict[str, RecentPeak] = {}
        self._held = TierUsage()  # every tier together
        # Delivered, not yet taken by the task that runs it (a redelivered duplicate may wait
        # behind its first copy: one entry per delivery).
        self._pending: dict[str, list[Hold]] = {}
        # How many held requests wait parked outside the engine (the engine's count, set where
        # the worker is wired: workers/runtime.py).
        self.parked: Callable[[], int] = _none_parked

    def hold(self, queue: str, request_id: str, tokens: int, pending: bool = True) -> Hold:
        """Count a delivered request against `queue`'s tier. The hold waits for the task that
        runs the request to `take` it, unless `pending` is False: then whoever holds the
        returned Hold releases it (the chain started at delivery, workers/prestart.py)."""
        hold = Hold(self, queue, request_id, tokens)
        with self._lock:
            usage = self._usage.setdefault(queue, TierUsage())
            usage.requests += 1
            usage.tokens += tokens
            self._held.requests += 1
            self._held.tokens += tokens
            if pending:
                self._pending.setdefault(request_id, []).append(hold)
            self._peak(queue).observe(usage.requests)
        return hold

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

    def admits(
        self, queue: str, share: float, guaranteed: int = 1, urgent: Iterable[str] = ()
    ) -> bool:
        """May `queue`'s tier fetch now, leaving the tiers of the `urgent` queues their
        headroom?"""
        parked = self.parked()  # outside the lock: it is the engine's to count
        with self._lock:
            usage = self._usage.get(queue, TierUsage())
            urgent = list(urgent)
            spare = sum(self._spare(q) for q in urgent) if urgent else None
            return admits(usage, self._held, share, guaranteed, self.limits, spare, parked)

    def joins_engine(
        self,
        queue: str,
        in_engine: int,
        tier_in_engine: int,
        share: float,
        guaranteed: int = 1,
        urgent: Iterable[str] = (),
        tier_joined: int = 0,
    ) -> bool:
        """May a delivered request of `queue`'s tier join the engine now (`joins_engine`)?"""
        with self._lock:
            urgent = list(urgent)
            spare = sum(self._spare(q) for q in urgent) if urgent else None
        return joins_engine(
            in_engine, tier_in_engine, share, guaranteed, self.limits, spare, tier_joined
        )

    def _spare(self, queue: str) -> int:
        peak = self._peaks.get(queue)
        return 0 if peak is None else max(0, peak.peak() - peak.now)

    def _peak(self, queue: str) -> RecentPeak:
        peak = self._peaks.get(queue)
        if peak is None:
            peak = self._peaks[queue] = RecentPeak(self._window, self._clock)
        return peak

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
            self._peak(hold.queue).observe(usage.requests)
        if self._on_release is not None:
            self._on_release()

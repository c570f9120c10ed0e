"""The worker's dispatcher: the dispatch policy and the engine budget, plugged into kombu's BRPOP.

It is the QueueOrder of celery_ext/queue_cycle.py (kombu asks it the queue order of each BRPOP
and tells it which queue delivered; one broker queue per pool and tier): a tier over its engine
budget is left out of the BRPOP until a request of it is done. The BRPOP timeout
(`poll_timeout`) is short while a tier is left out, so it is asked again soon after it may be;
and when every tier is left out, the release that frees one wakes the loop.
celery_ext/broker.py also calls `Dispatcher.delivered` for every message before Celery sees it:
the budget counts a request from delivery, before the next BRPOP is chosen.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from celery_ext.broker import on_delivery, on_held
from celery_ext.queue_cycle import use_queue_order
from contract.queues import Lane
from contract.task import GENERATE_TASK
from workers.dispatch import UNKNOWN_TIER, DispatchMode, TierPolicy, queue_order
from workers.engine import GenerationRequest
from workers.engine_budget import (
    EngineBudget,
    EngineLimits,
    Hold,
    estimated_tokens,
    guaranteed_requests,
)
from workers.prestart import PreStarts

log = logging.getLogger(__name__)

# BRPOP timeout while a tier is left out for its budget: how late it may be asked again once a
# request of it finished (an idle Redis round trip per poll, only while the worker is that busy).
HELD_BACK_POLL_SECONDS = 0.05
# The longest the consumer thread gives a lone request's chain the process before it goes on
# with the message's handling (Dispatcher.held): a bound for a recorder stalled on its DB.
LONE_REQUEST_WAIT_SECONDS = 0.01


def _noop() -> None:
    pass


class Dispatcher:
    """One per worker process. `order`, `served` and `delivered` run on Celery's consumer thread;
    `set_tiers` on the tier-settings thread; holds are released on task and engine threads."""

    def __init__(
        self,
        mode: DispatchMode,
        limits: EngineLimits,
        bytes_per_token: float,
        headroom_window_seconds: float = 60.0,
    ) -> None:
        self.mode = mode
        self.policy = queue_order(mode)
        self.budget = EngineBudget(limits, self._wake, headroom_window_seconds)
        # fifo and strict are the baselines: Celery's task slots are their only limit.
        self.enforces_budget = mode is DispatchMode.OURS
        self.bytes_per_token = bytes_per_token
        self._tiers: dict[str, TierPolicy] = {}
        self._queues: list[str] = []  # every queue this worker consumes, as kombu last asked
        self._guaranteed: dict[str, int] = {}
        self._asked: list[str] = []
        self._idle = False
        self._hub: Any = None
        # Starts each delivered request's chain (workers/prestart.py): set by workers.serve
        # once the engine is up; without it a request waits for its task.
        self.prestarts: PreStarts[Any] | None = None
        # Waits, at most the seconds given, until the recorder has nothing left to do (set where
        # the worker is wired: workers/runtime.py); whether the last delivery was a lone request.
        self.recorder_quiet: Callable[[float], object] | None = None
        self._lone = False
        self.fetched: dict[str, int] = {}  # messages delivered per queue
        self._stopped = False

    def set_tiers(self, tiers: Iterable[TierPolicy]) -> None:
        """Replace the tier settings (a whole new mapping: readers never see a half update)."""
        by_name = {t.name: t for t in tiers}
        total_weight = sum(max(1, t.weight) for t in by_name.values())
        self._guaranteed = {
            name: guaranteed_requests(t.weight, total_weight, self.budget.limits)
            for name, t in by_name.items()
        }
        self._tiers = by_name

    def tier(self, queue: str) -> TierPolicy:
        return self._tiers.get(Lane.of_queue(queue).tier, UNKNOWN_TIER)

    def stop_fetching(self) -> None:
        """Fetch nothing more, whatever the budget (the engine watchdog found the engine hung);
        a BRPOP already in flight still delivers its message."""
        self._stopped = True

    def allowed(self, queues: Sequence[str]) -> list[str]:
        """The queues whose tier is under its engine budget."""
        if self._stopped:
            return []
        if not self.enforces_budget:
            return list(queues)
        if not self._queues:
            self._queues = list(queues)
        tiers = {q: self.tier(q) for q in queues}
        return [
            q
            for q, tier in tiers.items()
            if self.budget.admits(
                q, tier.max_engine_share, self._guaranteed.get(tier.name, 1), self._urgent(q)
            )
        ]

    def _urgent(self, queue: str) -> list[str]:
        """The queues of the tiers more urgent than `queue`'s: the headroom it leaves is theirs."""
        tier = self.tier(queue)
        return [q for q in self._queues if self.tier(q).priority < tier.priority]

    def may_start(
        self, request: GenerationRequest, in_engine: int, tier_in_engine: int, tier_joined: int = 0
    ) -> bool:
        """The engine's admission (workers.batching.Admission): a capped tier's delivered request
        joins the engine only while that leaves the more urgent tiers' headroom free, and only
        so many of them per step."""
        if not self.enforces_budget or not request.lane:
            return True
        tier = self.tier(request.lane)
        return self.budget.joins_engine(
            request.lane,
            in_engine,
            tier_in_engine,
            tier.max_engine_share,
            self._guaranteed.get(tier.name, 1),
            self._urgent(request.lane),
            tier_joined,
        )

    def held_back(self, queues: Sequence[str]) -> bool:
        return len(self.allowed(queues)) < len(queues)

    def poll_timeout(self, queues: Sequence[str], default: float) -> float:
        """The next BRPOP's timeout: short while a queue is left out for its tier's budget, since
        a BRPOP in flight cannot take that queue back in."""
        return min(default, HELD_BACK_POLL_SECONDS) if self.held_back(queues) else default

    def order(self, queues: Sequence[str]) -> list[str]:
        if self._hub is None:
            from kombu.asynchronous import get_event_loop

            self._hub = get_event_loop()
        self._idle = True  # before looking: a release while we look must still wake the loop
        self._queues = list(queues)
        allowed = self.allowed(queues)
        self._idle = not allowed
        self._asked = self.policy.order(allowed, {q: self.tier(q) for q in allowed})

        return self._asked

    def served(self, queue: str) -> None:
        self.fetched[queue] = self.fetched.get(queue, 0) + 1
        self.policy.served(queue, self._asked, {q: self.tier(q) for q in self._asked})

    def delivered(self, message: dict[str, Any], queue: str) -> None:
        """Count a delivered message's requests against the budget of `queue`'s tier and start
        them (the chain releases its hold when it ends)."""
        if message.get("headers", {}).get("task") != GENERATE_TASK:
            return
        prestarts = self.prestarts
        redelivered = bool(message.get("headers", {}).get("redelivered"))
        payloads = message_payloads(message)
        for payload in payloads:
            tokens = estimated_tokens(payload, self.bytes_per_token)
            hold = self.budget.hold(queue, payload["request_id"], tokens, prestarts is None)
            if prestarts is not None:
                prestarts.start(payload, queue, hold, redelivered)
        # The budget holds every request in flight here, this one's too.
        self._lone = prestarts is not None and len(payloads) == 1 and self.budget.requests == 1
        if self._lone:
            # Lets the recorder thread, woken by the claim, take the GIL before kombu's unacked
            # bookkeeping of this message does: its claim then starts ~0.25 ms sooner.
            time.sleep(0)

    def held(self) -> None:
        """After a delivered message is recorded as held, before Celery handles it: a lone
        request (nothing else in flight here) has its chain's recording done first.

        On an idle worker the message's handling by Celery (its strategy, a task slot's thread,
        the tracer: ~1-2 ms of Python) otherwise runs while the recorder claims, records and
        publishes the request, under the one GIL, and the caller hears of its outcome that much
        later. So the consumer thread waits until the recorder has nothing left to do (its claim
        recorded; its outcome too if the engine finished it meanwhile), at most
        LONE_REQUEST_WAIT_SECONDS. With other requests in flight it does not wait: the wait
        would hold up the deliveries behind it, and the recorder batches their claims anyway."""
        if not self._lone:
            return
        self._lone = False
        quiet = self.recorder_quiet
        if quiet is not None:
            quiet(LONE_REQUEST_WAIT_SECONDS)

    def plug_in(self) -> None:
        """Order this process's BRPOPs and see every delivered message (before the Celery worker
        starts: kombu's queue-order hook and the transport's delivery hook, celery_ext/)."""
        use_queue_order(self)
        on_delivery(self.on_delivery)
        on_held(self.on_held)

    def unplug(self) -> None:
        use_queue_order(None)
        on_delivery(None)
        on_held(None)

    def on_delivery(self, message: dict[str, Any], queue: str) -> None:
        try:
            self.delivered(message, queue)
        except Exception:  # a message we cannot read still goes to Celery, which reports it
            log.exception("could not count a message from %s against the engine budget", queue)

    def on_held(self) -> None:
        try:
            self.held()
        except Exception:  # the message still goes to Celery
            log.exception("waiting for a lone request's recording failed")

    def take_prestart(self, request_id: str) -> Future[Any] | None:
        """The chain the delivery hook started for this request, for its task to take over."""
        return None if self.prestarts is None else self.prestarts.take(request_id)

    def drop_prestarts(self, request_ids: list[str]) -> list[str]:
        """Forget the chains started for a message that will not run (revoked, expired): each
        ends by itself, its claim deciding. The ids that had no chain."""
        return list(request_ids) if self.prestarts is None else self.prestarts.drop(request_ids)

    def take_holds(self, request_ids: Sequence[str]) -> list[Hold]:
        """The budget holds of requests a task is about to run (or drop): the caller releases
        them."""
        return self.budget.take(request_ids)

    def _wake(self) -> None:
        # Every tier was left out, so no BRPOP is pending and Celery's loop may sleep for
        # seconds: make it tick, and the next BRPOP asks the tier this release freed.
        if self._idle and self._hub is not None:
            self._hub.call_soon(_noop)


def message_payloads(message: dict[str, Any]) -> list[Any]:
    """The task payloads of a generate message as kombu's Redis channel delivers it."""
    body: Any = message.get("body", "")
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    return list(args[0]) if args else []

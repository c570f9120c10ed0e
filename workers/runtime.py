"""One worker process's runtime: its engine, dispatcher, recorder and background jobs, built once.

workers/serve.py builds it at bootstrap (`build_runtime`) and passes it to what needs it: the
Celery task (`workers.tasks.serve_with`), kombu's queue order and delivery hook (the dispatcher
plugs itself into celery_ext/), and Celery's ready and shutdown signals (`attach`). Nothing
else in the worker holds process state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from django.conf import settings

from celery_ext import broker
from workers import cost, depth_history
from workers.batching import ContinuousEngine
from workers.cancellations import CancelListener
from workers.dispatch import DispatchMode
from workers.engine import Engine
from workers.engine_budget import EngineLimits, Hold, default_token_budget
from workers.execution import start_delivered
from workers.heartbeat import Heartbeat
from workers.periodic import Periodic
from workers.prestart import PreStarts
from workers.queue_order import Dispatcher
from workers.recorder import Recorder, new_recorder
from workers.rescue import Rescuer
from workers.served_models import ServedModels
from workers.tier_settings import QueueFollower, load_tier_policies
from workers.watchdog import StepWatch, Watchdog

log = logging.getLogger(__name__)


class Job(Protocol):
    """A background thread of the worker, started once its consumer runs."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class WorkerRuntime:
    """What one worker process holds. Its task slots, the delivery hook and the engine's
    admission all reach the same engine, dispatcher and recorder through it."""

    node: str
    pool: str
    engine: Engine
    dispatcher: Dispatcher
    recorder: Recorder
    follower: QueueFollower
    served: ServedModels
    jobs: list[Job] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)  # engine, model: what /metrics labels

    def stats(self) -> dict[str, Any]:
        """What the heartbeat publishes: the worker's costs (workers/cost.py), its engine's
        counters, what it runs and how full its budget is (llmqueue_engine_* in /metrics)."""
        budget = self.dispatcher.budget
        limits = budget.limits
        info = {
            **self.info,
            "max_num_seqs": str(limits.max_num_seqs),
            "slots": str(limits.task_slots),
            "dispatch": self.dispatcher.mode.value,
        }
        return {
            **cost.snapshot(self.engine.stats()),
            "info": info,
            "budget": {
                "tokens": budget.tokens,
                "token_budget": limits.token_budget,
                "requests": budget.requests,
            },
        }

    def take_prestart(self, request_id: str) -> Future[Any] | None:
        return self.dispatcher.take_prestart(request_id)

    def drop_prestarts(self, request_ids: list[str]) -> list[str]:
        return self.dispatcher.drop_prestarts(request_ids)

    def take_holds(self, request_ids: Sequence[str]) -> list[Hold]:
        return self.dispatcher.take_holds(request_ids)

    def refresh_tiers(self) -> None:
        """Tier settings as the admin has them now; then (unless the worker was told its
        queues) the pool's tier queues, so a new tier's policy is known before it is fetched."""
        self.dispatcher.set_tiers(load_tier_policies())
        if self.follower.pool:
            self.follower.refresh()

    def on_ready(self, consumer: Any) -> None:
        """Celery's consumer runs: follow tiers through it, start beating and the jobs (only
        now: /v1/models must not list a pool nobody consumes yet)."""
        self.follower.consumer = consumer
        for job in self.jobs:
            job.start()

    def stop_gracefully(self, grace_seconds: float) -> None:
        """A warm shutdown began (SIGTERM: a deploy): requests parked outside the engine go
        back to their queues now; those in the engine may finish for `grace_seconds`, then go
        back too, so a stop never waits on a long generation nor on the visibility timeout."""
        engine = self.engine
        if not isinstance(engine, ContinuousEngine):
            return
        engine.hand_back(parked_only=True)
        timer = threading.Timer(grace_seconds, engine.hand_back, kwargs={"parked_only": False})
        timer.daemon = True
        timer.start()

    def on_shutdown(self) -> None:
        for job in self.jobs:
            job.stop()
        self.dispatcher.unplug()


def build_dispatcher(
    mode: DispatchMode,
    max_num_seqs: int,
    slots: int,
    token_budget: int,
    reserve: int = 0,
    joins_per_step: int = 0,
) -> Dispatcher:
    """The worker's dispatcher (workers/queue_order.py) with the tiers as they are now."""
    budget = token_budget or default_token_budget(
        max_num_seqs, settings.LLMQUEUE_TYPICAL_REQUEST_TOKENS
    )
    dispatcher = Dispatcher(
        mode,
        EngineLimits(max_num_seqs, slots + reserve, budget, reserve, joins_per_step),
        settings.LLMQUEUE_BYTES_PER_TOKEN,
        settings.LLMQUEUE_HEADROOM_WINDOW_SECONDS,
    )
    dispatcher.set_tiers(load_tier_policies())
    return dispatcher


def build_runtime(
    node: str,
    pool: str,
    engine: Engine,
    dispatcher: Dispatcher,
    queues: list[str],
    follow_pool: bool,
    served_names: frozenset[str],
    info: dict[str, str] | None = None,
) -> WorkerRuntime:
    """Wire one worker: each delivered request's chain starts at once (claimed as `node`),
    unless its model is none of `served_names`; the engine's admission asks the dispatcher,
    the dispatcher orders the BRPOPs; with `follow_pool`, the pool's tier queues are consumed
    as tiers come and go."""
    recorder = new_recorder()
    served = ServedModels(served_names, pool, node)
    follower = QueueFollower(pool if follow_pool else "", queues)
    runtime = WorkerRuntime(node, pool, engine, dispatcher, recorder, follower, served)
    runtime.info = dict(info or {})
    dispatcher.prestarts = PreStarts(partial(start_delivered, node, recorder, engine, served))
    dispatcher.recorder_quiet = recorder.wait_quiet
    if isinstance(engine, ContinuousEngine):
        engine.admission = dispatcher.may_start
        dispatcher.budget.parked = engine.parked_count
    dispatcher.plug_in()
    broker.set_owner(node)  # the messages this process fetches are recorded as `node`'s
    runtime.jobs = background_jobs(runtime)
    return runtime


def requeue_predecessors_messages(node: str) -> int:
    """Before this worker consumes: the messages a process of the same node name held when it
    died go back to their queues (workers/rescue.py, Rescuer.requeue_held)."""
    from llmqueue.redis_client import get_redis
    from project.celery import app as celery_app

    stale = settings.LLMQUEUE_WORKER_STALE_SECONDS
    restored = Rescuer(get_redis(), node, stale, celery_app).requeue_held()
    if restored:
        log.warning("%d messages held by an earlier %s requeued", restored, node)
    return restored


def background_jobs(runtime: WorkerRuntime) -> list[Job]:
    """The heartbeat (with the worker's counters, workers/cost.py), the tier refresh, the
    rescue of dead workers' messages, the queues' depth history, the engine watchdog, and, for
    `ours`, the sweep of overdue queued requests."""
    from llmqueue.redis_client import get_redis
    from project.celery import app as celery_app

    cost.count_db_statements()
    engine = runtime.engine
    rescuer = Rescuer(get_redis(), runtime.node, settings.LLMQUEUE_WORKER_STALE_SECONDS, celery_app)
    jobs: list[Job] = [
        Heartbeat(
            get_redis(),
            runtime.pool,
            runtime.node,
            settings.LLMQUEUE_WORKER_HEARTBEAT_SECONDS,
            stats=runtime.stats,
        ),
        Periodic("tier-settings", settings.LLMQUEUE_TIER_REFRESH_SECONDS, runtime.refresh_tiers),
        Periodic("rescue", settings.LLMQUEUE_WORKER_HEARTBEAT_SECONDS, rescuer),
    ]
    if settings.LLMQUEUE_METRICS:
        sampler = depth_history.depth_sampler(get_redis(), lambda: runtime.follower.queues)
        jobs.append(Periodic("depth-history", depth_history.SAMPLE_SECONDS, sampler))
    if isinstance(engine, ContinuousEngine):
        jobs.append(CancelListener(get_redis(), engine.abort_request))
        watchdog = Watchdog(
            StepWatch(settings.LLMQUEUE_ENGINE_STALL_SECONDS),
            engine.stats,
            runtime.dispatcher.stop_fetching,
            rescuer.requeue_held,
            time.monotonic,
        )
        jobs.append(
            Periodic("engine-watchdog", settings.LLMQUEUE_WORKER_HEARTBEAT_SECONDS, watchdog)
        )
    if runtime.dispatcher.mode is DispatchMode.OURS:
        recorder = runtime.recorder
        # Waits for each sweep, so a slow one delays the next instead of piling up behind it.
        jobs.append(
            Periodic(
                "deadline-sweep",
                settings.LLMQUEUE_DEADLINE_SWEEP_SECONDS,
                lambda: recorder.sweep().result(),
            )
        )
    return jobs


def attach(runtime: WorkerRuntime) -> None:
    """Run `runtime`'s start and stop with Celery's worker (its ready and shutdown signals)."""
    from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

    def ready(sender: Any = None, **_: Any) -> None:
        runtime.on_ready(sender)

    def shutting_down(**_: Any) -> None:
        runtime.stop_gracefully(settings.LLMQUEUE_SHUTDOWN_GRACE_SECONDS)

    def shutdown(**_: Any) -> None:
        runtime.on_shutdown()

    worker_ready.connect(ready, weak=False)
    worker_shutting_down.connect(shutting_down, weak=False)
    worker_shutdown.connect(shutdown, weak=False)

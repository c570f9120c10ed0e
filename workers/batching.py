"""The continuous-batching loop: one engine thread adds arriving requests and steps the engine."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import queue
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO, Any

from workers.engine import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 0.5
# Steps whose end time is remembered: a request's first token is dated if it came at most this
# many steps before the request finished (one float per step, 512 KiB).
_STEP_CLOCK_SIZE = 65536
_Arrival = tuple[GenerationRequest, Future[GenerationResult]]
_Abort = str  # the id of a submitted request to drop
# May this request join the engine now? Given the request, how many requests the engine holds,
# how many of them came from the request's lane, and how many of those joined since the last
# step (see ContinuousEngine.admission).
Admission = Callable[[GenerationRequest, int, int, int], bool]


class RequestAborted(Exception):
    """The worker took the request back (`ContinuousEngine.abort`) before it finished."""


class HandedBack(RequestAborted):
    """The worker is stopping: the request goes back to its queue for another worker."""


@dataclasses.dataclass(frozen=True)
class _AbortAll:
    """An inbox item: drop every request whose engine id starts with `prefix` (only the parked
    ones if `parked_only`), failing its future with `reason`."""

    prefix: str
    parked_only: bool = False
    reason: type[RequestAborted] = RequestAborted


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step as the loop saw it: when it started and ended (time.time()), how many
    requests it ran and how many of them joined just before it, the stepping thread's CPU
    milliseconds in it (the times and CPU only while the step log is on) and what finished."""

    started: float
    ended: float
    running: int
    joined: int
    cpu_ms: float
    finished: list[GenerationResult]


class ContinuousEngine:
    """Base for engine adapters. Task threads call `submit` from anywhere; only the engine thread
    touches the engine, so requests join and leave the running batch at every step.

    Subclasses implement `_add` (queue one request in the engine), `_step` (run one step, return the
    requests that finished) and `_has_work`, and may build the engine in `_open`.

    `admission`, if set, decides at every step which arrivals join the engine: one it refuses
    waits here, parked (in priority, then arrival order; after any parked request of its own
    lane), and joins at the first step it is admitted. The worker parks a capped tier's requests
    while the engine holds the more urgent tiers' headroom (workers/queue_order.py), since vLLM
    would fill a free running slot from its own waiting queue, whoever the slot was kept for.
    """

    model_name = ""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._futures: dict[str, Future[GenerationResult]] = {}
        self.admission: Admission | None = None
        self._lanes: Counter[str] = Counter()  # requests in the engine per lane
        self._lane_of: dict[str, str] = {}
        self._joined: Counter[str] = Counter()  # requests that joined per lane since the last step
        self._parked: dict[str, _Arrival] = {}
        self._parked_order: list[tuple[int, int, str]] = []  # heap of (priority, seq, id)
        self._parked_lanes: Counter[str] = Counter()
        self._arrivals = itertools.count()
        self.steps = 0
        self.submitted = 0
        self.finished = 0
        self._closed = threading.Event()
        self._step_ended = array("d", bytes(8 * _STEP_CLOCK_SIZE))
        self._step_log: IO[str] | None = None
        self._opened: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        """Start the engine thread; returns once `_open` succeeded there, or raises its error."""
        self._thread.start()
        self._opened.result()

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        if self._closed.is_set():
            future.set_exception(RuntimeError("engine is closed"))
            return future
        self._inbox.put((request, future))
        return future

    def abort(self, request_id: str) -> None:
        """Drop a submitted request wherever it is (waiting or running): its future is cancelled
        at the engine's next step, and it generates nothing more."""
        self._inbox.put(request_id)

    def abort_request(self, request_id: str) -> None:
        """Drop every delivery of request `request_id` this engine holds (its engine ids are
        `<request id>:<delivery>`, workers/prestart.py): it was cancelled."""
        self._inbox.put(_AbortAll(f"{request_id}:"))

    def hand_back(self, parked_only: bool) -> None:
        """Drop the requests this engine holds (only those parked outside it, if
        `parked_only`), their futures failing with HandedBack: the worker is stopping."""
        self._inbox.put(_AbortAll("", parked_only, HandedBack))

    def parked_count(self) -> int:
        """Requests waiting parked outside the engine (any thread may ask)."""
        return len(self._parked)

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "submitted": self.submitted,
            "finished": self.finished,
            "in_engine": len(self._futures),
            "parked": len(self._parked),
        }

    def log_steps(self, path: str) -> None:
        """From now on append one line per engine step to `path`: the step's number, the
        wall-clock times it started and ended (time.time(), the clock of `first_token_at`), so a
        benchmark can count the steps between two instants (bench/headroom.py), then how many
        requests the step ran, how many of them joined just before it, how many finished, the
        loop thread's CPU milliseconds in the step and how many requests waited parked.
        Line-buffered: readable while the worker runs, and a killed worker loses no finished
        line. Off unless called."""
        self._step_log = open(path, "a", buffering=1, encoding="ascii")  # noqa: SIM115

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)
        if self._step_log is not None:
            self._step_log.close()

    # --- subclass hooks ---------------------------------------------------------------------
    def _open(self) -> None:
        """Build the engine, on the engine thread (see VllmEngine); default: nothing to build."""

    def _add(self, request: GenerationRequest) -> None:
        raise NotImplementedError

    def _step(self) -> list[GenerationResult]:
        raise NotImplementedError

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _abort(self, request_ids: list[str]) -> None:
        """Drop requests whose futures failed; default: nothing to release."""

    # An engine that steps elsewhere (workers/engine_process.py) sets `steps_elsewhere`: the loop
    # then never steps, it blocks on the inbox, where the engine's messages arrive too.
    steps_elsewhere = False

    def _flush(self) -> None:
        """Before the loop blocks: hand over what `_add` buffered; default: nothing buffered."""

    def _receive(self, message: Any) -> None:
        """A message from an engine that steps elsewhere (a step's record, ...)."""
        raise TypeError(f"unexpected engine message {message!r}")

    # --- the loop -----------------------------------------------------------------------------
    def _take_arrivals(self, block: bool) -> bool:
        """Move everything waiting in the inbox into the engine, dropping what was aborted;
        False once closed."""
        try:
            if block:
                item = self._inbox.get(timeout=_IDLE_POLL_SECONDS)
            else:
                item = self._inbox.get_nowait()
        except queue.Empty:
            return not self._closed.is_set()
        while item is not None:
            if isinstance(item, str):
                self._drop(item)
            elif isinstance(item, _AbortAll):
                held = [*self._parked] if item.parked_only else [*self._futures, *self._parked]
                for request_id in held:
                    if request_id.startswith(item.prefix):
                        self._drop(request_id, item.reason)
            elif isinstance(item, tuple):
                self._arrive(*item)
            else:  # a message from an engine that steps elsewhere
                self._receive(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _arrive(self, request: GenerationRequest, future: Future[GenerationResult]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if self._parked_lanes[request.lane] or not self._admitted(request):
            self._park(request, future)
        else:
            self._join(request, future)

    def _admitted(self, request: GenerationRequest) -> bool:
        admission = self.admission
        if admission is None:
            return True
        try:
            lane = request.lane
            return admission(request, len(self._futures), self._lanes[lane], self._joined[lane])
        except Exception:  # the engine loop must keep stepping: let it in
            log.exception("engine admission failed for %s; admitting it", request.request_id)
            return True

    def _join(self, request: GenerationRequest, future: Future[GenerationResult]) -> None:
        try:
            self._add(request)
        except Exception as exc:  # a bad request must not stop the loop
            future.set_exception(exc)
        else:
            self._futures[request.request_id] = future
            self._lanes[request.lane] += 1
            self._joined[request.lane] += 1
            self._lane_of[request.request_id] = request.lane
            self.submitted += 1

    def _park(self, request: GenerationRequest, future: Future[GenerationResult]) -> None:
        self._parked[request.request_id] = (request, future)
        self._parked_lanes[request.lane] += 1
        entry = (request.priority, next(self._arrivals), request.request_id)
        heapq.heappush(self._parked_order, entry)

    def _unpark(self, request_id: str) -> _Arrival | None:
        arrival = self._parked.pop(request_id, None)
        if arrival is not None:
            self._parked_lanes[arrival[0].lane] -= 1
        return arrival

    def _start_parked(self) -> None:
        """Let parked requests join while admitted, most urgent first."""
        if not self._has_work():
            # No step will run to reset the count: those that joined since the last one left
            # (aborted: a lost claim, a cancel), and the parked must not wait for a step.
            self._joined.clear()
        while self._parked_order:
            request_id = self._parked_order[0][2]
            arrival = self._parked.get(request_id)
            if arrival is not None and not self._admitted(arrival[0]):
                return
            heapq.heappop(self._parked_order)
            if self._unpark(request_id) is not None and arrival is not None:
                self._join(*arrival)

    def _forget(self, request_id: str) -> Future[GenerationResult] | None:
        """Take a request that left the engine off the books; its future if it was there."""
        future = self._futures.pop(request_id, None)
        if future is not None:
            self._lanes[self._lane_of.pop(request_id, "")] -= 1
        return future

    def _drop(self, request_id: str, reason: type[RequestAborted] = RequestAborted) -> None:
        parked = self._unpark(request_id)
        if parked is not None:  # never reached the engine: nothing to release there
            parked[1].set_exception(reason(request_id))
            return
        future = self._forget(request_id)
        if future is None:  # finished already, or aborted before it arrived (arrivals come first)
            return
        try:
            self._abort([request_id])
        finally:
            future.set_exception(reason(request_id))

    def _run(self) -> None:
        try:
            self._open()
        except BaseException as exc:
            self._closed.set()
            self._opened.set_exception(exc)
            return
        self._opened.set_result(None)
        while True:
            self._start_parked()  # before blocking: the last step may have made room
            self._flush()
            stepping_here = not self.steps_elsewhere and self._has_work()
            if not self._take_arrivals(block=not stepping_here):
                break
            if self.steps_elsewhere or not self._has_work():
                continue
            parked = len(self._parked)
            try:
                record = self._advance()
            except Exception as exc:
                log.exception("engine step failed; failing its %d requests", len(self._futures))
                self._fail_all(exc)
                continue
            self._record(record, parked)
        self._fail_all(RuntimeError("engine closed"))
        self._fail_parked(RuntimeError("engine closed"))

    def _advance(self) -> StepRecord:
        """Run the engine one step here, taking every join so far; its record. (An engine that
        steps elsewhere sends its records instead: `_receive`.)"""
        timed = self._step_log is not None
        started, cpu = (time.time(), time.thread_time()) if timed else (0.0, 0.0)
        running, joined = len(self._futures), self._joined.total()
        self._joined.clear()
        finished = self._step()
        ended = time.time()
        # The loop thread's own CPU in the step: well under its wall time, the step waited
        # for the GIL or a core (other threads, other processes).
        cpu_ms = (time.thread_time() - cpu) * 1000 if timed else 0.0
        return StepRecord(started, ended, running, joined, cpu_ms, finished)

    def _record(self, record: StepRecord, parked: int) -> None:
        """Count a step that ended, log it and settle the requests it finished."""
        self.steps += 1
        self._step_ended[self.steps % _STEP_CLOCK_SIZE] = record.ended
        if self._step_log is not None:
            self._step_log.write(
                f"{self.steps} {record.started:.6f} {record.ended:.6f} {record.running} "
                f"{record.joined} {len(record.finished)} {record.cpu_ms:.3f} {parked}\n"
            )
        for result in record.finished:
            future = self._forget(result.request_id)
            if future is not None:
                self.finished += 1
                future.set_result(self._dated(result))

    def _dated(self, result: GenerationResult) -> GenerationResult:
        """`result` with the wall-clock end of its first token's step, if still remembered."""
        if result.first_token_at is not None or not 0 < result.first_token_step <= self.steps:
            return result
        if self.steps - result.first_token_step >= _STEP_CLOCK_SIZE:
            return result
        at = self._step_ended[result.first_token_step % _STEP_CLOCK_SIZE]
        return dataclasses.replace(result, first_token_at=at)

    def _fail_all(self, exc: BaseException) -> None:
        ids = list(self._futures)
        try:
            self._abort(ids)
        except Exception:
            log.exception("abort after failure failed")
        for request_id in ids:
            future = self._forget(request_id)
            if future is not None:
                future.set_exception(exc)

    def _fail_parked(self, exc: BaseException) -> None:
        for request_id in list(self._parked):
            arrival = self._unpark(request_id)
            if arrival is not None:
                arrival[1].set_exception(exc)
        self._parked_order.clear()

"""The engine in a process of its own: a child steps it without pause; the worker feeds it by pipe.

Why: in one process the engine's step shares the GIL with the worker's Celery consumer, task
threads and recorder (about 3 ms of Python per request), and on the CPU build that Python lands in
the very steps where requests join and finish (bench/throughput.py's step log: those steps took
19-22 ms against direct vLLM's 4.7 ms). Here the child's loop holds the engine and a GIL of its
own: it takes whatever arrived on the pipe between two steps, steps while it has work, and sends
each step's record (workers.batching.StepRecord: times, counts and the requests it finished)
back. The worker's engine thread keeps the bookkeeping it has in one process (futures, parking,
admission, the step log), so the rest of the worker cannot tell the two apart.

vLLM's own multiprocess engine core is not this on the CPU build: vLLM then forces its
multiprocess executor, the model runs in a third process and the core process spin-waits on it,
which starves the worker's consumer on a 2-core machine (see bench/render.py's throughput notes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from workers import processes
from workers.batching import ContinuousEngine, StepRecord
from workers.engine import EngineError, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

_CLOSE_SECONDS = 10


class EngineCore(Protocol):
    """An engine without a thread of its own: whoever holds it steps it (workers.vllm_engine)."""

    torch_threads: int

    def open(self) -> None: ...

    def add(self, request: GenerationRequest) -> None: ...

    def has_work(self) -> bool: ...

    def step(self, step: int) -> list[GenerationResult]: ...

    def abort(self, request_ids: list[str]) -> None: ...


# Messages, worker → child: a list of requests to add, _Drop, or None to close.
# Child → worker: _Opened or _OpenFailed once, then StepRecord, _Rejected and _StepFailed.
@dataclasses.dataclass(frozen=True)
class _Drop:
    request_ids: list[str]


@dataclasses.dataclass(frozen=True)
class _Opened:
    torch_threads: int


@dataclasses.dataclass(frozen=True)
class _OpenFailed:
    error: BaseException


@dataclasses.dataclass(frozen=True)
class _Rejected:
    """The engine refused a request (too long a prompt, ...): its future fails with `error`."""

    request_id: str
    error: BaseException


@dataclasses.dataclass(frozen=True)
class _StepFailed:
    """A step raised: every request the child held was aborted there and fails with `error`."""

    error: BaseException


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling to the worker as itself, else a RuntimeError naming it
    (the engine's own exception types need not pickle)."""
    if isinstance(exc, EngineError):
        return type(exc)(str(exc))
    return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve_core(conn: Connection, make_core: Callable[[], EngineCore]) -> None:
    """The child's main: build and open the core, then step it until the worker closes the pipe
    (or dies: the pipe's end of file)."""
    core = make_core()
    try:
        core.open()
    except BaseException as exc:
        conn.send(_OpenFailed(portable(exc)))
        return
    conn.send(_Opened(core.torch_threads))
    # EOFError / BrokenPipeError: the worker is gone, and nothing waits for these requests.
    with contextlib.suppress(EOFError, BrokenPipeError):
        CoreLoop(core, conn).run()


class CoreLoop:
    """The child's loop: between two steps it takes what arrived, then steps while there is work
    and sends each step's record."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.steps = 0
        self.live: set[str] = set()
        self.joined = 0

    def run(self) -> None:
        while self._take(block=not self.core.has_work()):
            if self.core.has_work():
                self._step()

    def _take(self, block: bool) -> bool:
        """Apply every message waiting on the pipe (wait for one if `block`); False on close."""
        if not block and not self.conn.poll():
            return True
        while True:
            message = self.conn.recv()
            if message is None:
                return False
            if isinstance(message, _Drop):
                held = [i for i in message.request_ids if i in self.live]
                if held:
                    self.core.abort(held)
                    self.live.difference_update(held)
            else:
                self._add(message)
            if not self.conn.poll():
                return True

    def _add(self, requests: list[GenerationRequest]) -> None:
        for request in requests:
            try:
                self.core.add(request)
            except Exception as exc:  # the request's fault: the loop goes on
                self.conn.send(_Rejected(request.request_id, portable(exc)))
            else:
                self.live.add(request.request_id)
                self.joined += 1

    def _step(self) -> None:
        started, cpu = time.time(), time.thread_time()
        running, joined, self.joined = len(self.live), self.joined, 0
        try:
            finished = self.core.step(self.steps + 1)
        except Exception as exc:
            log.exception("engine step failed; aborting its %d requests", len(self.live))
            self._abort_all()
            self.conn.send(_StepFailed(portable(exc)))
            return
        self.steps += 1
        ended = time.time()
        for result in finished:
            self.live.discard(result.request_id)
        cpu_ms = (time.thread_time() - cpu) * 1000
        self.conn.send(StepRecord(started, ended, running, joined, cpu_ms, finished))

    def _abort_all(self) -> None:
        try:
            self.core.abort(list(self.live))
        except Exception:
            log.exception("abort after a failed step failed")
        self.live.clear()


@dataclasses.dataclass(frozen=True)
class _EngineDied:
    """The child's end of the pipe closed: it exited (with `exitcode`, once known)."""

    exitcode: int | None


class ProcessEngine(ContinuousEngine):
    """A ContinuousEngine whose engine steps in a child process (`serve_core`). Its engine thread
    sends the requests that join as they arrive, so one that arrives during a step joins the
    child's next step as in one process; a reader thread puts the child's messages (each step's
    record) in the engine thread's inbox beside the arrivals."""

    steps_elsewhere = True

    def __init__(self, make_core: Callable[[], EngineCore], model_name: str) -> None:
        super().__init__()
        self.model_name = model_name
        self.torch_threads = 0  # the child's, once open
        self._make_core = make_core
        self._conn: Connection | None = None
        self._child: Any = None
        self._outgoing: list[GenerationRequest] = []
        self._died: RuntimeError | None = None
        self.start()

    @property
    def child_pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def stats(self) -> dict[str, Any]:
        # The worker's CPU figure (workers/cost.py) adds the child's: the engine's work is there.
        return {**super().stats(), "process_cpu_seconds": processes.cpu_seconds(self.child_pid)}

    def _open(self) -> None:
        # spawn, not fork: the worker has threads (and may hold CUDA) when its engine starts.
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._child = context.Process(
            target=serve_core, args=(theirs, self._make_core), name="llmqueue-engine"
        )
        self._child.start()
        theirs.close()  # the child's death then reads as end of file here
        self._conn = ours
        try:
            opened = ours.recv()
        except EOFError:
            self._child.join()
            exitcode = self._child.exitcode
            raise RuntimeError(f"engine process exited ({exitcode}) while loading") from None
        if isinstance(opened, _OpenFailed):
            self._child.join(_CLOSE_SECONDS)
            raise opened.error
        self.torch_threads = opened.torch_threads
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()

    def _read(self) -> None:
        """The reader thread: every message from the child into the engine thread's inbox."""
        assert self._conn is not None
        try:
            while True:
                self._inbox.put(self._conn.recv())
        except (EOFError, OSError):
            self._child.join(_CLOSE_SECONDS)
            self._inbox.put(_EngineDied(self._child.exitcode))

    def _add(self, request: GenerationRequest) -> None:
        if self._died is not None:
            raise self._died
        self._outgoing.append(request)  # sent by _flush, one message for every arrival so far

    def _has_work(self) -> bool:
        return bool(self._futures)

    def _flush(self) -> None:
        if not self._outgoing:
            return
        requests, self._outgoing = self._outgoing, []
        self._send(requests)

    def _send(self, message: Any) -> None:
        assert self._conn is not None
        # OSError: the child is gone, and the reader's _EngineDied fails what it held.
        with contextlib.suppress(OSError):
            self._conn.send(message)

    def _abort(self, request_ids: list[str]) -> None:
        self._flush()  # an add still buffered must reach the child before its abort
        self._send(_Drop(request_ids))

    def _receive(self, message: Any) -> None:
        if isinstance(message, StepRecord):
            self._joined.clear()  # the child's next step takes every join so far
            self._record(message, len(self._parked))
        elif isinstance(message, _Rejected):
            future = self._forget(message.request_id)
            if future is not None:
                future.set_exception(message.error)
        elif isinstance(message, _StepFailed):
            log.error("engine step failed: %s", message.error)
            self._fail_all(message.error)
        elif isinstance(message, _EngineDied):
            self._died = RuntimeError(f"engine process died ({message.exitcode})")
            log.error("%s; failing its %d requests", self._died, len(self._futures))
            self._fail_all(self._died)
        else:
            super()._receive(message)

    def close(self) -> None:
        super().close()
        if self._child is None:
            return
        self._send(None)
        self._child.join(_CLOSE_SECONDS)
        if self._child.is_alive():
            self._child.kill()
            self._child.join()

"""The API restarted mid-load as deploys do (SIGTERM to granian and a new one on the same port,
or SIGHUP): every accepted request ends once and every blocking call is answered (issue 14,
item 2); a kill timeout shorter than a wait cuts the caller, not its request."""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from llmqueue.models import PromptRequest, Tenant
from tests.conftest import SIMULATED, Seeded, queued_messages, wait_until
from tests.reliability_record import record
from tests.stack import Stack, stack_fixture  # noqa: F401 (the stack fixture)
from tests.test_crash_recovery import listen, published_for
from workers.processes import descendants, listening

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
# 48 decode steps of ~37 ms: ~1.8 s a request, so requests accepted before the SIGTERM are
# still queued or generating while the old API drains and the new one starts.
WORKER = (*SIMULATED, "--sim-time-scale", "5")
MAX_TOKENS = 48
CLIENTS = 6
# The README's production shape (several processes of several threads), scaled to 2 cores.
API_WORKERS, API_THREADS = 2, 4
# A caller's bound on one attempt: a call that hangs past it fails the test.
CALL_TIMEOUT = 60.0
# How long a client keeps retrying a call that got no answer (the restart takes seconds).
RETRY_FOR = 30.0
# ~3.7 s of generation: longer than the 1 s kill timeout of the second test.
KILLED_TOKENS = 100
TERMINAL = {S.SUCCEEDED, S.FAILED, S.EXPIRED, S.CANCELLED}


@dataclass
class Call:
    """One logical request of a client: its attempts until it got an HTTP answer."""

    prompt: str  # unique: finds the rows any attempt of this call stored
    blocking: bool
    max_tokens: int = MAX_TOKENS
    started: float = 0.0
    ended: float = 0.0
    attempt_started: float = 0.0  # of the attempt that got the answer (or the last one)
    no_answer: list[str] = field(default_factory=list)  # transport errors, retried
    # Attempts whose request may have reached the server before the error (not a refused
    # connect): any of them may have stored a row.
    ambiguous: int = 0
    status: int | None = None
    body: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    final: dict[str, Any] = field(default_factory=dict)  # the polled end state (background)
    poll_errors: int = 0  # polls that got no answer (retried)
    replayed: bool = False  # answered with the first send's request (Idempotent-Replayed)


class Load:
    """CLIENTS threads, each with a keep-alive client (as an SDK keeps one), alternating
    background calls (202, then polling GET /v1/requests/<id> to the end) and blocking calls
    (200 with the result). A call that gets no answer is sent again, as clients retry."""

    def __init__(self, stack: Stack, key: str, idempotent: bool = False):
        # idempotent: each call sends an Idempotency-Key (its prompt), resent with the call.
        self.stack, self.key, self.idempotent = stack, key, idempotent
        self.calls: list[Call] = []
        self.in_flight: set[int] = set()  # ids of Call objects waiting for an answer
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.numbers = itertools.count()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=CALL_TIMEOUT + RETRY_FOR)
            assert not thread.is_alive(), "a client thread hung"

    def accepted(self) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.status in (200, 202)]

    def waiting_blocking(self) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.blocking and id(c) in self.in_flight]

    def one_call(
        self, blocking: bool, max_tokens: int = MAX_TOKENS
    ) -> tuple[Call, threading.Thread]:
        """A call of its own, sent now from a thread of its own."""
        call = Call(f"call-{next(self.numbers)}", blocking, max_tokens)
        thread = threading.Thread(target=self._run, args=(self._http(), call), daemon=True)
        thread.start()
        return call, thread

    def _http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.Client(base_url=self.stack.api_url, headers=headers)

    def _client(self, index: int) -> None:
        with self._http() as client:
            for turn in itertools.count():
                if self.stop.is_set():
                    return
                call = Call(f"call-{next(self.numbers)}", blocking=(index + turn) % 2 == 1)
                self._run(client, call)

    def _run(self, client: httpx.Client, call: Call) -> None:
        with self.lock:
            self.calls.append(call)
        self._send(client, call)
        if call.status == 202:
            self._poll(client, call)

    def _send(self, client: httpx.Client, call: Call) -> None:
        body: dict[str, Any] = {
            "model": "sim",
            "prompt": call.prompt,
            "max_tokens": call.max_tokens,
        }
        if not call.blocking:
            body["background"] = True
        headers = {"Idempotency-Key": call.prompt} if self.idempotent else {}
        call.started = time.time()
        with self.lock:
            self.in_flight.add(id(call))
        try:
            while True:
                call.attempt_started = time.time()
                try:
                    response = client.post(
                        "/v1/completions", json=body, headers=headers, timeout=CALL_TIMEOUT
                    )
                except httpx.TimeoutException as exc:  # a hang: the test fails on it
                    call.no_answer.append(repr(exc))
                    call.ambiguous += not isinstance(exc, httpx.ConnectTimeout)
                    return
                except httpx.TransportError as exc:
                    call.no_answer.append(repr(exc))
                    # A refused connect sent nothing; any other error may come after the
                    # request reached the server.
                    call.ambiguous += not isinstance(exc, httpx.ConnectError)
                    if time.time() - call.started > RETRY_FOR:
                        return
                    time.sleep(0.05)
                    continue
                call.status = response.status_code
                call.body = response.json()
                call.request_id = response.headers.get("X-LLMQueue-Request-Id", "")
                call.replayed = response.headers.get("Idempotent-Replayed") == "true"
                return
        finally:
            call.ended = time.time()
            with self.lock:
                self.in_flight.discard(id(call))

    def _poll(self, client: httpx.Client, call: Call) -> None:
        """GET is safe to repeat: every error is retried until the request ends."""
        deadline = time.monotonic() + CALL_TIMEOUT + RETRY_FOR
        while time.monotonic() < deadline:
            try:
                response = client.get(f"/v1/requests/{call.request_id}", timeout=10)
            except httpx.TransportError:
                call.poll_errors += 1
                time.sleep(0.05)
                continue
            if response.status_code == 200 and response.json()["status"] in TERMINAL:
                call.final = response.json()
                return
            time.sleep(0.2)


def exit_timer(process: subprocess.Popen[bytes]) -> list[float]:
    """A list that gets the time `process` exited, from a thread that waits for it."""
    exited_at: list[float] = []

    def wait() -> None:
        process.wait()
        exited_at.append(time.time())

    threading.Thread(target=wait, daemon=True).start()
    return exited_at


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@dataclass
class Deployed:
    """What a deploy did, as the test saw it."""

    signalled_at: float
    old_pids: list[int]  # the processes that had to go: all of them, or only the workers
    old_gone_s: float  # signal → the last of old_pids exited
    recovery_s: float  # signal → the API answered again (0: it never stopped answering)
    new_from_s: float  # signal → every answer comes from the new processes


def restart(
    stack: Stack, api: subprocess.Popen[bytes], tree: list[int], key: str, load: Load
) -> Deployed:
    """SIGTERM to granian, a new granian on the same port at once (a deploy by a supervisor).
    `tree`: granian's processes, main first."""
    old_pids = tree
    signalled_at = time.time()
    api.send_signal(signal.SIGTERM)  # the old API drains what it holds
    exited_at = exit_timer(api)
    # It stops listening at once: a call sent now is refused until the new one listens, and
    # its client sends it again.
    wait_until(lambda: not listening(stack.api_port), 5, "the old API to stop listening")
    in_gap, gap_thread = load.one_call(blocking=True)
    stack.start_api(key, workers=API_WORKERS, threads=API_THREADS)  # ready: it answered
    recovery_s = time.time() - signalled_at
    assert api.wait(timeout=CALL_TIMEOUT) == 0  # a clean exit, not a kill
    wait_until(lambda: bool(exited_at), 5, "the exit to be timed")
    gap_thread.join(timeout=CALL_TIMEOUT)
    # Refused while no API listened (nothing sent, so nothing stored), then answered.
    assert in_gap.no_answer and in_gap.ambiguous == 0 and in_gap.status == 200, in_gap
    old_gone_s = exited_at[0] - signalled_at
    return Deployed(signalled_at, old_pids, old_gone_s, recovery_s, recovery_s)


def reload(
    stack: Stack, api: subprocess.Popen[bytes], tree: list[int], key: str, load: Load
) -> Deployed:
    """SIGHUP to granian: it starts new workers (the code as it is now on disk) on the socket
    it keeps listening on, then stops each old one, which drains what it holds."""
    old_pids = tree[1:]
    signalled_at = time.time()
    api.send_signal(signal.SIGHUP)
    wait_until(lambda: all(gone(pid) for pid in old_pids), 60, "the old workers to exit")
    old_gone_s = time.time() - signalled_at
    assert api.poll() is None  # the main process stays, with the listening socket
    new = [pid for pid in descendants(api.pid)[1:] if not gone(pid)]
    assert len(new) == API_WORKERS and not set(new) & set(old_pids)
    # The socket never stopped listening: some worker, old or new, answered all along.
    recovery_s = 0.0
    return Deployed(signalled_at, old_pids, old_gone_s, recovery_s, old_gone_s)


@pytest.mark.parametrize("deploy", [restart, reload], ids=["sigterm-new-process", "sighup"])
def test_an_api_restarted_mid_load_loses_no_accepted_request(
    seeded: Seeded, stack: Stack, deploy: Callable[..., Deployed]
):
    # The batch tier (600 s wait, no first-token target to shed against), and no rate limit
    # in the way: every call should be accepted.
    Tenant.objects.filter(name="globex").update(requests_per_second=1000, burst=1000)
    key = seeded.other_key
    stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    published, stop_listening, listener = listen(client)
    api = stack.start_api(key, workers=API_WORKERS, threads=API_THREADS)
    stack.start_worker(client, *WORKER)
    stack.start_worker(client, *WORKER)
    load = Load(stack, key)
    load.start()

    def mid_load() -> bool:
        """Requests accepted, some still generating, and blocking calls whose rows are stored
        waiting on the old API for their results."""
        waiting = {c.prompt for c in load.waiting_blocking()}
        stored = PromptRequest.objects.filter(prompt__in=waiting, status__in=[S.QUEUED, S.RUNNING])
        running = PromptRequest.objects.filter(status=S.RUNNING).exists()
        return len(load.accepted()) >= 8 and running and stored.count() >= 2

    wait_until(mid_load, 60, "load with blocking calls waiting on the API")
    tree = descendants(api.pid)
    assert len(tree) >= 1 + API_WORKERS  # granian's main process and its workers
    accepted_before = {c.prompt for c in load.accepted()}
    # Last thing before the signal, in one query: a call may end in between.
    waiting = {c.prompt for c in load.waiting_blocking()}
    stored_waiting = set(
        PromptRequest.objects.filter(prompt__in=waiting).values_list("prompt", flat=True)
    )
    deployed = deploy(stack, api, tree, key, load)
    signalled_at = deployed.signalled_at
    assert [pid for pid in deployed.old_pids if not gone(pid)] == []

    def enough_after() -> bool:
        new_from = signalled_at + deployed.new_from_s
        return sum(c.attempt_started > new_from for c in load.accepted()) >= 8

    wait_until(enough_after, 60, "requests accepted by the new API")
    load.finish()

    def all_ended() -> bool:
        return not PromptRequest.objects.exclude(status__in=TERMINAL).exists()

    wait_until(all_ended, 60, "every stored request to end")
    wait_until(lambda: queued_messages(client) == 0, 10, "every message to be acked")
    stop_listening.set()
    listener.join(timeout=5)

    calls = load.calls
    rows: dict[str, list[PromptRequest]] = {}
    for row in PromptRequest.objects.all():
        rows.setdefault(row.prompt, []).append(row)
    # Every call got an HTTP answer, and it accepted the call: no refusal, no hang.
    assert [c for c in calls if c.status not in (200, 202)] == []
    assert max(c.ended - c.attempt_started for c in calls) < CALL_TIMEOUT
    # Each accepted call: exactly one row, the one the API named, succeeded to the full count
    # and published once.
    lost = duplicated = 0
    for call in calls:
        mine = rows.get(call.prompt, [])
        duplicated += max(0, len(mine) - 1)
        if [str(r.id) for r in mine] != [call.request_id]:
            lost += 1
            continue
        (row,) = mine
        if (row.status, row.completion_tokens) != (S.SUCCEEDED, call.max_tokens):
            lost += 1
        if call.blocking:
            assert call.body["usage"]["completion_tokens"] == call.max_tokens
        else:
            assert (call.final["status"], call.final["id"]) == ("succeeded", call.request_id)
        assert published[f"{row.id}:SUCCESS"] == 1
    # A duplicate would need an attempt that reached the API and lost its answer (the second
    # test shows one): the drain answers every request it has begun.
    assert (lost, duplicated) == (0, 0)
    assert set(rows) == {c.prompt for c in calls}  # no row from anything else
    all_ids = [r.id for group in rows.values() for r in group]
    assert published_for(published, all_ids) == len(calls)  # nothing else published
    assert Counter(r.status for group in rows.values() for r in group) == {S.SUCCEEDED: len(calls)}
    assert client.hlen("unacked") == 0

    # The blocking calls whose rows were stored and waiting at the signal got their result from
    # the process that took them, on their first attempt, before it exited.
    for call in (c for c in calls if c.prompt in stored_waiting):
        assert (call.status, call.no_answer) == (200, []), call
        assert call.ended < signalled_at + deployed.old_gone_s + 0.5
    drained = [c for c in calls if c.prompt in stored_waiting and c.ended > signalled_at]
    assert drained  # answered after the signal: by the draining process
    # Mid-load: stored before the signal (answered 202 or waiting), finished after it; and
    # accepted by the new API.
    stored_before = accepted_before | stored_waiting
    finished_after = [p for p in stored_before if rows[p][0].finished_at.timestamp() > signalled_at]
    assert finished_after
    after = [c for c in calls if c.attempt_started > signalled_at + deployed.new_from_s]
    assert len(after) >= 8
    retried = [c for c in calls if c.no_answer]
    refused = sum(e.startswith("ConnectError") for c in calls for e in c.no_answer)
    if deploy is reload:
        assert refused == 0  # the socket never closed
    record(
        "api_restart" if deploy is restart else "api_reload",
        accepted=len(calls),
        completed=len(calls) - lost,
        lost=lost,
        duplicated=duplicated,
        recovery_s=round(deployed.recovery_s, 2),
        old_gone_s=round(deployed.old_gone_s, 2),
        blocking_drained=len(drained),
        finished_after_signal=len(finished_after),
        retried_calls=len(retried),
        refused_connects=refused,
        ambiguous_attempts=sum(c.ambiguous for c in calls),
        polls_retried=sum(c.poll_errors for c in calls),
    )
    print(
        f"{deploy.__name__}: {len(calls)} calls accepted, {len(stored_before)} before the "
        f"signal ({len(finished_after)} finished after it), {len(after)} by the new API; "
        f"new API answered {deployed.recovery_s:.2f} s after the signal, old processes gone "
        f"after {deployed.old_gone_s:.2f} s; {len(drained)} blocking calls answered by the "
        f"draining API; {len(retried)} calls retried ({refused} refused connects, "
        f"{sum(c.ambiguous for c in calls)} ambiguous attempts), "
        f"{sum(c.poll_errors for c in calls)} polls retried: "
        f"{[e for c in retried for e in c.no_answer][:5]}"
    )


@pytest.mark.parametrize("idempotent", [False, True], ids=["no-key", "idempotency-key"])
def test_a_kill_timeout_shorter_than_a_wait_cuts_the_caller_not_its_request(
    seeded: Seeded, stack: Stack, idempotent: bool
):
    """Why the production command sets no short --workers-kill-timeout: past it granian kills
    a worker still holding a blocking call. The caller gets no answer (and so no request id),
    while its request, stored and queued before, runs to the end and is published once. Sent
    again without an Idempotency-Key it runs a second time; with one, the retry is answered
    with the first request's outcome."""
    key = seeded.other_key
    stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    published, stop_listening, listener = listen(client)
    old_api = stack.start_api(key, extra=("--workers-kill-timeout", "1"))
    stack.start_worker(client, *WORKER)
    load = Load(stack, key, idempotent)
    call, thread = load.one_call(blocking=True, max_tokens=KILLED_TOKENS)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).exists(), 30, "running")
    stopped_at = time.time()
    old_api.send_signal(signal.SIGTERM)
    exited_at = exit_timer(old_api)
    thread.join(timeout=10)
    wait_until(lambda: bool(exited_at), 10, "the old API to exit")
    # Cut by the kill 1 s after the SIGTERM, its request sent and stored: a no-answer that
    # may or may not have been stored, as far as the caller can tell.
    assert call.ambiguous >= 1 and "RemoteProtocolError" in call.no_answer[0], call
    assert 1 <= exited_at[0] - stopped_at < 3
    # Its client keeps sending it again (refused while no API listens) until one is back.
    stack.start_api(key)
    thread.join(timeout=CALL_TIMEOUT + RETRY_FOR)
    assert call.status == 200, call
    wait_until(lambda: not PromptRequest.objects.exclude(status=S.SUCCEEDED).exists(), 30, "to end")
    wait_until(lambda: queued_messages(client) == 0, 10, "every message to be acked")
    stop_listening.set()
    listener.join(timeout=5)
    rows = list(PromptRequest.objects.filter(prompt=call.prompt))
    if idempotent:
        # The retry found the first send's request by its key and answered its outcome.
        assert [str(r.id) for r in rows] == [call.request_id] and call.replayed
        assert call.body["usage"]["completion_tokens"] == KILLED_TOKENS
    else:
        # The cut attempt's row and the retry's: the at-most-once ambiguity of any HTTP API
        # whose caller retries a request that got no answer. Both ran once, each published once.
        assert len(rows) == 2 and call.request_id in {str(r.id) for r in rows}
    for row in rows:
        assert (row.status, row.completion_tokens) == (S.SUCCEEDED, KILLED_TOKENS)
        assert published[f"{row.id}:SUCCESS"] == 1

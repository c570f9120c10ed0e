"""Redis Sentinel: every Redis client follows the master through a failover, and a failover to a
replica that had not received the last writes, mid-load, loses no accepted request."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial

import httpx
import pytest
import redis
from celery import Celery
from kombu.utils.json import dumps

from celery_ext.broker import SentinelChannel
from celery_ext.result_backend import LeanSentinelBackend
from contract.keys import RECONCILED_KEY
from contract.redis_url import SENTINEL_KWARGS, connect, sentinel_group
from llmqueue.models import PromptRequest, Tenant
from tests.conftest import (
    REPO,
    SIMULATED,
    Seeded,
    queued_messages,
    subprocess_env,
    wait_until,
)
from tests.reliability_record import record
from tests.sentinels import MASTER, SentinelStack, info, sentinel_stack_fixture  # noqa: F401
from tests.stack import kill, post
from tests.test_redelivery import count_published_results

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def test_a_sentinel_url_names_its_sentinels_db_and_password():
    group = sentinel_group("sentinel://:pw@h1:26379/2;sentinel://h2")
    assert group.sentinels == (("h1", 26379), ("h2", 26379))
    assert (group.db, group.password) == (2, "pw")
    # kombu reads the db from whichever sentinel it connects through: every one carries it.
    assert group.url == "sentinel://:pw@h1:26379/2;sentinel://:pw@h2:26379/2"
    with pytest.raises(ValueError):
        sentinel_group("sentinel://h1/1;sentinel://h2/2")
    with pytest.raises(ValueError):
        connect("sentinel://h1:26379/0")  # no master name
    # redis:// stays redis-py's own client and pool: nothing added on the request path.
    plain = connect("redis://127.0.0.1:6379/14")
    assert type(plain.connection_pool) is redis.ConnectionPool


def test_settings_take_a_sentinel_group_and_refuse_one_without_its_master():
    show = (
        "from django.conf import settings as s; "
        "print(s.CELERY_BROKER_URL, s.CELERY_RESULT_BACKEND, "
        "s.CELERY_BROKER_TRANSPORT_OPTIONS['master_name'], "
        "s.CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS['master_name'])"
    )
    env = subprocess_env() | {"REDIS_URL": "sentinel://10.0.0.1:26379/3;sentinel://10.0.0.2"}
    argv = [sys.executable, "-c", f"import django; django.setup(); {show}"]
    shown = subprocess.run(
        argv, env=env | {"REDIS_SENTINEL_MASTER": "mymaster"}, cwd=REPO, capture_output=True
    )
    assert shown.returncode == 0, shown.stderr
    url = "sentinel://10.0.0.1:26379/3;sentinel://10.0.0.2:26379/3"
    assert shown.stdout.decode().split() == [
        url, f"celery_ext.result_backend:LeanSentinelBackend+{url}", "mymaster", "mymaster"
    ]  # fmt: skip
    refused = subprocess.run(argv, env=env, cwd=REPO, capture_output=True)
    assert refused.returncode != 0
    assert b"REDIS_SENTINEL_MASTER is not set" in refused.stderr


def sentinel_app(stack: SentinelStack) -> Celery:
    """A Celery app configured as project/settings.py configures one for a sentinel REDIS_URL."""
    url = sentinel_group(stack.sentinel_url).url
    options = {"master_name": MASTER, "sentinel_kwargs": SENTINEL_KWARGS}
    app = Celery("sentinel-test", set_as_current=False)
    app.conf.update(
        broker_url=url,
        broker_transport_options=options,
        result_backend=f"celery_ext.result_backend:LeanSentinelBackend+{url}",
        result_backend_transport_options=options,
    )
    return app


def promoted(stack: SentinelStack, timeout: float, asking: int = 0) -> None:
    """Wait until the sentinel `asking` (an index) names the replica as the master."""
    wait_until(
        lambda: stack.master_port(asking) == stack.replica_port, timeout, "the replica's promotion"
    )


def test_every_kind_of_client_follows_the_master_through_a_failover(
    sentinel_stack: SentinelStack,
):
    stack = sentinel_stack
    master = stack.start_redis()
    stack.start_replica()
    first_sentinel, *_ = stack.start_sentinels()
    app = sentinel_app(stack)
    own = stack.client(socket_timeout=5)  # llmqueue's own keys (llmqueue/redis_client.py)
    backend = app.backend
    assert isinstance(backend, LeanSentinelBackend)
    connection = app.connection_for_write()
    channel = connection.default_channel
    assert isinstance(channel, SentinelChannel)

    def writes(tag: str) -> list[Callable[[], object]]:
        return [
            lambda: own.set(f"own-{tag}", tag),
            lambda: backend.store_many([(f"task-{tag}", {"ok": tag}, "SUCCESS")]),
            # kombu's publish: an LPUSH on the channel's client.
            lambda: channel._put("default.batch", {"body": tag}),
            # The client that acks what a worker held after Celery reconnected.
            lambda: channel._orphan_client().set(f"orphan-{tag}", tag),
        ]

    for write in writes("before"):
        write()
    assert stack.server(stack.redis_port).get("own-before") == b"before"
    replica = stack.server(stack.replica_port)
    wait_until(lambda: replica.exists("orphan-before") == 1, 5, "replication")
    # The sentinel every client asks first dies too: the other two still make a quorum and a
    # majority, and each client must skip it for the next.
    assert kill(first_sentinel, signal.SIGKILL) == -signal.SIGKILL
    assert kill(master, signal.SIGKILL) == -signal.SIGKILL
    promoted(stack, 30, asking=1)
    # The same client objects, not rebuilt: each asks the sentinels again after the lost server.
    for write in writes("after"):
        wait_until(partial(_succeeds, write), 30, "each client to write to the new master")
    new_master = stack.server(stack.replica_port)
    assert info(new_master)["role"] == "master"
    assert new_master.get("own-after") == b"after"
    assert json.loads(new_master.get("celery-task-meta-task-after") or b"{}")["status"] == "SUCCESS"
    assert new_master.lrange("default.batch", 0, -1) == [
        dumps({"body": "after"}).encode(),
        dumps({"body": "before"}).encode(),
    ]
    assert new_master.get("orphan-after") == b"after"
    # A new client finds the master past the dead sentinel at once (redis-py's default retries
    # spent ~3.8 s on it before asking the next).
    started = time.monotonic()
    assert stack.client().ping()
    assert time.monotonic() - started < 1
    connection.release()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


def _succeeds(write: Callable[[], object]) -> bool:
    try:
        write()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    return True


# ~16 decode steps of ~37 ms: a request takes ~0.6 s, 4 at a time, and 10 a second arrive: a
# backlog waits in the queue when the master dies, so the replica lacks messages not yet fetched.
WORKER = (*SIMULATED[:-1], "4", "--slots", "4", "--sim-time-scale", "5")
MAX_TOKENS = 16
SEND_EVERY_SECONDS = 0.1
# The replica's link to the master is cut this long before the master is SIGKILLed: the writes
# of that window exist only on the master that dies (asynchronous replication's loss, certain).
LAG_SECONDS = 0.5


@dataclass
class Load:
    """Background requests at a steady rate from a thread, each answer kept with its time."""

    stack: SentinelStack
    key: str
    answers: list[tuple[float, int, str | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            sent = time.time()
            try:
                answer = post(
                    self.stack, self.key, background=True, prompt=f"p{i}", max_tokens=MAX_TOKENS
                )
                stored = answer.headers.get("X-LLMQueue-Request-Id")
                self.answers.append((sent, answer.status_code, stored))
            except httpx.TransportError:
                self.answers.append((sent, 0, None))
            i += 1
            self.stop.wait(max(0.0, SEND_EVERY_SECONDS - (time.time() - sent)))

    def accepted_after(self, moment: float) -> list[str]:
        return [rid for sent, code, rid in self.answers if sent > moment and code == 202 and rid]


def count_published_following_the_master(
    stack: SentinelStack, counts: Counter[str], stop: threading.Event
) -> None:
    """Every outcome the result backend publishes, on whichever server is the master."""
    while not stop.is_set():
        try:
            count_published_results(stack.client(socket_timeout=5), counts, stop)
        except (redis.ConnectionError, redis.TimeoutError):
            stop.wait(0.1)


def test_a_failover_mid_load_loses_no_accepted_request(
    seeded: Seeded, sentinel_stack: SentinelStack
):
    stack = sentinel_stack
    first_master = stack.start_redis()
    stack.start_replica()
    stack.start_sentinels()
    client = stack.client(socket_timeout=5)
    # The batch tier (600 s deadline): nothing expires while the failover runs; a rate limit
    # above the load's, so every refusal is the failover's.
    key = seeded.other_key
    Tenant.objects.filter(name="globex").update(requests_per_second=100, burst=100)
    stack.start_api(key)
    stack.start_pacer()  # the reconciler
    _, node = stack.start_worker(client, *WORKER)
    published: Counter[str] = Counter()
    stop_listening = threading.Event()
    listener = threading.Thread(
        target=count_published_following_the_master,
        args=(stack, published, stop_listening),
        daemon=True,
    )
    listener.start()
    # A blocking call first: the API's thread keeps its result connection to the first master.
    warm = post(stack, key, max_tokens=MAX_TOKENS)
    assert warm.status_code == 200, warm.text

    load = Load(stack, key)
    sender = load.start()

    def backlog() -> bool:
        running = PromptRequest.objects.filter(status=S.RUNNING).count()
        return running >= 3 and PromptRequest.objects.filter(status=S.QUEUED).count() >= 5

    wait_until(backlog, 30, "requests running and a backlog waiting")
    replica = stack.server(stack.replica_port)
    # Cut the replica off and keep it off (the master has no password: its AUTH fails).
    replica.config_set("masterauth", "not-the-masters-password")
    replica.client_kill_filter(_type="master")
    time.sleep(LAG_SECONDS)
    assert info(replica)["master_link_status"] == "down"
    lacked = int(info(stack.server(stack.redis_port))["master_repl_offset"]) - int(
        info(replica)["master_repl_offset"]
    )
    assert lacked > 0  # bytes of writes the replica never got
    killed_at = time.time()
    assert kill(first_master, signal.SIGKILL) == -signal.SIGKILL
    promoted(stack, 30)
    promoted_s = time.time() - killed_at
    wait_until(lambda: _answers(client), 10, "the sentinels to agree on the new master")
    # Requests that finished on the dead master, whose acks the replica never got: still
    # unacked on the new master (before the fix, kept there for as long as the worker lived).
    ack_lost = PromptRequest.objects.filter(
        id__in=[_request_id(raw) for raw in client.hvals("unacked")],
        status=S.SUCCEEDED,
        finished_at__lt=datetime.fromtimestamp(killed_at, tz=UTC),
    ).count()

    def completed_after_kill() -> bool:
        ids = load.accepted_after(killed_at)
        return PromptRequest.objects.filter(id__in=ids, status=S.SUCCEEDED).exists()

    wait_until(completed_after_kill, 60, "a request accepted after the kill to complete")
    first_done = PromptRequest.objects.filter(
        id__in=load.accepted_after(killed_at), status=S.SUCCEEDED
    ).order_by("finished_at")[0]
    recovery_s = first_done.finished_at.timestamp() - killed_at
    time.sleep(2)  # load on the new master for a while
    load.stop.set()
    sender.join(timeout=30)
    # The API thread's kept result connection pointed at the dead master: a blocking call now
    # is answered through the new one.
    after = post(stack, key, max_tokens=MAX_TOKENS)
    assert after.status_code == 200, after.text

    def all_finished() -> bool:
        return not PromptRequest.objects.filter(status__in=(S.QUEUED, S.RUNNING)).exists()

    wait_until(all_finished, 90, "every stored request to finish")
    time.sleep(1)  # the listener sees the last publishes
    published_before_the_restores = Counter(published)

    rows = list(PromptRequest.objects.all())
    codes = Counter(code for _, code, _ in load.answers)
    assert codes[202] > 0 and set(codes) <= {202, 503}, codes
    accepted = {rid for _, code, rid in load.answers if code == 202 and rid}
    accepted |= {warm.headers["X-LLMQueue-Request-Id"], after.headers["X-LLMQueue-Request-Id"]}
    done = [r for r in rows if str(r.id) in accepted]
    assert len(done) == len(accepted)  # every accepted request has its row …
    assert {r.status for r in done} == {S.SUCCEEDED}  # … and it succeeded
    assert {r.completion_tokens for r in done} == {MAX_TOKENS}
    assert {r.worker for r in done} == {node}
    # A row stored as the master died whose publish then failed: answered 503, failed at once
    # ("not enqueued"), its reservation back; never run.
    unqueued = [r for r in rows if str(r.id) not in accepted]
    assert all(r.status == S.FAILED and r.attempts == 0 for r in unqueued)
    assert all(r.error.startswith("not enqueued: broker unavailable") for r in unqueued)
    assert len(unqueued) <= codes[503]
    duplicated = [rid for rid, n in _successes(published).items() if n > 1]
    assert duplicated == []
    republished = int(client.get(RECONCILED_KEY) or 0)
    assert republished > 0  # the messages only the dead master had were published anew
    assert info(stack.server(stack.replica_port))["role"] == "master"
    # The worker no longer holds the messages whose acks were lost, so it does not keep them
    # visible: kombu restores them after the visibility timeout (8 s in tests), and their
    # claims drop them.
    wait_until(lambda: queued_messages(client) == 0, 30, "every message to be acked")
    # Delivered again, none ran again nor published a second outcome.
    assert {r.id: r.attempts for r in PromptRequest.objects.all()} == {
        r.id: r.attempts for r in rows
    }
    assert _successes(published) == _successes(published_before_the_restores)
    stop_listening.set()
    listener.join(timeout=5)
    figures = {
        "accepted": len(accepted),
        "completed": len(done),
        "lost": len(accepted) - len(done),
        "duplicated": len(duplicated),
        "recovery_s": round(recovery_s, 2),
        "republished": republished,
    }
    print(
        f"sentinel failover: {figures}, promoted after {promoted_s:.1f} s, answers {dict(codes)},"
        f" replica lacked {lacked} bytes, attempts {Counter(r.attempts for r in rows)},"
        f" acks the replica lacked {ack_lost}, stored but not enqueued {len(unqueued)},"
        f" one SUCCESS seen for {sum(_successes(published)[i] == 1 for i in accepted)}"
        f" (the listener is away while the master is)"
    )
    record("sentinel_failover", **figures)


def _successes(published: Counter[str]) -> Counter[str]:
    return Counter({k.split(":")[0]: n for k, n in published.items() if k.endswith(":SUCCESS")})


def _request_id(raw: bytes | str) -> uuid.UUID:
    return uuid.UUID(json.loads(raw)[0]["headers"]["id"])

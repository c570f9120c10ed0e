"""A worker host cut off from Redis mid-generation and healed: another host runs its requests
within the stale window, its late finishes are refused, and it serves again once back (issue 14).

Three hosts on this machine (tests/netns.py): an API host and two worker hosts, each a network
namespace linked to a bridge that holds the test's own Redis and, under PostgreSQL, a relay to
the database. The cut drops all of host A's packets, Redis' and the database's alike, as a
host losing its network does.
"""

from __future__ import annotations

import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings

from celery_ext.broker import ACK_LEFT, held_key
from contract import liveness
from llmqueue.models import PromptRequest
from tests.conftest import REPO, SIMULATED, Seeded, database_url, settle, wait_until
from tests.netns import Host, Network, require_namespaces
from tests.reliability_record import record
from tests.stack import Stack, alive, kill, post, stack_fixture  # noqa: F401 (the stack fixture)
from tests.test_crash_recovery import PRODUCTION, listen, published_for
from workers.processes import free_port, listening

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status

HELD = 8
MAX_TOKENS = 120
# Host A generates its 8 at once, ~13 s each (120 steps of 8 sequences, ~0.1 s a step at × 12):
# still generating after host B has started (several seconds on a busy machine), A was cut off
# and its beat went stale. Host B takes ~25 s over them (× 24): it still holds them when A,
# healed, acks the messages it ran (its late finishes refused), however long B took to start.
HOST_A = (*SIMULATED[:-1], str(HELD), "--slots", str(HELD), "--sim-time-scale", "12")
HOST_B = (*SIMULATED, "--slots", "16", "--sim-time-scale", "24")


@pytest.fixture
def network() -> Iterator[Network]:
    """A bridge of this test's own; the test takes it before `stack`, so it is removed after
    the stack's processes are stopped."""
    require_namespaces()
    net = Network()
    try:
        net.build()
        yield net
    finally:
        net.remove()


def reach_database(stack: Stack, address: str) -> str | None:
    """The database URL for processes in the namespaces: PostgreSQL (on 127.0.0.1 here)
    through a relay on `address`; None for SQLite, a file every namespace opens alike."""
    url = database_url()
    if url.startswith("sqlite"):
        return None
    parts = urlsplit(url)
    port = free_port()
    relay = [sys.executable, "-m", "tests.tcp_relay", address, str(port)]
    relay += [parts.hostname or "127.0.0.1", str(parts.port or 5432)]
    process = stack.spawn("db-relay", relay, cwd=REPO, ports=(port,))
    wait_until(lambda: alive(process, "relay") and listening(port, address), 15, "the relay")
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{address}:{port}" if credentials else f"{address}:{port}"
    return parts._replace(netloc=netloc).geturl()


def running_on(node: str) -> set[uuid.UUID]:
    rows = PromptRequest.objects.filter(status=S.RUNNING, worker=node)
    return set(rows.values_list("id", flat=True))


def steps(path: Path) -> int:
    """Engine steps the worker logged (--step-log): one line each."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def engine_idle(path: Path, at_least: int, quiet_seconds: float = 1.0) -> bool:
    """Whether the engine ran `at_least` steps and has run none for `quiet_seconds`."""
    if steps(path) < at_least:
        return False
    return time.time() - path.stat().st_mtime > quiet_seconds


def ignored(log: Path, ids: set[uuid.UUID]) -> set[uuid.UUID]:
    """The requests whose task the worker's log says it ignored: its finish was refused."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {i for i in ids if f"[{i}] ignored" in text}


def left_to_others(log: Path) -> int:
    """Acks the worker left undone: the messages were restored while it was cut off."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.count(ACK_LEFT)


def submit_background(stack: Stack, key: str, n: int) -> list[uuid.UUID]:
    ids = []
    for i in range(n):
        response = post(stack, key, background=True, prompt=f"p{i}", max_tokens=MAX_TOKENS)
        assert response.status_code == 202, response.text
        ids.append(uuid.UUID(response.json()["id"]))
    return ids


def taken_over(ids: set[uuid.UUID], node: str) -> bool:
    """Whether `node` claimed every one of `ids` as their second attempt."""
    rows = PromptRequest.objects.filter(id__in=ids)
    return all((r.worker, r.attempts) == (node, 2) for r in rows)


def last_claim_after(ids: set[uuid.UUID], since: float) -> float:
    rows = PromptRequest.objects.filter(id__in=ids)
    return max(r.started_at.timestamp() for r in rows) - since


def assert_still_held_by(client: redis.Redis, node: str, ids: set[uuid.UUID]) -> None:
    """`node` runs `ids`, and their messages are in its held set and kombu's unacked hash (so
    a rescue would restore them, were it to die now)."""
    assert running_on(node) == ids
    tags = client.smembers(held_key(node))
    assert len(tags) == len(ids) and all(client.hexists("unacked", t) for t in tags)


def test_a_worker_host_cut_off_from_redis_is_recovered_elsewhere_and_its_late_finishes_refused(
    seeded: Seeded, network: Network, stack: Stack, tmp_path: Path
):
    api_host, host_a, host_b = (network.add_host(name) for name in ("api", "a", "b"))
    stack.redis_host, stack.api_host = Host(network.address), api_host
    stack.database_url = reach_database(stack, network.address)
    stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    published, stop, listener = listen(client)
    stack.start_api(seeded.key)
    log_a, steps_a = tmp_path / "host-a.log", tmp_path / "host-a.steps"
    _, node_a = stack.start_worker(
        client, *HOST_A, "--step-log", str(steps_a), host=host_a, log_path=log_a, env=PRODUCTION
    )
    accepted = submit_background(stack, seeded.key, HELD)
    wait_until(lambda: len(running_on(node_a)) == HELD, 30, f"host A to claim {HELD} requests")
    worker_b, node_b = stack.start_worker(client, *HOST_B, host=host_b, env=PRODUCTION)
    held = running_on(node_a)
    assert held == set(accepted)
    assert steps(steps_a) < MAX_TOKENS  # the fault comes mid-generation

    network.cut("a")
    cut_at = time.time()
    stale = settings.LLMQUEUE_WORKER_STALE_SECONDS
    wait_until(lambda: taken_over(held, node_b), stale + 20, "host B to take A's requests over")
    recovery_s = last_claim_after(held, cut_at)
    # The stale window, a rescue interval, B's claim of 8 at once.
    assert recovery_s < stale + 3, f"recovered {recovery_s:.1f} s after the cut"
    # Host A generates on while cut off; healed once its engine has finished all 8, so each
    # finish it records is a late one (the row is B's attempt 2).
    wait_until(lambda: engine_idle(steps_a, MAX_TOKENS), 60, "host A's engine to finish")
    assert running_on(node_b) == held
    network.heal("a")
    healed_at = time.time()

    wait_until(lambda: ignored(log_a, held) == held, 60, "host A's late finishes to be refused")
    wait_until(
        lambda: node_a in liveness.live_workers(client, "default", stale), 60, "host A to beat"
    )
    beat_again_s = time.time() - healed_at
    # A acks the messages it ran once the link is back: they are B's now. A late ack that took
    # them out of kombu's unacked hash would leave nothing to restore if B died next.
    wait_until(lambda: left_to_others(log_a) == HELD, 30, "host A's late acks")
    acked_s = time.time() - healed_at
    assert_still_held_by(client, node_b, held)  # B is still generating them
    settle(client, HELD, 60, stop, listener)
    for row in PromptRequest.objects.filter(id__in=held):
        assert (row.status, row.worker, row.attempts) == (S.SUCCEEDED, node_b, 2)
        assert row.completion_tokens == MAX_TOKENS
        assert row.worker_losses == 1  # host A, counted once by B's claim
        assert published[f"{row.id}:SUCCESS"] == 1
    assert published_for(published, held) == HELD  # nothing else published for them

    # Host A serves again: with B gone, the next request runs on A.
    assert kill(worker_b, signal.SIGTERM) == 0
    after = post(stack, seeded.key, max_tokens=5)
    assert after.status_code == 200, after.text
    assert PromptRequest.objects.get(id=after.json()["id"].removeprefix("cmpl-")).worker == node_a
    print(
        f"recovery {recovery_s:.1f} s after the cut; after the heal host A beat in "
        f"{beat_again_s:.1f} s and had acked in {acked_s:.1f} s"
    )
    record(
        "partition",
        accepted=HELD,
        completed=PromptRequest.objects.filter(id__in=held, status=S.SUCCEEDED).count(),
        lost=PromptRequest.objects.filter(id__in=held).exclude(status=S.SUCCEEDED).count(),
        duplicated=sum(1 for i in held if published[f"{i}:SUCCESS"] > 1),
        recovery_s=round(recovery_s, 2),
    )

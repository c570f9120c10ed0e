"""Admission control under load: admitted requests/s, rejection latency, over-admission.

    .venv/bin/python -m bench.admission [--duration 15] [--connections 16] [--api-workers 2]

The API runs under granian (WSGI, `--api-workers` processes) against a real Redis (its own db
number) and its own DB (temporary SQLite, or database `llmqueue_bench_admission` when
$DATABASE_URL names a PostgreSQL server). Every request is a background completion (202 at
once), so each one measures the admission path only: auth, validation, the admission script,
the row's insert and the publish to the broker. No engine consumes the queue: the benchmark
beats the pool's liveness key itself (a worker would take the same two cores and measure the
worker); the tier's depth cap is raised so the growing queue never refuses.

Three phases, one run, a small asyncio client on loopback (uvloop by default; pre-encoded
requests, keep-alive). The API's Server-Timing header gives each answer's time inside the app,
reported beside the client's figure, and the client reports how late its own timer fired:

1. admitted throughput: `--connections` connections send admitted requests back to back for
   `--duration` s; admitted_rps = 202s ÷ elapsed.
2. rejections under load: admitted requests open-loop at `--load-rps` (default: the goal,
   400/s) plus a 429 stream (a tenant over its request rate) and a 503 stream (a tenant whose
   tier queue is full) at `--reject-rps` each; the latency of every rejection, client-side.
3. over-admission: 8 connections of one tenant (`--limit-rps`, `--limit-burst`) as fast as they
   can for `--duration` s; admitted ÷ (burst + rate × window), the window from the first send to
   the last response (every decision falls inside it).

Writes bench/results/admission.json and prints it. Exit status 1 when a status other than the
expected one came back, or a rejection lacked Retry-After (an invalid run).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis as redis_client

from bench import harness
from bench.http_client import encode_request
from bench.latency import cpu_per_request, cpu_snapshot, summary_ms
from contract import liveness

HOST = "127.0.0.1"
POOL = "default"
MODEL = "sim"
GOAL_ADMITTED_RPS = 400.0
GOAL_REJECT_P99_MS = 10.0
GOAL_OVER_ADMISSION = 1.0
T = TypeVar("T")
UNLIMITED = {"requests_per_second": 1e6, "burst": 10**6, "tokens_per_minute": 10**9}


@dataclass(frozen=True)
class Reply:
    """One exchange as the client saw it (perf_counter seconds)."""

    kind: str
    started: float
    ended: float
    status: int
    retry_after: str
    app_ms: float | None = None  # the server's own Server-Timing: time inside the app

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000.0


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams; reads only what it reports."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(HOST, port)
        return cls(reader, writer)

    async def exchange(self, kind: str, request: bytes) -> Reply:
        started = time.perf_counter()
        self.writer.write(request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        length, retry_after, app_ms = 0, "", None
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "retry-after":
                retry_after = value.strip()
            elif name == "server-timing":
                app_ms = float(value.partition("dur=")[2])
        await self.reader.readexactly(length)
        return Reply(kind, started, time.perf_counter(), status, retry_after, app_ms)

    def close(self) -> None:
        self.writer.close()


def completion_request(port: int, api_key: str, max_tokens: int = 16) -> bytes:
    body = {"model": MODEL, "prompt": "Say hello.", "max_tokens": max_tokens, "background": True}
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    return encode_request(
        "POST", f"{HOST}:{port}", "/v1/completions", headers, json.dumps(body).encode()
    )


async def closed_loop(
    port: int, kind: str, request: bytes, connections: int, seconds: float
) -> tuple[list[Reply], float]:
    """`connections` clients each send the next request as soon as the last one answered."""
    opened = [await Connection.open(port) for _ in range(connections)]
    replies: list[Reply] = []
    stop = time.perf_counter() + seconds

    async def client(conn: Connection) -> None:
        while time.perf_counter() < stop:
            try:
                replies.append(await conn.exchange(kind, request))
            except (ConnectionError, asyncio.IncompleteReadError):
                replies.append(Reply(kind, time.perf_counter(), time.perf_counter(), 0, ""))
                conn.close()
                conn = await Connection.open(port)
                opened.append(conn)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(conn) for conn in opened))
    finally:
        for conn in opened:
            conn.close()
    return replies, time.perf_counter() - t0


async def open_loop(
    port: int, streams: list[tuple[str, bytes, float, int]], seconds: float
) -> tuple[list[Reply], float, dict[str, Any]]:
    """Each (kind, request, rate, connections) stream sends at fixed intervals regardless of
    answers, over its own pool of keep-alive connections opened beforehand (a client's pool: no
    connection storm when the server slows down). A send waits for a free connection; its
    latency counts from its scheduled time, so that wait is in the figure (no coordinated
    omission). Returns the replies, the elapsed time, the longest wait for a connection and how
    late the client's own timer fired (a client starved of CPU inflates every latency)."""
    replies: list[Reply] = []
    waited: list[float] = []
    late: list[float] = []  # the client's own timer: woken this long after a scheduled send

    async def stream(kind: str, request: bytes, rate: float, connections: int) -> None:
        idle: asyncio.Queue[Connection] = asyncio.Queue()
        for _ in range(connections):
            idle.put_nowait(await Connection.open(port))
        tasks: set[asyncio.Task[None]] = set()

        async def send(scheduled: float) -> None:
            conn = await idle.get()
            waited.append(time.perf_counter() - scheduled)
            try:
                reply = await conn.exchange(kind, request)
                replies.append(dataclasses.replace(reply, started=scheduled))
            except (ConnectionError, asyncio.IncompleteReadError):
                # The server dropped the connection: an answer that never came (status 0).
                replies.append(Reply(kind, scheduled, time.perf_counter(), 0, ""))
                conn.close()
                conn = await Connection.open(port)
            idle.put_nowait(conn)

        start = time.perf_counter() + 0.05
        for i in range(round(rate * seconds)):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(time.perf_counter() - scheduled)
            task = asyncio.create_task(send(scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        while not idle.empty():
            idle.get_nowait().close()

    t0 = time.perf_counter()
    await asyncio.gather(*(stream(*s) for s in streams if s[2] > 0))
    elapsed = time.perf_counter() - t0
    lags = {
        "max_wait_for_connection_ms": round(max(waited, default=0.0) * 1000.0, 3),
        "client_timer_late_ms": summary_ms([x * 1000.0 for x in late]),
    }
    return replies, elapsed, lags


def run_client(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run the load generator on uvloop (libuv's timers and sockets: less of the client's own
    CPU and timer lateness in every figure) or on asyncio's default loop."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def by_kind(replies: list[Reply], kind: str) -> list[Reply]:
    return [r for r in replies if r.kind == kind]


def unexpected(replies: list[Reply], expected: dict[str, int]) -> Counter[str]:
    """Replies whose status is not their stream's, and rejections without Retry-After."""
    wrong: Counter[str] = Counter()
    for reply in replies:
        if reply.status != expected[reply.kind]:
            wrong[f"{reply.kind}:{reply.status}"] += 1
        elif reply.status in (429, 503) and not reply.retry_after.isdigit():
            wrong[f"{reply.kind}:no Retry-After"] += 1
    return wrong


# --- the run -----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    parser.add_argument("--connections", type=int, default=16, help="phase 1 connections")
    parser.add_argument("--load-rps", type=float, default=GOAL_ADMITTED_RPS, help="phase 2")
    parser.add_argument("--reject-rps", type=float, default=50.0, help="phase 2, per status")
    parser.add_argument("--hammer-connections", type=int, default=8, help="phase 3 clients")
    parser.add_argument("--limit-rps", type=float, default=50.0, help="phase 3 tenant's rate")
    parser.add_argument("--limit-burst", type=int, default=20, help="phase 3 tenant's burst")
    parser.add_argument("--api-workers", type=int, default=2, help="granian processes")
    parser.add_argument("--threads", type=int, default=8, help="granian blocking threads")
    parser.add_argument("--client-loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--redis-db", type=int, default=5, help="Redis db number, flushed")
    parser.add_argument(
        "--database-url", default=None, help="override $DATABASE_URL (postgres://… or sqlite:///…)"
    )
    parser.add_argument("--db-name", default="llmqueue_bench_admission", help="PostgreSQL database")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "admission.json")
    parser.add_argument("--label", default="", help="free text stored with the result")
    return parser.parse_args(argv)


def seed(env: dict[str, str], args: argparse.Namespace) -> dict[str, str]:
    hammer = {
        "requests_per_second": args.limit_rps,
        "burst": args.limit_burst,
        "tokens_per_minute": 10**9,
    }
    tenants = [
        {"name": "load", "tier": "interactive", "limits": UNLIMITED},
        # One request per 1000 s: after its first, every request is over the rate.
        {"name": "limited", "tier": "interactive", "limits": {**UNLIMITED, "burst": 1,
                                                                "requests_per_second": 0.001}},
        {"name": "crowded", "tier": "batch", "limits": UNLIMITED},
        {"name": "hammer", "tier": "interactive", "limits": hammer},
    ]  # fmt: skip
    # No engine drains the interactive queue: its cap must outlast the run. The batch queue
    # holds one request, then is full.
    tiers = {"interactive": {"max_queue_depth": 10**7}, "batch": {"max_queue_depth": 1}}
    return harness.seed_tenants(env, tenants, model=MODEL, pool=POOL, tiers=tiers)


def queued(url: str) -> int:
    client = redis_client.Redis.from_url(url)
    try:
        return sum(int(client.llen(f"{POOL}.{tier}")) for tier in ("interactive", "batch"))
    finally:
        client.close()


async def phases(port: int, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    load = completion_request(port, keys["load"])
    out: dict[str, Any] = {}
    # Warm both server processes' caches (auth, routes) and connections; not counted.
    await closed_loop(port, "warmup", load, args.connections, 2.0)
    # The one request each rejecting tenant may have: after it, "limited" is over its rate and
    # "crowded"'s tier queue is full.
    for name in ("limited", "crowded"):
        conn = await Connection.open(port)
        first = await conn.exchange(name, completion_request(port, keys[name]))
        conn.close()
        if first.status != 202:
            raise RuntimeError(f"the first request of {name!r} answered {first.status}")
    out["throughput"] = await closed_loop(port, "admitted", load, args.connections, args.duration)
    streams = [
        ("admitted", load, args.load_rps, args.connections),
        ("429", completion_request(port, keys["limited"]), args.reject_rps, 8),
        ("503", completion_request(port, keys["crowded"]), args.reject_rps, 8),
    ]
    replies, seconds, lags = await open_loop(port, streams, args.duration)
    out["rejections"] = (replies, seconds)
    out["lags"] = lags
    hammer = completion_request(port, keys["hammer"])
    out["hammer"] = await closed_loop(
        port, "hammer", hammer, args.hammer_connections, args.duration
    )
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    redis = harness.redis_url(args.redis_db)
    database = harness.bench_database(args.db_name, args.database_url)
    server = harness.ApiServer("granian", workers=args.api_workers, threads=args.threads)
    harness.flush_redis(redis)
    live = redis_client.Redis.from_url(redis)
    try:
        env = harness.bench_env(database, redis)
        harness.migrate(env)
        keys = seed(env, args)
        # Stands in for a worker of the pool for the whole run (no engine: see the docstring).
        liveness.beat(live, POOL, "bench-no-engine", now=time.time() + 24 * 3600)
        port = harness.free_port()
        with harness.children() as started:
            api_log = harness.RESULTS / "admission-api.log"
            started.append(harness.start_process("api", server.argv(HOST, port), env, api_log))
            harness.wait_for_http(HOST, port, started[-1])
            cpu_before = cpu_snapshot(started, redis)
            t0 = time.perf_counter()
            runs = run_client(phases(port, keys, args), args.client_loop)
            cpu_after = cpu_snapshot(started, redis)
            elapsed = time.perf_counter() - t0
            if not started[-1].running():
                raise RuntimeError(f"the API died during the run:\n{started[-1].log_tail()}")
        messages = queued(redis)
        rows = len(harness.request_timeline(env))
    finally:
        live.close()
        harness.flush_redis(redis)
        database.cleanup()
    return summarise(args, runs, messages, rows, server, database.kind, cpu_before, cpu_after,
                     elapsed)  # fmt: skip


def summarise(
    args: argparse.Namespace,
    runs: dict[str, Any],
    messages: int,
    rows: int,
    server: harness.ApiServer,
    database: str,
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    elapsed: float,
) -> dict[str, Any]:
    throughput, throughput_s = runs["throughput"]
    rejections, rejections_s = runs["rejections"]
    hammer = runs["hammer"][0]
    expected = {"admitted": 202, "429": 429, "503": 503}
    wrong = unexpected(throughput + rejections, expected)
    rejected = [r.latency_ms for r in rejections if r.kind in ("429", "503")]
    reject = summary_ms(rejected)
    admitted_rps = sum(r.status == 202 for r in throughput) / throughput_s
    window = max(r.ended for r in hammer) - min(r.started for r in hammer)
    hammer_admitted = sum(r.status == 202 for r in hammer)
    allowed = args.limit_burst + args.limit_rps * window
    wrong.update(f"hammer:{r.status}" for r in hammer if r.status not in (202, 429))
    # Every 202 stored one row and published one message (two seed requests included).
    admitted_total = sum(r.status == 202 for r in throughput + rejections + hammer) + 2
    warm = rows - admitted_total  # the warm-up's requests
    consistent = messages == rows and warm >= 0
    result: dict[str, Any] = {
        "admitted_rps": round(admitted_rps, 1),
        "reject_p50_ms": reject.get("p50_ms"),
        "reject_p99_ms": reject.get("p99_ms"),
        "over_admission": round(hammer_admitted / allowed, 4),
        "goal": {
            "admitted_rps": GOAL_ADMITTED_RPS,
            "reject_p99_ms": GOAL_REJECT_P99_MS,
            "over_admission": GOAL_OVER_ADMISSION,
        },
        "goal_met": admitted_rps >= GOAL_ADMITTED_RPS
        and bool(rejected)
        and reject["p99_ms"] <= GOAL_REJECT_P99_MS
        and hammer_admitted <= allowed,
        "valid": not wrong and consistent,
        "unexpected": dict(wrong),
        "throughput_phase": {
            "connections": args.connections,
            "seconds": round(throughput_s, 2),
            "admitted": sum(r.status == 202 for r in throughput),
            "latency": summary_ms([r.latency_ms for r in throughput]),
        },
        "rejection_phase": {
            "seconds": round(rejections_s, 2),
            "offered_rps": {
                "admitted": args.load_rps,
                "429": args.reject_rps,
                "503": args.reject_rps,
            },
            "achieved_rps": {
                kind: round(len(by_kind(rejections, kind)) / rejections_s, 1)
                for kind in ("admitted", "429", "503")
            },
            **runs["lags"],
            "rejection_in_app": summary_ms(
                [r.app_ms for r in rejections if r.kind in ("429", "503") and r.app_ms is not None]
            ),
            "latency": {
                kind: summary_ms([r.latency_ms for r in by_kind(rejections, kind)])
                for kind in ("admitted", "429", "503")
            },
        },
        "over_admission_phase": {
            "clients": args.hammer_connections,
            "limit": {"requests_per_second": args.limit_rps, "burst": args.limit_burst},
            "window_s": round(window, 3),
            "admitted": hammer_admitted,
            "allowed": round(allowed, 2),
            "refused": sum(r.status == 429 for r in hammer),
            "under_admission": round(1 - hammer_admitted / allowed, 4),
        },
        "stored": {"rows": rows, "broker_messages": messages, "consistent": consistent},
        "cpu_ms_per_request": cpu_per_request(
            cpu_before, cpu_after, len(throughput) + len(rejections) + len(hammer)
        ),
        "machine": {
            "cores": os.cpu_count(),
            "busy_cores_during_run": round(
                (cpu_after["machine"] - cpu_before["machine"]) / elapsed, 2
            ),
            "loadavg_after": list(os.getloadavg()),
        },
        "config": {
            "api": server.describe(),
            "client": f"bench/admission.py on {args.client_loop}, keep-alive, loopback",
            "engine": "none: the benchmark beats the pool's liveness; the queue is not consumed",
            "database": database,
            "label": args.label,
        },
    }
    return result


def report(result: dict[str, Any]) -> str:
    phase1, phase2 = result["throughput_phase"], result["rejection_phase"]
    phase3 = result["over_admission_phase"]
    lines = [
        f"admission ({result['config']['database']}, granian {result['config']['api']['workers']}"
        f" workers): goal met={result['goal_met']} valid={result['valid']}",
        f"  admitted {result['admitted_rps']}/s over {phase1['connections']} connections "
        f"(latency p50 {phase1['latency']['p50_ms']} p99 {phase1['latency']['p99_ms']} ms)",
    ]
    for kind in ("admitted", "429", "503"):
        stats = phase2["latency"][kind]
        lines.append(
            f"  under load, {kind:8s} at {phase2['achieved_rps'][kind]:6.1f}/s: "
            f"p50 {stats.get('p50_ms')} p99 {stats.get('p99_ms')} ms"
        )
    in_app, late = phase2["rejection_in_app"], phase2["client_timer_late_ms"]
    lines.append(
        f"  rejections inside the app (Server-Timing) p50 {in_app.get('p50_ms')} p99 "
        f"{in_app.get('p99_ms')} ms; client timer late p99 {late.get('p99_ms')} ms"
    )
    lines.append(
        f"  rejections p50 {result['reject_p50_ms']} p99 {result['reject_p99_ms']} ms; "
        f"over-admission {result['over_admission']} ({phase3['admitted']} admitted of "
        f"{phase3['allowed']} allowed, {phase3['clients']} clients)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    harness.exit_on_sigterm()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    harness.write_result(args.out, result, report(result))
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())

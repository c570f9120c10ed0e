"""Earliest deadline first within a tier vs FIFO: when a tighter per-request deadline helps.

    .venv/bin/python -m bench.deadlines [--seconds 40] [--max-num-seqs 8] [--quick]

One tier (interactive, max wait 30 s), two kinds of request on it: *urgent* ones sent with
`"deadline_seconds": --urgent-deadline` (2 s) and *relaxed* ones with the tier's 30 s. The real
stack: the API under granian (background calls, 202 at once), admission, the queue, one
`workers.serve` with the simulated GPU engine at real speed (an 8B model on an H100: a request of
~100 prompt and 48 output tokens takes ~0.4 s; `--max-num-seqs` sequences at once).
Arrivals are Poisson at a multiple of the engine's capacity, measured first by draining a
backlog. Each scenario runs twice, the API publishing by deadline (LLMQUEUE_EDF_WITHIN_TIER=true,
the default) and in plain FIFO order (false):

- `mixed-1.1`: 20% urgent, 80% relaxed at 1.1× capacity: the backlog grows by 10% of capacity.
- `uniform-1.1`: every request relaxed at 1.1×: every deadline is the tier's, so deadline
  order is arrival order and EDF can change nothing.
- `mixed-0.7`: 20% urgent at 0.7×: no backlog to jump, so nothing to gain either.

A request *meets its deadline* when its first token came before it (the row's first_token_at ≤
deadline_at); refused (503 deadline_unreachable, the estimated wait already past the deadline),
expired and late requests miss it. Writes bench/results/deadlines.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.http_client import encode_request
from bench.latency import percentile

HOST = "127.0.0.1"
POOL = "default"
MODEL = "sim"
PROMPT = "x" * 400  # ~100 tokens at 4 bytes per token, as the simulated engine counts them
MAX_TOKENS = 48
TIER_WAIT_S = 30
SCENARIOS = {  # name: (urgent share, load multiple)
    "mixed-1.1": (0.2, 1.1),
    "uniform-1.1": (0.0, 1.1),
    "mixed-0.7": (0.2, 0.7),
}


@dataclass(frozen=True)
class Sent:
    kind: str  # "urgent" | "relaxed"
    status: int
    request_id: str


async def _exchange(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        length = next(
            int(line.split(":", 1)[1]) for line in head if line.lower().startswith("content-length")
        )
        return int(head[0].split(" ", 2)[1]), await reader.readexactly(length)
    finally:
        writer.close()


def completion_request(port: int, key: str, deadline_s: float | None = None) -> bytes:
    """A background completion of ~100 prompt and MAX_TOKENS output tokens (bench/overload.py
    sends the same)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "background": True,
    }
    if deadline_s is not None:
        body["deadline_seconds"] = deadline_s
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return encode_request(
        "POST", f"{HOST}:{port}", "/v1/completions", headers, json.dumps(body).encode()
    )


async def poisson_arrivals(
    port: int,
    key: str,
    rate: float,
    seconds: float,
    urgent_share: float,
    urgent_s: float,
    seed: int,
) -> list[Sent]:
    """Open loop: each request on its own connection at its Poisson arrival time."""
    rng = random.Random(seed)
    requests = {
        "urgent": completion_request(port, key, urgent_s),
        "relaxed": completion_request(port, key, None),
    }
    sent: list[Sent] = []

    async def one(kind: str) -> None:
        status, body = await _exchange(port, requests[kind])
        sent.append(Sent(kind, status, json.loads(body).get("id", "") if status == 202 else ""))

    tasks, start, at = [], time.perf_counter(), 0.0
    while (at := at + rng.expovariate(rate)) < seconds:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        kind = "urgent" if rng.random() < urgent_share else "relaxed"
        tasks.append(asyncio.create_task(one(kind)))
    await asyncio.gather(*tasks)
    return sent


def rows(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every request row: status and epoch seconds of enqueue, deadline, first token, finish."""
    done = subprocess.run(
        [harness.PYTHON, "-m", "bench.deadlines", "--rows"],
        cwd=harness.REPO, env=env, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _rows_main() -> None:
    import django

    django.setup()
    from llmqueue.models import PromptRequest

    def epoch(value: Any) -> float | None:
        return None if value is None else float(value.timestamp())

    fields = ("id", "status", "enqueued_at", "deadline_at", "first_token_at", "finished_at")
    out = {
        str(i): {"status": status, "enqueued": epoch(q), "deadline": epoch(d),
                 "first_token": epoch(f), "finished": epoch(e)}
        for i, status, q, d, f, e in PromptRequest.objects.values_list(*fields)
    }  # fmt: skip
    print(json.dumps(out))


def wait_until_settled(env: dict[str, str], expected: int, timeout_s: float) -> dict[str, Any]:
    """Rows once every one is finished, failed or expired (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = rows(env)
        open_rows = sum(r["status"] in ("queued", "running") for r in found.values())
        if (len(found) >= expected and not open_rows) or time.monotonic() > deadline:
            return found
        time.sleep(2)


def summarise(sent: list[Sent], found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("urgent", "relaxed"):
        mine = [s for s in sent if s.kind == kind]
        if not mine:
            continue
        admitted = [found[s.request_id] for s in mine if s.request_id in found]
        met = [
            r
            for r in admitted
            if r["first_token"] is not None and r["first_token"] <= r["deadline"]
        ]
        waits = [r["first_token"] - r["enqueued"] for r in admitted if r["first_token"] is not None]
        statuses = Counter(r["status"] for r in admitted)
        out[kind] = {
            "sent": len(mine),
            "met_deadline": round(len(met) / len(mine), 4),
            "refused": sum(s.status != 202 for s in mine),
            "refusals": dict(Counter(str(s.status) for s in mine if s.status != 202)),
            "expired": statuses.get("expired", 0),
            "late": sum(r["first_token"] is not None and r["first_token"] > r["deadline"]
                        for r in admitted),
            "first_token_wait_p50_s": round(percentile(waits, 50), 3) if waits else None,
            "first_token_wait_p99_s": round(percentile(waits, 99), 3) if waits else None,
        }  # fmt: skip
    return out


def run_one(
    args: argparse.Namespace, edf: bool, urgent_share: float, rate: float, seed: int
) -> dict[str, Any]:
    """One scenario under one ordering, on a fresh DB and Redis db, its own API and worker."""
    with serving(args, LLMQUEUE_EDF_WITHIN_TIER=str(edf).lower()) as (env, port, key):
        sent = asyncio.run(
            poisson_arrivals(
                port, key, rate, args.seconds, urgent_share, args.urgent_deadline, seed
            )
        )
        admitted = sum(s.status == 202 for s in sent)
        return summarise(sent, wait_until_settled(env, admitted, TIER_WAIT_S + 60))


@contextmanager
def serving(args: argparse.Namespace, **settings: str) -> Iterator[tuple[dict[str, str], int, str]]:
    """A fresh DB and Redis db, one simulated worker and the API: (environment, port, API key)."""
    redis = harness.redis_url(args.redis_db)
    database = harness.sqlite_database()
    harness.flush_redis(redis)
    try:
        env = harness.bench_env(database, redis, **settings)
        harness.migrate(env)
        key = seed_tenant(env)
        port = harness.free_port()
        with harness.children() as started:
            worker = harness.worker_argv(
                model=MODEL, pool=POOL, time_scale=1.0, max_num_seqs=args.max_num_seqs,
                slots=2 * args.max_num_seqs,
            )  # fmt: skip
            started.append(harness.start_process("worker", worker, env, None))
            api = harness.ApiServer("granian", workers=1, threads=8)
            started.append(harness.start_process("api", api.argv(HOST, port), env, None))
            harness.wait_for_workers(redis, POOL, 1, started)
            harness.wait_for_http(HOST, port, started[-1])
            yield env, port, key
    finally:
        harness.flush_redis(redis)
        database.cleanup()


def seed_tenant(env: dict[str, str]) -> str:
    unlimited = {"requests_per_second": 1e4, "burst": 10**4, "tokens_per_minute": 10**9}
    tenants = [{"name": "bench", "tier": "interactive", "limits": unlimited}]
    tiers = {"interactive": {"max_wait_seconds": TIER_WAIT_S, "max_queue_depth": 10**6}}
    return harness.seed_tenants(env, tenants, model=MODEL, pool=POOL, tiers=tiers)["bench"]


def capacity(args: argparse.Namespace) -> float:
    """Requests per second the engine completes with a standing backlog (relaxed requests only,
    the same length as the scenarios')."""
    with serving(args) as (env, port, key):
        backlog = 12 * args.max_num_seqs

        async def flood() -> None:
            request = completion_request(port, key, None)
            await asyncio.gather(*(_exchange(port, request) for _ in range(backlog)))

        asyncio.run(flood())
        found = wait_until_settled(env, backlog, 120)
    finished = sorted(r["finished"] for r in found.values() if r["finished"] is not None)
    # Skip the first engine-full of requests: they started together with an empty engine.
    steady = finished[args.max_num_seqs :]
    return (len(steady) - 1) / (steady[-1] - steady[0])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.deadlines", description=__doc__)
    parser.add_argument("--seconds", type=float, default=40.0, help="arrival window per run")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--urgent-deadline", type=float, default=2.0, help="seconds")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="10 s windows, mixed-1.1 only")
    parser.add_argument("--redis-db", type=int, default=10, help="Redis db number, flushed")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "deadlines.json")
    parser.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.scenarios = 10.0, "mixed-1.1"
    return args


def report(result: dict[str, Any]) -> str:
    lines = [
        f"capacity {result['capacity_rps']:.1f} requests/s; urgent deadline "
        f"{result['config']['urgent_deadline_s']:g} s, relaxed {TIER_WAIT_S} s",
        f"{'scenario':12s} {'order':5s} {'kind':8s} {'sent':>5s} {'met':>6s} {'refused':>7s} "
        f"{'expired':>7s} {'late':>5s} {'p50 s':>7s} {'p99 s':>7s}",
    ]
    for scenario, orders in result["scenarios"].items():
        for order, kinds in orders.items():
            for kind, row in kinds.items():
                lines.append(
                    f"{scenario:12s} {order:5s} {kind:8s} {row['sent']:5d} "
                    f"{row['met_deadline']:6.3f} {row['refused']:7d} {row['expired']:7d} "
                    f"{row['late']:5d} {row['first_token_wait_p50_s'] or 0:7.3f} "
                    f"{row['first_token_wait_p99_s'] or 0:7.3f}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.rows:
        _rows_main()
        return 0
    harness.exit_on_sigterm()
    rate = capacity(args)
    result: dict[str, Any] = {"capacity_rps": round(rate, 2), "scenarios": {}}
    for index, name in enumerate(args.scenarios.split(",")):
        share, load = SCENARIOS[name]
        result["scenarios"][name] = {
            order: run_one(args, order == "edf", share, load * rate, args.seed + index)
            for order in ("edf", "fifo")
        }
    result["config"] = {
        "arrival_window_s": args.seconds,
        "urgent_deadline_s": args.urgent_deadline,
        "tier_max_wait_s": TIER_WAIT_S,
        "max_num_seqs": args.max_num_seqs,
        "request": {"prompt_tokens": len(PROMPT) // 4, "max_tokens": MAX_TOKENS},
        "engine": "simulated, 8B on H100 step-time model, time scale 1",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    harness.write_result(args.out, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one request costs the worker itself, on the simulated engine: CPU ms, Redis commands, DB.

    .venv/bin/python -m bench.queue_cost [--prompts 1200 --rounds 3 --chunks 1,8]

bench.throughput's stack side (the same `submit_prompts` job, one `workers.serve` worker with
every scheduling feature at its default, results collected from the Redis result backend), with
the simulated engine in place of vLLM. The simulated engine batches like vLLM but sleeps its
modelled step time (`--time-scale` of an 8B model on one H100), so nearly all of the worker's CPU
is the queue's own: Celery's consumer, the claims and outcomes, the books, the task threads. On
the vLLM CPU build the same figure moves by a fifth from round to round with the OpenMP team's
spinning; here it holds within a few percent, so a regression of a tenth of a millisecond per
request shows as a number. Writes bench/results/queue_cost.json: per chunk size, the medians
over the rounds of the worker's CPU ms per request (every thread), the queue's own (every thread
but the engine's), DB statements and Redis commands per request, and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import harness, throughput
from workers import command, options
from workers.engines import EngineOptions

FIGURES = (*throughput.COST_FIGURES, "requests_per_second")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The worker under test: the simulated engine, every slot and dispatch option at its
    default."""
    engine = EngineOptions(
        kind="simulated",
        model=throughput.MODEL_NAME,
        served_model_name=throughput.MODEL_NAME,
        max_num_seqs=args.max_num_seqs,
        sim_time_scale=args.time_scale,
    )
    slots = options.SlotOptions(pool=throughput.POOL, loglevel="WARNING")
    return command.worker_argv(engine, slots)


def measured_rounds(args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Every round: each chunk size's job through the warm worker, and what it cost."""
    # StackRunner reads these of bench.throughput's arguments; the rest do not apply.
    stack_args = throughput.parse_args(
        [
            *("--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)),
            *("--max-num-seqs", str(args.max_num_seqs)),
        ]
    )
    with harness.children() as started:
        stack = throughput.StackRunner(stack_args, started, worker_argv(args))
        try:
            rounds = []
            for _ in range(args.rounds):
                one = {}
                for size in args.chunks:
                    side = stack.run(size)
                    side["requests_per_second"] = round(args.prompts / side["stack_s"], 1)
                    one[str(size)] = side
                rounds.append(one)
            return rounds
        finally:
            stack.close()


def summary(rounds: list[dict[str, dict[str, Any]]], chunks: list[int]) -> dict[str, Any]:
    """Per chunk size, the median of each figure over the rounds."""
    return {
        str(size): {key: statistics.median(r[str(size)][key] for r in rounds) for key in FIGURES}
        for size in chunks
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--chunks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8],
        help="prompts per task message, one job per size in every round (the first: the goal's)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.3,
        help="the simulated engine's step time × this (0.3: ~2-3 ms steps, as the tiny model's)",
    )
    parser.add_argument("--out", default=str(harness.RESULTS / "queue_cost.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    harness.exit_on_sigterm()
    rounds = measured_rounds(args)
    by_chunk = summary(rounds, args.chunks)
    result = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "time_scale": args.time_scale,
        "chunk_size": args.chunks[0],
        "worker_cpu_ms_per_request": by_chunk[str(args.chunks[0])]["worker_cpu_ms_per_request"],
        "by_chunk_size": by_chunk,
        "rounds": rounds,
        "engine": "simulated (step-time model of an 8B model on one H100)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for size, figures in by_chunk.items():
        print(
            f"{size} prompt(s) per message: worker CPU {figures['worker_cpu_ms_per_request']:.3f} "
            f"ms per request (queue's own {figures['queue_cpu_ms_per_request']:.3f}), DB "
            f"statements {figures['db_statements_per_request']:.2f}, Redis commands "
            f"{figures['redis_commands_per_request']:.2f}, {figures['requests_per_second']} "
            "requests/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

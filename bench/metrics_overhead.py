"""What counting for /metrics and the event logs costs the request path: on vs off, one sitting.

    .venv/bin/python -m bench.metrics_overhead [--repeats 4] [--out PATH]

Runs bench/admission.py (admitted requests/s, closed loop, granian, no engine) and
bench/latency.py (whole-path p50 with a simulated worker) with metrics and event logs on (the
defaults) and off (LLMQUEUE_METRICS=false, LLMQUEUE_EVENT_LOG_LEVEL=WARNING), the two sides
taking turns `--repeats` times each, so the machine's weather moves both alike. ratio = admitted
requests/s on ÷ off (goal ≥ 0.95); p50_added_ms = p50 on − off (goal ≤ 0.3 ms), medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import harness

GOAL_RATIO, GOAL_P50_ADDED_MS = 0.95, 0.3
SIDES = {
    "on": {"LLMQUEUE_METRICS": "true", "LLMQUEUE_EVENT_LOG_LEVEL": "INFO"},
    "off": {"LLMQUEUE_METRICS": "false", "LLMQUEUE_EVENT_LOG_LEVEL": "WARNING"},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_overhead", description=__doc__)
    parser.add_argument("--repeats", type=int, default=4, help="runs per side of each bench")
    parser.add_argument("--admission-duration", type=float, default=5.0, help="s per phase")
    parser.add_argument("--latency-duration", type=float, default=20.0, help="s of load")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "metrics_overhead.json")
    return parser.parse_args(argv)


def run(bench: str, flags: list[str], side: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, **SIDES[side]}
    argv = [sys.executable, "-m", f"bench.{bench}", *flags, "--out", str(out)]
    subprocess.run(argv, env=env, check=True)
    return dict(json.loads(out.read_text()))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    scratch = args.out.parent / "metrics_overhead"
    scratch.mkdir(parents=True, exist_ok=True)
    rps: dict[str, list[float]] = {side: [] for side in SIDES}
    p50: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            flags = ["--duration", str(args.admission_duration)]
            admitted = run("admission", flags, side, scratch / f"admission-{side}.json")
            rps[side].append(float(admitted["admitted_rps"]))
            flags = ["--duration", str(args.latency_duration)]
            latency = run("latency", flags, side, scratch / f"latency-{side}.json")
            p50[side].append(float(latency["p50_ms"]))
    med = {side: (statistics.median(rps[side]), statistics.median(p50[side])) for side in SIDES}
    ratio = med["on"][0] / med["off"][0]
    added = med["on"][1] - med["off"][1]
    return {
        "ratio": round(ratio, 4),
        "p50_added_ms": round(added, 3),
        "admitted_rps": {side: rps[side] for side in SIDES},
        "p50_ms": {side: p50[side] for side in SIDES},
        "repeats": args.repeats,
        "goal": {"ratio": GOAL_RATIO, "p50_added_ms": GOAL_P50_ADDED_MS},
        "goal_met": ratio >= GOAL_RATIO and added <= GOAL_P50_ADDED_MS,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(
        f"metrics and logs on vs off: admitted/s ratio {result['ratio']} (goal ≥ {GOAL_RATIO}), "
        f"p50 +{result['p50_added_ms']} ms (goal ≤ {GOAL_P50_ADDED_MS})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two commits side by side in one sitting: the same benches' quick forms, alternating.

    .venv/bin/python -m bench.compare --before REV [--after HEAD] [--benches throughput,latency]
        [--repeats 2] --title "what changed" --out bench/results/compare.json

A change that must not slow the path (a restructure, a refactor) is judged against the commit
before it measured in the same sitting: the machine's weather moves both alike (the same code
gave ratios 0.75 and 0.89 an hour apart here). Each commit is checked out in its own worktree
under a temporary folder (sharing this checkout's .venv), each bench's quick form (bench/suite.py)
runs `--repeats` times per side, before and after taking turns, and the JSON keeps every run's
figures and their medians. bench/render.py shows it in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.suite import BY_NAME, REPO, Bench, git, machine

SIDES = ("before", "after")


def checkout(rev: str, into: Path) -> str:
    """A detached worktree of `rev` at `into`, with this checkout's .venv; its full hash."""
    subprocess.run(["git", "worktree", "add", "--detach", str(into), rev], cwd=REPO, check=True)
    (into / ".venv").symlink_to(REPO / ".venv")
    return git("rev-parse", rev)


def run_once(bench: Bench, tree: Path, out: Path) -> dict[str, float | None]:
    """One run of `bench`'s quick form in `tree`; its goal figures by name."""
    argv = [str(tree / ".venv" / "bin" / "python"), "-m", f"bench.{bench.name}", *bench.quick]
    subprocess.run([*argv, "--out", str(out)], cwd=tree, check=True)
    data = json.loads(out.read_text())
    return {figure.name: figure.value for figure in bench.figures(data)}


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def compare(benches: list[Bench], trees: dict[str, Path], repeats: int) -> dict[str, Any]:
    """Every bench, `repeats` times per side, the sides taking turns (after first every other
    time, so neither always runs second)."""
    runs: dict[str, dict[str, list[dict[str, float | None]]]] = {}
    for bench in benches:
        per_side: dict[str, list[dict[str, float | None]]] = {side: [] for side in SIDES}
        for repeat in range(repeats):
            for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                out = trees[side] / "bench" / "results" / f"compare-{bench.name}.json"
                per_side[side].append(run_once(bench, trees[side], out))
        runs[bench.name] = per_side
    return runs


def figures_table(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure: its median before and after, and every run's value."""
    rows = []
    for bench, per_side in runs.items():
        for name in per_side["before"][0]:
            values = {side: [run[name] for run in per_side[side]] for side in SIDES}
            rows.append(
                {
                    "bench": bench,
                    "figure": name,
                    **{side: median(values[side]) for side in SIDES},
                    "runs": values,
                }
            )
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("--before", required=True, help="the commit before the change")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--benches", default="throughput,latency,headroom")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side of each bench")
    parser.add_argument("--title", required=True, help="what changed between the two")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compare.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    benches = [BY_NAME[name] for name in args.benches.split(",") if name]
    with tempfile.TemporaryDirectory(prefix="llmqueue-compare-") as tmp:
        trees = {side: Path(tmp) / side for side in SIDES}
        commits = {
            side: checkout(rev, trees[side])
            for side, rev in zip(SIDES, (args.before, args.after), strict=True)
        }
        try:
            runs = compare(benches, trees, args.repeats)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
    result = {
        "title": args.title,
        "commits": commits,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "repeats": args.repeats,
        "command": "python -m bench.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "figures": figures_table(runs),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["figures"]:
        print(
            f"{row['bench']:<11} {row['figure']:<32} before {row['before']}  after {row['after']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

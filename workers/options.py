"""Command-line options shared by `runworkers` and `workers.serve`: declared once, passed on."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from workers.dispatch import DispatchMode
from workers.engines import EngineOptions

# flag → (EngineOptions field, type, help)
_ENGINE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--engine": ("kind", str, "vllm (GPU or CPU build) or simulated"),
    "--model": ("model", str, "model path or name for vLLM; label for the simulated engine"),
    "--served-model-name": (
        "served_model_name",
        str,
        "the model names (ServedModel.name) this worker serves, comma-separated (default: "
        "--model, as vLLM's flag); a request for another model fails 503 model_not_served "
        "and is never generated",
    ),
    "--max-num-seqs": ("max_num_seqs", int, "sequences the engine runs at once"),
    "--dtype": ("dtype", str, "vLLM dtype (auto, bfloat16, float16, float32)"),
    "--max-model-len": ("max_model_len", int, "vLLM max_model_len (default: the model's)"),
    "--gpu-memory-utilization": (
        "gpu_memory_utilization",
        float,
        "share of GPU memory (CPU build: of node memory) vLLM may take",
    ),
    "--seed": ("seed", int, "engine seed"),
    "--engine-cpu-threads": (
        "cpu_threads",
        int,
        "vLLM CPU build: OpenMP threads for the engine (0 = one per core, or cores minus one "
        "with --engine-process); cores minus one leaves a core to the worker's consumer, as "
        "vLLM's own CPU executor does",
    ),
    "--sim-time-scale": (
        "sim_time_scale",
        float,
        "simulated engine: multiply modelled step time (0 = no wait)",
    ),
    "--sim-max-num-batched-tokens": (
        "sim_max_num_batched_tokens",
        int,
        "simulated engine: token budget per step",
    ),
    "--sim-crash-on": (
        "sim_crash_on",
        str,
        "simulated engine, a fault for tests: the worker process is SIGKILLed a second into "
        "generating a request whose prompt holds this text (a poison request)",
    ),
    "--sim-hang-on": (
        "sim_hang_on",
        str,
        "simulated engine, a fault for tests: the engine stops stepping for good once a request "
        "whose prompt holds this text is in it (a hung engine)",
    ),
}


@dataclass(frozen=True)
class SlotOptions:
    pool: str = "default"
    slots: int = 0  # 0 → derived from max_num_seqs (see task_slots)
    loglevel: str = "INFO"
    events: bool = False
    dispatch: str = "ours"  # a workers.dispatch.DispatchMode
    token_budget: int = 0  # 0 → max_num_seqs × LLMQUEUE_TYPICAL_REQUEST_TOKENS
    bulk_reserve: int = 0  # -1 → max_num_seqs with --dispatch ours (see bulk_reserve)
    bulk_joins_per_step: int = 0  # 0 → max_num_seqs / 8, -1 → no limit (see joins_per_step)


def task_slots(requested: int, max_num_seqs: int) -> int:
    """Celery thread slots per engine: max_num_seqs + 1/32 (at least one more) by default, a
    short waiting line beyond the engine's running set. A request delivered but waiting there
    is out of admission's and the deadline sweep's sight (bench/scheduling.py: at 1.5x, 0.894
    of interactive requests on time with 264 slots for 256 sequences vs 0.816 with 288), and
    bench/throughput.py measured no cost against 2 x max_num_seqs (ratio 0.829 vs 0.836 with 8
    prompts per message, 0.765 vs 0.747 with one; medians of 6 interleaved rounds): requests
    now start at delivery and a capped tier's wait parked in the worker, so the engine no
    longer needs its own waiting queue to be fed."""
    if requested > 0:
        return requested
    return max_num_seqs + max(1, -(-max_num_seqs // 32))


def bulk_reserve(requested: int, max_num_seqs: int, dispatch: str) -> int:
    """Task slots beyond `task_slots` that only capped (bulk) tiers may fill: their requests wait
    parked in the worker, outside the engine, and join it the step a sequence frees. Without
    them a backlog of equal-length bulk requests finishes a whole engine at once and the engine
    then runs near-empty while Celery fetches the next engine's worth one message at a time:
    bench/throughput.py counted 715-779 engine steps for 640 of direct work (8 prompts per
    message), 641 with a reserve of max_num_seqs, and the ratio to direct vLLM rose from 0.76 to
    0.90 (8 prompts per message) and from 0.69 to 0.75 (1). The more urgent tiers then keep the
    short line: every tier's requests bound for the engine count against it, parked ones do not
    (`workers.engine_budget.admits`), since Celery's prefetch no longer bounds it. Off by
    default (0) all the same, for pools that also serve an urgent tier: at a bulk wave's end the
    parked requests take the freed sequences before an urgent request is fetched, and that line
    counts a bulk chunk's requests where Celery counted its one message (bench.bulk, interactive
    first-token p99 during a job ÷ idle: 7.4-7.7 with that line, 2.4 without it). -1 asks for
    one engine's worth (max_num_seqs): for bulk-only pools. With --dispatch fifo or strict it is
    always 0: they have no parking, so a reserve would be a longer engine queue."""
    if dispatch != "ours":
        return 0
    return max_num_seqs if requested < 0 else requested


# A capped tier fills an empty engine over this many steps (see joins_per_step).
JOIN_SPREAD_STEPS = 8


def joins_per_step(requested: int, max_num_seqs: int) -> int:
    """How many of a capped (bulk) tier's requests may join the engine in one step; 0 for no
    limit. Without one, a backlog of equal-length bulk requests (a Batch API job: every line
    128 tokens) joins an empty engine in one step and so finishes in one step, wave after wave:
    each wave's end is a step in which 54-64 requests are recorded and claimed under the GIL and
    a step that prefills as many, 20-46 ms each against 3.6 ms typical, and every interactive
    request that waited more than 40 ms during a job waited through exactly those two. Spread
    over JOIN_SPREAD_STEPS steps, the wave becomes that many cohorts of max_num_seqs / 8, each
    refilled by its own few fetches as it ends (bench.bulk --phases vllm, 64 sequences, the
    1,000-line job; runs alternating with `-1`): engine steps 2214-2268 in 6 runs vs 2296-2362
    in 3 (direct LLM.generate: 2048), interactive first-token p99 during the job / idle median
    2.57 of 8 runs (1.18-3.97) vs 3.66 of 4 (1.91-4.61); bench.throughput (3 rounds) 660 steps
    vs 693 with 8 prompts per message, 662 vs 658 with one (direct: 640). The wall-clock ratio
    moved with the machine on both sides (0.59-0.88). -1 lifts the limit."""
    if requested < 0:
        return 0
    if requested > 0:
        return requested
    return max(1, max_num_seqs // JOIN_SPREAD_STEPS)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineOptions()
    for flag, (name, kind, text) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, dest=name, type=kind, default=getattr(defaults, name), help=text)
    parser.add_argument(
        "--in-process",
        dest="in_process",
        action="store_true",
        help="run vLLM's engine core inside the worker (the CPU build; GPUs keep the default "
        "multiprocess core)",
    )

    parser.add_argument(
        "--engine-process",
        dest="engine_process",
        action="store_true",
        help="step the engine in a process of its own, fed over a pipe (the CPU build: keeps the "
        "worker's Python off the engine's GIL; workers/engine_process.py)",
    )
    parser.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        help="skip vLLM's torch.compile/graph capture: starts in seconds (the CPU build "
        "recompiles on every start otherwise)",
    )


def add_slot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", default="default", help="worker pool (ServedModel.pool)")
    parser.add_argument(
        "--slots", type=int, default=0, help="Celery task slots (default max-num-seqs + 1/32)"
    )
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument(
        "--events", action="store_true", help="send task events (Flower's task view)"
    )
    parser.add_argument(
        "--dispatch",
        choices=[m.value for m in DispatchMode],
        default=DispatchMode.OURS.value,
        help="order over tier queues: fifo (one order), strict (most urgent tier first) or ours "
        "(weighted by tier, engine headroom and token budget, deadline sweep); see "
        "workers/dispatch.py",
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        default=0,
        help="estimated tokens (prompt + max_tokens) the worker holds at once "
        "(default max-num-seqs × LLMQUEUE_TYPICAL_REQUEST_TOKENS)",
    )
    parser.add_argument(
        "--bulk-reserve",
        type=int,
        default=0,
        help="task slots beyond --slots that only capped (bulk) tiers fill, parked in the worker "
        "until the engine has room (default 0; -1: max-num-seqs, for bulk-only pools; "
        "--dispatch ours only)",
    )
    parser.add_argument(
        "--bulk-joins-per-step",
        type=int,
        default=0,
        help="how many of a capped (bulk) tier's requests may join the engine in one step "
        "(default 0: max-num-seqs / 8; -1: no limit; --dispatch ours only)",
    )


def slot_argv(slots: SlotOptions) -> list[str]:
    """Flags that make `workers.serve` use the same slots and dispatch policy."""
    argv = ["--pool", slots.pool, "--slots", str(slots.slots), "--loglevel", slots.loglevel]
    argv += ["--dispatch", slots.dispatch, "--token-budget", str(slots.token_budget)]
    argv += ["--bulk-reserve", str(slots.bulk_reserve)]
    argv += ["--bulk-joins-per-step", str(slots.bulk_joins_per_step)]
    return argv + (["--events"] if slots.events else [])


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(**{f.name: getattr(args, f.name) for f in fields(EngineOptions)})


def slot_options(args: argparse.Namespace) -> SlotOptions:
    return SlotOptions(**{f.name: getattr(args, f.name) for f in fields(SlotOptions)})


def engine_argv(options: EngineOptions) -> list[str]:
    """Flags that make `workers.serve` build the same engine."""
    argv = []
    for flag, (name, _, _) in _ENGINE_FLAGS.items():
        value = getattr(options, name)
        if value is not None:
            argv += [flag, str(value)]
    if options.in_process:
        argv.append("--in-process")
    if options.engine_process:
        argv.append("--engine-process")
    if options.enforce_eager:
        argv.append("--enforce-eager")
    return argv

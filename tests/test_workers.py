"""The GPU pool's process plan and the worker bootstrap's refusal to run without an engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from workers.command import worker_argv
from workers.engines import EngineOptions
from workers.options import SlotOptions, engine_options, slot_options, task_slots
from workers.pool import worker_processes
from workers.serve import ENGINE_LOAD_FAILED, parse_args


def test_one_pinned_process_per_gpu_with_the_pool_queues_and_engine_flags():
    engine = EngineOptions(kind="vllm", model="/models/llama-8b", max_num_seqs=48, dtype="bfloat16")
    slots = SlotOptions(pool="chat", slots=0, dispatch="strict", token_budget=5000)
    plan = worker_processes(["0", "3"], 1, ["chat.interactive", "chat.batch"], engine, slots)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan] == ["0", "3"]
    assert [p.node.split("@")[0] for p in plan] == ["chat-gpu0", "chat-gpu3"]
    argv = plan[1].argv
    assert argv[1:3] == ["-m", "workers.serve"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model"] == "/models/llama-8b"
    assert flags["--max-num-seqs"] == "48"
    assert flags["--dtype"] == "bfloat16"
    assert flags["--queues"] == "chat.interactive,chat.batch"
    assert (flags["--dispatch"], flags["--token-budget"]) == ("strict", "5000")
    assert "--in-process" not in argv  # GPUs keep vLLM's multiprocess engine core


def test_cpu_workers_are_unpinned():
    plan = worker_processes([], 2, ["q"], EngineOptions(kind="simulated"), SlotOptions())
    assert [p.node.split("@")[0] for p in plan] == ["default-cpu0", "default-cpu1"]
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert all(p.env.get("CUDA_VISIBLE_DEVICES") == inherited for p in plan)


def test_the_worker_command_line_round_trips_through_the_workers_parser():
    engine = EngineOptions(
        kind="vllm", model="/m", served_model_name="m,m-chat", max_num_seqs=8, dtype="float32",
        max_model_len=2048, gpu_memory_utilization=0.5, in_process=True, engine_process=True,
        enforce_eager=True, seed=7,
        sim_time_scale=0.25, sim_max_num_batched_tokens=1024, cpu_threads=3,
    )  # fmt: skip
    slots = SlotOptions(
        pool="chat", slots=9, loglevel="WARNING", events=True, dispatch="fifo", token_budget=77
    )
    argv = worker_argv(engine, slots, ["chat.interactive", "chat.batch"], "chat-gpu0@h")
    assert argv[:3] == [sys.executable, "-m", "workers.serve"]
    args = parse_args(argv[3:])
    assert (engine_options(args), slot_options(args)) == (engine, slots)
    assert (args.queues, args.node_name) == ("chat.interactive,chat.batch", "chat-gpu0@h")


def test_options_left_out_of_the_worker_command_line_are_the_workers_defaults():
    argv = worker_argv(extra=["--slots", "3"])
    args = parse_args(argv[3:])
    assert (engine_options(args), slot_options(args)) == (EngineOptions(), SlotOptions(slots=3))
    assert (args.queues, args.node_name) == ("", "")


def test_task_slots_default_to_a_short_line_beyond_the_engine_batch():
    assert task_slots(0, 64) == 66
    assert task_slots(0, 256) == 264
    assert task_slots(0, 16) == 17  # at least one more
    assert task_slots(96, 64) == 96


@pytest.mark.vllm
def test_worker_that_cannot_load_its_engine_exits_with_a_reason(tmp_path):
    argv = [sys.executable, "-m", "workers.serve", "--engine", "vllm", "--in-process"]
    argv += ["--model", str(tmp_path / "missing-model"), "--queues", "never.consumed"]
    done = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "tests.settings", "HOME": "/root"},
    )
    assert done.returncode == ENGINE_LOAD_FAILED
    assert "cannot load the vllm engine for model" in done.stderr
    assert "Not consuming any queue." in done.stderr
    assert "ready" not in done.stdout


def test_runworkers_hands_every_argument_to_the_worker_pool():
    argv = [sys.executable, "manage.py", "runworkers"]
    shown = subprocess.run([*argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    for flag in ("--gpus", "--cpu-workers", "--model", "--pool", "--dispatch"):
        assert flag in shown.stdout
    refused = subprocess.run(
        [*argv, "--engine", "vllm"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "--model is required for the vllm engine" in refused.stderr

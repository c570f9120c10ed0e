"""The simulated GPU engine: the step-time model and vLLM-like continuous batching."""

from __future__ import annotations

import pytest

from workers.engine import GenerationRequest, GenerationResult
from workers.simulated_engine import SimulatedConfig, SimulatedEngine, StepTimeModel


def test_step_time_model_follows_the_documented_fit():
    model = StepTimeModel()
    # Decode of 64 sequences is memory-bound: the 6.4 ms floor, plus 1 ms, plus context reads.
    assert model.step_seconds(64, 64_000) == pytest.approx(1e-3 + 6.4e-3 + 0.056e-6 * 64_000)
    # A 2048-token prefill is compute-bound: 23.3 µs per token.
    assert model.step_seconds(2048, 2048) == pytest.approx(1e-3 + 23.3e-6 * 2048 + 0.056e-6 * 2048)
    assert StepTimeModel(time_scale=0).step_seconds(2048, 2048) == 0


def test_requests_share_steps_instead_of_running_one_by_one():
    engine = SimulatedEngine(SimulatedConfig(max_num_seqs=8, step_time=StepTimeModel(time_scale=0)))
    try:
        futures = [
            engine.submit(GenerationRequest(f"r{i}", prompt="abcd" * 4, max_tokens=10))
            for i in range(8)
        ]
        results = [f.result(timeout=10) for f in futures]
    finally:
        engine.close()
    assert [r.completion_tokens for r in results] == [10] * 8
    assert {r.prompt_tokens for r in results} == {4}
    # Submitted together, they finish together: far fewer than 8 × 10 steps.
    assert engine.steps <= 12
    assert all(r.first_token_step <= 2 for r in results)


def test_max_num_seqs_caps_the_batch_and_priority_orders_the_waiting_queue():
    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=2, step_time=StepTimeModel(time_scale=0)), start=False
    )
    for name, priority in (("bulk1", 6), ("bulk2", 6), ("bulk3", 6), ("urgent", 0)):
        engine._add(GenerationRequest(name, prompt="abcd", max_tokens=3, priority=priority))
    finished: dict[str, int] = {}
    step = 0
    while engine._has_work():
        step += 1
        engine.steps = step - 1
        finished.update({r.request_id: r.finished_step for r in engine._step()})
    # Two run at once; the urgent one, added last, runs first with the earliest bulk one.
    assert finished == {"urgent": 3, "bulk1": 3, "bulk2": 6, "bulk3": 6}


def test_long_prefill_is_chunked_by_the_token_budget():
    engine = SimulatedEngine(
        SimulatedConfig(max_num_batched_tokens=100, step_time=StepTimeModel(time_scale=0)),
        start=False,
    )
    engine._add(GenerationRequest("long", prompt="x" * 1000, max_tokens=1))  # 250 tokens
    results = []
    while engine._has_work():
        results += engine._step()
        engine.steps += 1
    assert [(r.first_token_step, r.finished_step) for r in results] == [(3, 3)]


def test_results_say_when_their_first_token_came():
    import time

    engine = SimulatedEngine(SimulatedConfig(max_num_seqs=2, step_time=StepTimeModel(time_scale=0)))
    try:
        before = time.time()
        result = engine.submit(GenerationRequest("r", prompt="abcd", max_tokens=5)).result(10)
    finally:
        engine.close()
    assert result.first_token_at is not None
    assert before <= result.first_token_at <= time.time()
    assert result.finished_step - result.first_token_step == 4


def test_the_step_log_has_every_step_and_its_end_time_only_when_asked(tmp_path):
    quiet = SimulatedEngine(SimulatedConfig(max_num_seqs=2, step_time=StepTimeModel(time_scale=0)))
    logged = SimulatedEngine(SimulatedConfig(max_num_seqs=2, step_time=StepTimeModel(time_scale=0)))
    path = tmp_path / "steps.log"
    logged.log_steps(str(path))
    try:
        for engine in (quiet, logged):
            engine.submit(GenerationRequest("r", prompt="abcd", max_tokens=5)).result(10)
        result = logged.submit(GenerationRequest("s", prompt="abcd", max_tokens=3)).result(10)
    finally:
        quiet.close()
        logged.close()
    assert quiet._step_log is None
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [int(line[0]) for line in lines] == list(range(1, logged.steps + 1))
    times = [float(t) for _, started, ended, *_ in lines for t in (started, ended)]
    assert times == sorted(times)  # each step starts after the previous one ended
    ends = times[1::2]
    # A result's first_token_at is the logged end of its first token's step.
    assert result.first_token_at == pytest.approx(ends[result.first_token_step - 1], abs=1e-6)
    # Then each step's requests: running, joined just before it, finished in it (r, then s),
    # the loop thread's CPU ms in the step, and the requests parked outside the engine.
    counts = [tuple(int(n) for n in line[3:6]) for line in lines]
    r_steps = [(1, 1, 0), (1, 0, 0), (1, 0, 0), (1, 0, 0), (1, 0, 1)]  # 5 tokens
    assert counts == [*r_steps, (1, 1, 0), (1, 0, 0), (1, 0, 1)]  # s: 3 tokens
    assert all(float(line[6]) >= 0 for line in lines)
    assert [int(line[7]) for line in lines] == [0] * len(lines)


def test_an_urgent_arrival_waits_for_prefill_under_way_not_for_every_queued_request():
    # vLLM V1: a waiting request joins the batch only while the step's token budget has room,
    # in priority order, so urgent work overtakes less urgent work that has not started yet.
    engine = SimulatedEngine(
        SimulatedConfig(max_num_batched_tokens=100, step_time=StepTimeModel(time_scale=0)),
        start=False,
    )
    for name in ("bulk1", "bulk2", "bulk3"):  # 250 prompt tokens each: 2.5 steps of prefill
        engine._add(GenerationRequest(name, prompt="x" * 1000, max_tokens=1, priority=6))
    finished: dict[str, int] = {}

    def step() -> None:
        finished.update({r.request_id: r.finished_step for r in engine._step()})
        engine.steps += 1

    step()  # bulk1 takes the whole budget; bulk2 and bulk3 stay waiting
    engine._add(GenerationRequest("urgent", prompt="abcd", max_tokens=1, priority=0))
    while engine._has_work():
        step()
    # Step 3 finishes bulk1's prefill with 50 tokens; urgent joins next, ahead of bulk2.
    assert finished == {"bulk1": 3, "urgent": 3, "bulk2": 6, "bulk3": 8}


def test_an_aborted_request_fails_its_future_and_leaves_the_batch():
    from workers.batching import RequestAborted

    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=4, step_time=StepTimeModel(time_scale=0.01))
    )  # ~0.1 ms steps: the long request is still running when the abort arrives
    try:
        long = engine.submit(GenerationRequest("long", prompt="abcd", max_tokens=100_000))
        short = engine.submit(GenerationRequest("short", prompt="abcd", max_tokens=3))
        assert short.result(timeout=10).completion_tokens == 3
        engine.abort("long")
        engine.abort("never-submitted")  # nothing to drop: ignored
        with pytest.raises(RequestAborted):
            long.result(timeout=10)
        after = engine.submit(GenerationRequest("after", prompt="abcd", max_tokens=2))
        assert after.result(timeout=10).completion_tokens == 2
        assert engine.stats()["in_engine"] == 0 and not engine._running and not engine._waiting
    finally:
        engine.close()


def test_a_cancelled_request_is_aborted_in_every_delivery_the_engine_holds_and_no_other():
    from workers.batching import RequestAborted

    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=4, step_time=StepTimeModel(time_scale=0.01))
    )
    try:
        # Two deliveries of r1 (a redelivered duplicate may run beside the first), one of r10.
        first, again, other = (
            engine.submit(GenerationRequest(i, prompt="abcd", max_tokens=100_000))
            for i in ("r1:aaa", "r1:bbb", "r10:ccc")
        )
        engine.abort_request("r1")
        for future in (first, again):
            with pytest.raises(RequestAborted):
                future.result(timeout=10)
        assert not other.done()  # "r10:" does not start with "r1:"
        engine.abort_request("r10")
        with pytest.raises(RequestAborted):
            other.result(timeout=10)
        assert engine.stats()["in_engine"] == 0
    finally:
        engine.close()


def note_joins(engine: SimulatedEngine) -> dict[str, int]:
    """Each request's id and the engine step it joined at, filled as requests join."""
    joined: dict[str, int] = {}
    add = engine._add

    def add_and_note(request: GenerationRequest) -> None:
        joined[request.request_id] = engine.steps
        add(request)

    engine._add = add_and_note  # type: ignore[method-assign]
    return joined


def step_until_idle(engine: SimulatedEngine) -> None:
    """Run the engine loop's turns on this thread until nothing is in or parked outside it."""
    while engine._has_work() or engine._parked:
        engine._start_parked()
        engine._joined.clear()  # as the loop does before each step
        for result in engine._step():
            future = engine._forget(result.request_id)
            assert future is not None
            future.set_result(result)
        engine.steps += 1


def test_admission_parks_a_refused_request_until_the_engine_has_room_for_it():
    from concurrent.futures import Future

    from workers.batching import RequestAborted

    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=4, step_time=StepTimeModel(time_scale=0)), start=False
    )
    # Batch may hold 3 of the 4 sequences; interactive always joins.
    engine.admission = lambda request, in_engine, *_: request.lane != "batch" or in_engine < 3
    joined = note_joins(engine)
    futures: dict[str, Future] = {}

    def arrive(name: str, lane: str, priority: int) -> None:
        futures[name] = Future()
        request = GenerationRequest(name, prompt="abcd", max_tokens=2, priority=priority, lane=lane)
        engine._arrive(request, futures[name])

    for name in ("b1", "b2", "b3", "b4", "b5"):
        arrive(name, "batch", 6)
    arrive("i1", "interactive", 0)
    assert engine.stats()["in_engine"] == 4 and engine.stats()["parked"] == 2
    engine._drop("b5")  # aborted while parked: it never reaches the engine
    with pytest.raises(RequestAborted):
        futures["b5"].result(0)
    step_until_idle(engine)
    assert joined == {"b1": 0, "b2": 0, "b3": 0, "i1": 0, "b4": 2}  # b4 once the first ended
    assert all(futures[n].result(0).completion_tokens == 2 for n in ("b1", "b2", "b3", "b4", "i1"))
    assert engine.stats()["parked"] == 0 and engine.stats()["in_engine"] == 0


def test_the_engine_counts_each_lanes_joins_since_the_last_step_for_its_admission():
    from concurrent.futures import Future

    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=8, step_time=StepTimeModel(time_scale=0)), start=False
    )
    # Batch: at most 2 joins per step; interactive: no limit.
    engine.admission = lambda request, _in, _lane, joined: request.lane != "batch" or joined < 2
    joined = note_joins(engine)
    futures: list[Future] = []
    for name, lane in [*((f"b{i}", "batch") for i in range(5)), ("i1", "interactive")]:
        futures.append(Future())
        request = GenerationRequest(name, prompt="abcd", max_tokens=4, priority=6, lane=lane)
        engine._arrive(request, futures[-1])
    assert engine.stats()["in_engine"] == 3 and engine.stats()["parked"] == 3
    step_until_idle(engine)
    # Two batch joins a step, in arrival order; interactive's join is not counted against it.
    assert joined == {"b0": 0, "b1": 0, "i1": 0, "b2": 1, "b3": 1, "b4": 2}
    assert all(f.result(0).completion_tokens == 4 for f in futures)


def test_a_parked_request_joins_when_those_that_joined_this_step_left_before_it_ran():
    from concurrent.futures import Future

    from workers.batching import RequestAborted

    engine = SimulatedEngine(
        SimulatedConfig(max_num_seqs=8, step_time=StepTimeModel(time_scale=0)), start=False
    )
    engine.admission = lambda _request, _in, _lane, joined: joined < 1
    futures: dict[str, Future[GenerationResult]] = {n: Future() for n in ("b0", "b1")}
    for name, future in futures.items():
        engine._arrive(GenerationRequest(name, prompt="abcd", max_tokens=2, lane="batch"), future)
    assert engine.stats()["in_engine"] == 1 and engine.stats()["parked"] == 1
    engine._drop("b0")  # its claim was lost: no step ran, so no step resets the count
    with pytest.raises(RequestAborted):
        futures["b0"].result(0)
    engine._start_parked()  # the loop's next turn: b1 joins instead of waiting for ever
    assert engine.stats()["in_engine"] == 1 and engine.stats()["parked"] == 0

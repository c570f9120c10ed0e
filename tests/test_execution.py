"""One request's chain on a worker: the engine starts while the claim is recorded, and gives the
request back when the claim loses; a request past its deadline never reaches the engine."""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from typing import Any, cast

import pytest

from contract.task import TaskPayload
from llmqueue import lifecycle
from tests.conftest import wait_until
from workers.engine_budget import NO_HOLD
from workers.execution import start_prompt
from workers.recorder import Recorded, Recorder
from workers.served_models import ServedModels, served_model_names
from workers.simulated_engine import SimulatedConfig, SimulatedEngine, StepTimeModel

SERVED = ServedModels({"sim"}, "p", "w")  # the model the payloads below ask for


class HeldClaims:
    """A recorder whose claims the test settles by hand; finishes are recorded as won."""

    def __init__(self) -> None:
        self.claims: list[Future[lifecycle.Claim]] = []
        self.finished: list[lifecycle.Finish] = []

    def claim(self, request_id: uuid.UUID, worker: str) -> Future[lifecycle.Claim]:
        self.claims.append(Future())
        return self.claims[-1]

    def finish(self, outcome: lifecycle.Finish) -> Future[Recorded]:
        self.finished.append(outcome)
        done: Future[Recorded] = Future()
        done.set_result(Recorded(won=True, published=True))
        return done


def payload(request_id: uuid.UUID, max_tokens: int, deadline_in: float) -> TaskPayload:
    return {
        "request_id": str(request_id), "kind": "completion", "model": "sim", "prompt": "abcd",
        "messages": None, "params": {"max_tokens": max_tokens}, "priority": 0,
        "deadline_ts": time.time() + deadline_in,
    }  # fmt: skip


@pytest.fixture
def engine() -> Any:
    engine = SimulatedEngine(SimulatedConfig(step_time=StepTimeModel(time_scale=0.05)))
    yield engine
    engine.close()


def test_the_engine_starts_while_the_claim_is_recorded(engine: SimulatedEngine):
    recorder, rid = HeldClaims(), uuid.uuid4()
    done = start_prompt(payload(rid, 5, 30), "w", cast(Recorder, recorder), engine, SERVED)
    wait_until(lambda: engine.steps >= 2, 10, "steps")  # generating before anyone knows it may
    recorder.claims[0].set_result(lifecycle.Claim(rid, attempt=1))
    claim, outcome, recorded = done.result(timeout=10)
    assert (claim.attempt, recorded) == (1, Recorded(won=True, published=True))
    assert outcome is not None and outcome.succeeded and outcome.completion_tokens == 5
    assert [f.attempt for f in recorder.finished] == [1]


def test_a_lost_claim_takes_the_generation_back_and_records_nothing(engine: SimulatedEngine):
    recorder, rid = HeldClaims(), uuid.uuid4()
    done = start_prompt(payload(rid, 100_000, 30), "w", cast(Recorder, recorder), engine, SERVED)
    wait_until(lambda: engine.steps >= 2, 10, "steps")
    recorder.claims[0].set_result(lifecycle.Claim(rid, attempt=None))  # another attempt has it
    assert done.result(timeout=10) == (lifecycle.Claim(rid, attempt=None), None, None)
    wait_until(lambda: engine.stats()["in_engine"] == 0, 10, "the abort")
    assert recorder.finished == [] and engine.finished == 0


def test_a_request_past_its_deadline_is_only_claimed_never_generated(engine: SimulatedEngine):
    recorder, rid = HeldClaims(), uuid.uuid4()
    done = start_prompt(payload(rid, 5, -1), "w", cast(Recorder, recorder), engine, SERVED)
    time.sleep(0.05)
    assert engine.submitted == 0
    recorder.claims[0].set_result(lifecycle.Claim(rid, attempt=None, expired=True))
    claim, outcome, _ = done.result(timeout=10)
    assert claim.expired and outcome is None
    assert engine.submitted == 0 and recorder.finished == []


def test_a_request_started_at_delivery_runs_its_chain_before_any_task(engine: SimulatedEngine):
    from functools import partial

    from workers.engine_budget import EngineBudget, EngineLimits
    from workers.execution import start_delivered
    from workers.prestart import PreStarts

    recorder = HeldClaims()
    budget = EngineBudget(EngineLimits(8, 8, 10_000))
    prestarts = PreStarts(partial(start_delivered, "w", cast(Recorder, recorder), engine, SERVED))
    kept, dropped, late = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for rid, max_tokens, deadline_in in ((kept, 5, 30), (dropped, 5, 30), (late, 5, -1)):
        hold = budget.hold("p.batch", str(rid), 10, pending=False)
        prestarts.start(payload(rid, max_tokens, deadline_in), "p.batch", hold)
    assert len(prestarts) == 3 and budget.requests == 3
    assert budget.take([str(kept)]) == [NO_HOLD]  # the chain holds it, not the task
    wait_until(lambda: engine.steps >= 2, 10, "steps")  # generating before any task ran
    assert len(recorder.claims) == 3 and engine.submitted == 2  # the late one: claimed only
    for pending, rid in zip(recorder.claims, (kept, dropped, late), strict=True):
        pending.set_result(
            lifecycle.Claim(rid, attempt=1 if rid != late else None, expired=rid == late)
        )
    chain = prestarts.take(str(kept))
    assert chain is not None and prestarts.take(str(kept)) is None  # taken once
    claim, outcome, recorded = chain.result(timeout=10)
    assert (claim.attempt, recorded) == (1, Recorded(won=True, published=True))
    assert outcome is not None and outcome.completion_tokens == 5
    # A message Celery dropped: its chain is forgotten, not aborted, and ends by itself.
    unknown = str(uuid.uuid4())
    assert prestarts.drop([str(dropped), unknown]) == [unknown]  # the ids that had no chain
    wait_until(lambda: len(recorder.finished) == 2, 10, "the dropped message's chain")
    assert sorted(f.request_id for f in recorder.finished) == sorted([kept, dropped])
    assert prestarts.take(str(late)) is not None and len(prestarts) == 0
    wait_until(lambda: budget.requests == 0, 10, "every chain's hold released")


def test_a_request_for_a_model_the_worker_does_not_serve_is_claimed_failed_never_generated(
    engine: SimulatedEngine, caplog: pytest.LogCaptureFixture
):
    served = ServedModels({"other"}, "p", "p@host")
    recorder = HeldClaims()
    rids = [uuid.uuid4(), uuid.uuid4()]
    with caplog.at_level(logging.WARNING, logger="workers.served_models"):
        chains = [
            start_prompt(payload(rid, 5, 30), "w", cast(Recorder, recorder), engine, served)
            for rid in rids
        ]
    assert engine.submitted == 0  # refused before the engine, while the claim is recorded
    for pending, rid in zip(recorder.claims, rids, strict=True):
        pending.set_result(lifecycle.Claim(rid, attempt=1))
    reason = (
        "pool 'p' worker p@host serves model 'other', not 'sim': check ServedModel routing / "
        "the worker's --model (--served-model-name)"
    )
    for chain, rid in zip(chains, rids, strict=True):
        claim, outcome, recorded = chain.result(timeout=10)
        assert (claim.attempt, recorded) == (1, Recorded(won=True, published=True))
        assert outcome == lifecycle.Finish(
            rid, 1, succeeded=False, error=reason, error_code="model_not_served"
        )
    assert engine.submitted == 0 and engine.steps == 0
    # Misrouting sends every request of the model here: one warning says so, not one each.
    assert [r.getMessage() for r in caplog.records] == [
        f"refusing requests for a model this worker does not serve: {reason}"
    ]


def test_a_worker_serves_its_served_model_names_or_else_its_model():
    assert served_model_names("", "/models/llama-8b") == {"/models/llama-8b"}
    assert served_model_names("llama-8b, llama ,", "/models/llama-8b") == {"llama-8b", "llama"}
    served = ServedModels(served_model_names("a,b", "/m"), "p", "w")
    assert served.refusal("a") is None and served.refusal("b") is None
    assert served.refusal("/m") == (
        "pool 'p' worker w serves models 'a', 'b', not '/m': check ServedModel routing / "
        "the worker's --model (--served-model-name)"
    )

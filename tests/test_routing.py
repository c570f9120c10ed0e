"""Routing integrity: a worker serves only the model it loaded. Two pools with two models live at
once each answer their own requests; a request routed to a worker of another model fails 503
`model_not_served` without reaching its engine, and the worker serves on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from contract import liveness
from devtools.tiny_model import build_tiny_model
from llmqueue.admission import books
from llmqueue.defaults import ensure_served_model
from llmqueue.models import PromptRequest, Tenant
from tests.conftest import (
    SIMULATED,
    TINY_MODEL_DIR,
    Seeded,
    Worker,
    WorkerFactory,
    queued_messages,
    vllm_args,
    wait_until,
)
from tests.test_api import post

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def complete(
    server: Any, key: str, model: str, max_tokens: int = 4, prompt: str = "hi"
) -> httpx.Response:
    """A blocking completion; "hi" with 4 tokens reserves 5 of the tenant's minute."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return post(server, "/v1/completions", key, {**body, "ignore_eos": True})


def limit_tokens_per_minute(tokens: int) -> None:
    tenant = Tenant.objects.get(name="acme")
    tenant.tokens_per_minute = tokens
    tenant.save()  # a save, as the admin does: the running server sees the new limit


def engine_submitted(client: redis.Redis, worker: Worker, since: float) -> int:
    """Requests `worker`'s engine was ever handed, from its first beat after `since`."""
    stats: dict[str, Any] = {}

    def beat_after() -> bool:
        stats.update(liveness.worker_stats(client, worker.pool).get(worker.node, {}))
        return float(stats.get("at", 0)) > since

    wait_until(beat_after, 10, f"a beat of {worker.node}")
    return int(stats["engine"]["submitted"])


def misrouted(worker: Worker, served: str, asked: str) -> str:
    """The refusal the worker records, as its caller reads it."""
    return (
        f"pool {worker.pool!r} worker {worker.node} serves model {served!r}, not {asked!r}: "
        "check ServedModel routing / the worker's --model (--served-model-name)"
    )


def test_a_misrouted_request_fails_503_generates_nothing_refunds_and_the_worker_serves_on(
    live_server,
    seeded: Seeded,
    start_worker: WorkerFactory,
    clean_redis: redis.Redis,
    tmp_path: Path,
):
    # A second served model mapped by mistake to pool "default", whose worker loaded "sim".
    ensure_served_model("sim-large", "default", context_length=2048, max_tokens=512)
    limit_tokens_per_minute(6)  # one token every 10 s: a refund is the only way back
    log = tmp_path / "worker.log"
    worker = start_worker("default", *SIMULATED, "--sim-time-scale", "0", log_path=log)

    refused = complete(live_server, seeded.key, "sim-large")  # holds 5 of the 6 tokens
    assert refused.status_code == 503, refused.text
    reason = misrouted(worker, "sim", "sim-large")
    assert refused.json() == {
        "error": {
            "message": reason,
            "type": "server_error",
            "param": None,
            "code": "model_not_served",
        }
    }
    assert "Retry-After" not in refused.headers  # only fixing the routing makes it succeed
    row = PromptRequest.objects.get(pk=refused.headers["X-LLMQueue-Request-Id"])
    assert (row.status, row.attempts, row.worker, row.error) == (S.FAILED, 1, worker.node, reason)
    assert (row.output_text, row.completion_tokens, row.first_token_at) == ("", None, None)
    assert engine_submitted(clean_redis, worker, time.time()) == 0  # never generated
    waiting = clean_redis.get(books.waiting_key("default.interactive", seeded.tenant_id))
    assert int(waiting or 0) == 0

    # Its 5 tokens came back (the minute refills one every 10 s): the same size fits at once,
    # and the same worker answers a request for its own model.
    served = complete(live_server, seeded.key, "sim")
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == " lorem ipsum dolor sit"
    row = PromptRequest.objects.get(pk=served.headers["X-LLMQueue-Request-Id"])
    assert (row.status, row.attempts, row.worker) == (S.SUCCEEDED, 1, worker.node)
    assert engine_submitted(clean_redis, worker, time.time()) == 1

    again = complete(live_server, seeded.other_key, "sim-large")  # another tenant, tier
    assert (again.status_code, again.json()["error"]["message"]) == (503, reason)
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "every message acked")
    worker.stop()
    # The operator is told once per model, not once per request (nor by a task ERROR each).
    lines = log.read_text().splitlines()
    warnings = [line for line in lines if "does not serve" in line]
    assert warnings == [f"refusing requests for a model this worker does not serve: {reason}"]
    assert [line for line in lines if "raised unexpected" in line] == []


@pytest.mark.vllm
def test_two_pools_with_two_models_live_at_once_each_answer_their_own_requests(
    live_server,
    seeded: Seeded,
    start_worker: WorkerFactory,
    clean_redis: redis.Redis,
    tiny_model: Path,
):
    """Two real vLLM CPU engines, one per pool, each with its own tiny model: the same
    architecture and tokenizer, different random weights (seed 0 and 1), so at temperature 0
    the same prompt gets a different text from each, and the text names the engine that
    answered; the simulated engine would prove only which worker claimed a row, not which model
    generated it. Both engines load at once, so the test costs about one single-engine vLLM
    test (~60 s on 2 busy cores, test_openai_sdk ~45 s). The mismatch check runs here with the
    real vLLM adapter too: a third served model routed to the first pool."""
    other_model = build_tiny_model(TINY_MODEL_DIR.parent / "tiny-llama-b", seed=1)
    ensure_served_model("tiny-llama-b", "tiny-b", context_length=2048, max_tokens=512)
    ensure_served_model("tiny-llama-c", "tiny", context_length=2048, max_tokens=512)
    # One engine thread each: two engines on two cores, each core to one OpenMP team.
    one_thread = ("--engine-cpu-threads", "1")
    specs = [
        ("tiny", (*vllm_args(tiny_model, 4), *one_thread)),
        ("tiny-b", (*vllm_args(other_model, 4, served="tiny-llama-b"), *one_thread)),
    ]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda s: start_worker(s[0], *s[1], timeout=300), specs)

    def ask(model: str) -> httpx.Response:
        return complete(live_server, seeded.key, model, 8, "the quick brown fox")

    # Each model's own text for the prompt, alone in its engine.
    own = {
        model: ask(model).json()["choices"][0]["text"] for model in ("tiny-llama", "tiny-llama-b")
    }
    assert own["tiny-llama"] != own["tiny-llama-b"], own

    # Interleaved, both pools in flight at once; one request per engine at a time, so each
    # runs alone in its batch as its reference did (on CPU a batch's make-up can move float32
    # rounding, and a random tiny model's near ties with it).
    models = ["tiny-llama", "tiny-llama-b"] * 4
    with ThreadPoolExecutor(2) as pool:
        answers = [a for i in range(0, len(models), 2) for a in pool.map(ask, models[i : i + 2])]
    assert [a.status_code for a in answers] == [200] * len(models), [a.text for a in answers]
    nodes = {"tiny-llama": first.node, "tiny-llama-b": second.node}
    for model, answer in zip(models, answers, strict=True):
        assert answer.json()["choices"][0]["text"] == own[model]
        row = PromptRequest.objects.get(pk=answer.headers["X-LLMQueue-Request-Id"])
        assert (row.model, row.worker, row.status) == (model, nodes[model], S.SUCCEEDED)

    assert [engine_submitted(clean_redis, w, time.time()) for w in (first, second)] == [5, 5]
    refused = ask("tiny-llama-c")
    assert refused.status_code == 503
    assert refused.json()["error"] == {
        "message": misrouted(first, "tiny-llama", "tiny-llama-c"),
        "type": "server_error",
        "param": None,
        "code": "model_not_served",
    }
    assert engine_submitted(clean_redis, first, time.time()) == 5  # never generated

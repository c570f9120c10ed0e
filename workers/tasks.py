"""The worker's Celery task: a thin wrapper that hands the work to workers/execution.py."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Task, shared_task
from celery.signals import task_revoked

from contract.task import GENERATE_IGNORE_RESULT, GENERATE_TASK, TaskPayload
from workers.execution import run_prompts
from workers.runtime import WorkerRuntime


class GenerateTask(Task):
    """The generate task, holding the worker runtime it runs requests with."""

    runtime: WorkerRuntime | None = None

    def worker_runtime(self) -> WorkerRuntime:
        if self.runtime is None:
            raise RuntimeError("no worker runtime: run the worker with `python -m workers.serve`")
        return self.runtime


# A message carries one request (an API call) or a bulk job's chunk; the recorder publishes each
# request's outcome under the request's own id (contract.task.GENERATE_IGNORE_RESULT).
@shared_task(
    bind=True,
    base=GenerateTask,
    name=GENERATE_TASK,
    acks_late=True,
    ignore_result=GENERATE_IGNORE_RESULT,
)
def generate(self: GenerateTask, payloads: list[TaskPayload]) -> None:
    run_prompts(self.worker_runtime(), payloads)


def serve_with(runtime: WorkerRuntime) -> None:
    """Give the generate task this process's runtime (workers/serve.py, before consuming)."""
    generate.runtime = runtime


@task_revoked.connect
def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery drops a message past its `expires` before running it: the recorder marks the row
    expired and publishes that, off the consumer's event loop, unless the request was started
    at delivery (its claim expires an overdue row). Any revoked message gives its requests'
    places in the engine budget back."""
    runtime = getattr(sender, "runtime", None)
    if request is None or getattr(sender, "name", None) != GENERATE_TASK or runtime is None:
        return
    ids = [payload["request_id"] for payload in request.args[0]]
    unstarted = runtime.drop_prestarts(ids)  # a request started at delivery: its claim decides
    for hold in runtime.take_holds(ids):
        hold.release()
    if expired:
        for request_id in unstarted:
            runtime.recorder.expire(uuid.UUID(request_id))

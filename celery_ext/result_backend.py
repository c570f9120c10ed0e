"""Celery's Redis result backend with one round trip per stored state instead of two.

Celery's backend reads a task's current state before every write, so a lost worker's late
duplicate cannot overwrite a SUCCESS. llmqueue decides that earlier and for every state: only the
attempt holding the request's DB claim publishes an outcome (llmqueue/lifecycle.py), so the read
is a wasted round trip on every request's critical path. Keys, channels and the stored format are
Celery's own: `AsyncResult(id).get()`, Flower and `wait_for_outcome` read them unchanged.
"""

from __future__ import annotations

from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str


class LeanRedisBackend(RedisBackend):
    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)
        try:
            self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        return result

    def _set(self, key: str, value: Any, expires: int | None = None) -> None:
        # SETEX then PUBLISH on one connection, in order: a waiter that subscribed before
        # reading the key sees one of them. MULTI/EXEC would add nothing to that.
        expires = self.expires if expires is None else expires
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, value, ex=expires or None)
        pipe.publish(key, value)
        pipe.execute()

    def store_many(self, items: list[tuple[str, Any, str]], pipe: Any = None) -> None:
        """Store and publish several (task id, result, state) at once, each in the format and
        with the expiry `store_result` would give: one round trip for a batch of outcomes. With
        `pipe`, the commands are queued on it for the caller to execute with its own."""
        if pipe is not None:
            self._queue_many(pipe, items)
            return

        def send() -> None:
            own = self.client.pipeline(transaction=False)
            self._queue_many(own, items)
            own.execute()

        self.ensure(send, ())

    def _queue_many(self, pipe: Any, items: list[tuple[str, Any, str]]) -> None:
        # The meta `_get_result_meta` builds for a request-less store (no group, parent,
        # children or extended fields), made here once per batch instead of re-reading the
        # settings for every item.
        date_done = self.app.now().isoformat()
        for task_id, result, state in items:
            meta = {
                "status": state,
                "result": self.encode_result(result, state),
                "traceback": None,
                "children": None,
                "date_done": date_done,
                "task_id": task_id,
            }
            key, value = self.get_key_for_task(task_id), self.encode(meta)
            expires = self.failure_expires if state == states.FAILURE else self.expires
            pipe.set(key, value, ex=expires or None)
            pipe.publish(key, value)


class LeanSentinelBackend(LeanRedisBackend, SentinelBackend):
    """The backend above on Celery's Redis Sentinel support (`sentinel://` URLs, the group named
    by the `master_name` result backend transport option): its client's pool asks the sentinels
    for the current master, so a stored outcome follows a failover (Celery's `ensure` retries
    a write that met the old master's death)."""

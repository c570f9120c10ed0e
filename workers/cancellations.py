"""A worker's ear for cancellations: each request id published on contract.keys.CANCEL_CHANNEL is
aborted in its engine at the next step, wherever it is (waiting, parked or running)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from contract.keys import CANCEL_CHANNEL

log = logging.getLogger(__name__)
_RETRY_SECONDS = 1.0


class CancelListener:
    """A thread subscribed to the cancel channel. A message missed while Redis is away costs
    only the engine time of finishing that request: its row is cancelled, so its outcome is
    never recorded."""

    def __init__(self, client: redis.Redis, abort: Callable[[str], None]) -> None:
        self._client = client
        self._abort = abort
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmqueue-cancels", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except redis.RedisError:
                log.warning("cancel channel lost; subscribing again in %s s", _RETRY_SECONDS)
                self._stop.wait(_RETRY_SECONDS)

    def _listen(self) -> None:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CANCEL_CHANNEL)
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "message":
                    data = message["data"]
                    self._abort(data.decode() if isinstance(data, bytes) else str(data))
        finally:
            pubsub.close()

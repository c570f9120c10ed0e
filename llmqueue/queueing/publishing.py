"""Admitted requests not yet on their queue: admission counts them in the queue's depth."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from contract.keys import PREFIX

# Longer than any admission-to-publish gap (a row's INSERT, then the publish): an entry older
# than this is an API process that died in between, and stops counting.
PUBLISH_GRACE_SECONDS = 30


def publishing_key(queue: str) -> str:
    """A sorted set: request id → when admission let it into `queue` (Redis' clock).

    Admission reads the queue's length, and the INSERT and the publish come after it: with 16
    API threads deciding at once, each saw the same length and a capped queue overshot its cap
    by the requests between their decision and their publish (bench/overload.py: 17 of a cap
    of 16). Counting these too keeps the cap exact.
    """
    return f"{PREFIX}:publishing:{queue}"


def clear(target: Any, queue: str, request_ids: Iterable[object]) -> None:
    """Stop counting `request_ids` once on their queue, or never to be (a refused INSERT or
    publish); `target` a client or a pipeline, so it rides with the publish's round trip."""
    members = [str(i) for i in request_ids]
    if members:
        target.zrem(publishing_key(queue), *members)

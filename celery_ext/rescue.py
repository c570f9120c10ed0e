"""Crash recovery in seconds: a dead worker's held messages go back to their queues at once.

kombu restores an unacked message only when it is older than the visibility timeout (an hour in
production, so a SIGKILLed or OOM-killed worker's requests would wait that long). Each worker
records the delivery tags it holds (celery_ext/broker.py's held set); when its beat goes stale,
a live worker restores exactly those (`rescue`), through kombu's own `restore_by_tag` (a WATCHed
transaction: two rescuers racing restore each message once). A live worker keeps the unacked
timestamps of the messages it still holds fresh (`keep_visible`, with every beat), so kombu's
visibility restore never redelivers a long generation that is still running, whatever the
timeout: it stays the last resort for a whole cluster that died, and for a held-set entry the
process no longer holds (its ack lost in a Redis failover: the claim then drops the redelivery).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import redis

from celery_ext.broker import held_key

# KEYS: held set, unacked index, unacked hash; ARGV: now, the held set's TTL, then the tags the
# process holds. Tags acked without leaving the set (a crash between the two) are dropped from
# it; tags the set names but the process does not hold (a Redis failover lost their ack, so they
# stay unacked on the new master) are left to age: kombu restores them after the visibility
# timeout instead of their being kept unacked for as long as the worker lives.
_KEEP_VISIBLE = """
local holds = {}
for i = 3, #ARGV do holds[ARGV[i]] = true end
local kept = 0
for _, tag in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('HEXISTS', KEYS[3], tag) == 0 then
    redis.call('SREM', KEYS[1], tag)
  elseif holds[tag] then
    redis.call('ZADD', KEYS[2], 'XX', ARGV[1], tag)
    kept = kept + 1
  end
end
if kept > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return kept
"""


def keep_visible(
    client: redis.Redis, node: str, qos: Any, holds: Collection[str], now: float | None = None
) -> int:
    """Date the messages `node` still `holds` (celery_ext/broker.py's held_here) now in kombu's
    unacked index; returns how many."""
    keys = [held_key(node), qos.unacked_index_key, qos.unacked_key]
    ttl = int(qos.visibility_timeout) + 60
    now = time.time() if now is None else now
    return int(client.eval(_KEEP_VISIBLE, 3, *keys, now, ttl, *holds))


def rescue(client: redis.Redis, node: str, qos: Any) -> int:
    """Put every message `node` held back on its queue (its head: it waited longest), then
    forget `node`'s held set; returns how many were restored by this call."""
    restored = 0
    for tag in client.smembers(held_key(node)):
        if client.hexists(qos.unacked_key, tag):
            qos.restore_by_tag(tag, client)
            restored += 1
    client.delete(held_key(node))
    return restored

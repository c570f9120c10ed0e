"""Earliest deadline first within a queue: a message carries its request's deadline, publishing
inserts it by that deadline, and admission counts only the requests that will go before it.

A tier's requests share its targets, so FIFO is already deadline order while every request gets
the tier's max wait. A request may ask for a tighter deadline (`deadline_seconds`); FIFO would
still make it wait behind everyone queued earlier, with more slack than it has. Here it goes ahead
of every request whose deadline is later than its own and behind every one due earlier (QLM's
point: order a group by slack, judge the wait by the group's measured drain rate).

The queue stays a plain Redis list that Celery's consumer BRPOPs from its tail. The common case
(a deadline no earlier than the newest message's) is one LINDEX and an LPUSH. An earlier deadline
walks from both ends to its place, paying for the shorter distance; more than WALK_LIMIT
messages from both ends, it is queued at the back (plain FIFO: never ahead of a request due
earlier).
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

import redis

# The message header (protocol 2 headers travel with the task and are ignored by Celery).
DEADLINE_HEADER = "llmqueue-deadline"
WALK_LIMIT = 2000
_NO_DEADLINE = "1e300"  # later than any deadline: a message without one waits at the back
_CHUNK = 32

# Lua: the deadline of an envelope (none: later than any), and where a message due at `dl`
# belongs in a queue kept in deadline order (most urgent at the tail, where BRPOP takes from).
# boundary() walks from both ends at once, a chunk at a time, so it costs the shorter distance:
# an urgent request walks past the few due before it, a request that lost a publish race to a
# replica (a deadline a millisecond earlier than the newest one's) past the few due after it.
# It returns 'tail', n, pivot (n due first, pivot the first due later), 'head', n, pivot (n due
# later, pivot the first due first), or nil past `limit` messages from each end.
LUA_DEADLINES = f"""
local function deadline_of(message)
  local d = string.match(message, '"{DEADLINE_HEADER.replace("-", "%-")}": ([%d%.]+)')
  return d and tonumber(d) or {_NO_DEADLINE}
end

local function boundary(queue, dl, limit)
  local walked = 0
  while walked < limit do
    local tail = redis.call('LRANGE', queue, -walked - {_CHUNK}, -walked - 1)
    for i = #tail, 1, -1 do
      if deadline_of(tail[i]) > dl then
        return 'tail', walked + #tail - i, tail[i]
      end
    end
    local head = redis.call('LRANGE', queue, walked, walked + {_CHUNK - 1})
    for j = 1, #head do
      if deadline_of(head[j]) <= dl then
        return 'head', walked + j - 1, head[j]
      end
    end
    if #head < {_CHUNK} then
      return nil
    end
    walked = walked + {_CHUNK}
  end
  return nil
end
"""

# KEYS[1] the queue; ARGV: deadline, envelope, deadline, envelope, … (in publish order).
_INSERT = (
    LUA_DEADLINES
    + f"""
local queue = KEYS[1]
for i = 1, #ARGV, 2 do
  local dl, message = tonumber(ARGV[i]), ARGV[i + 1]
  local newest = redis.call('LINDEX', queue, 0)
  if (not newest) or deadline_of(newest) <= dl then
    redis.call('LPUSH', queue, message)
  else
    local side, _, pivot = boundary(queue, dl, {WALK_LIMIT})
    if side == 'tail' then
      redis.call('LINSERT', queue, 'AFTER', pivot, message)
    elseif side == 'head' then
      redis.call('LINSERT', queue, 'BEFORE', pivot, message)
    else
      redis.call('LPUSH', queue, message)  -- too far from both ends: the back, never ahead
    end
  end
end
return 1
"""
)


@cache
def _insert_script(client: redis.Redis) -> Any:
    return client.register_script(_INSERT)


def stamp(headers: dict[str, Any], deadline: datetime | None) -> None:
    """Put the request's deadline (epoch seconds) into a task message's headers."""
    if deadline is not None:
        headers[DEADLINE_HEADER] = round(deadline.timestamp(), 6)


def insert_by_deadline(
    client: redis.Redis | redis.client.Pipeline,
    queue: str,
    envelopes: list[tuple[datetime | None, str]],
    script_client: redis.Redis,
) -> Any:
    """Queue `envelopes` ((deadline, envelope), in publish order) on `queue`: those with a
    deadline in deadline order, those without at the back (one LPUSH each)."""
    args: list[Any] = []
    for deadline, envelope in envelopes:
        args += [repr(deadline.timestamp()) if deadline is not None else _NO_DEADLINE, envelope]
    return _insert_script(script_client)(keys=[queue], args=args, client=client)

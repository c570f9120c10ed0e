"""Earliest deadline first within a queue: a message carries its request's deadline, publishing
inserts it by that deadline, and admission counts only the requests that will go before it.

A tier's requests share its targets, so FIFO is already deadline order while every request gets
the tier's max wait. A request may ask for a tighter deadline (`deadline_seconds`); FIFO would
still make it wait behind everyone queued earlier, with more slack than it has. Here it goes ahead
of every request whose deadline is later than its own and behind every one due earlier (QLM's
point: order a group by slack, judge the wait by the group's measured drain rate).

The queue stays a plain Redis list that Celery's consumer BRPOPs from its tail. The common case
(a deadline no earlier than the newest message's) is one LINDEX and an LPUSH. An earlier deadline
walks from the tail (the most urgent end) past the messages due first, so an urgent request pays
for the few ahead of it, not for the whole backlog; past WALK_LIMIT messages it walks from the
head instead, and past that as well it is queued at the back (plain FIFO: never ahead of a
request due earlier).
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
_CHUNK = 100

# Lua: the deadline of an envelope (none: later than any); how many messages from the tail are
# due no later than `dl` (at most `cap`: callers only need "more than") and the first due later.
LUA_DEADLINES = f"""
local function deadline_of(message)
  local d = string.match(message, '"{DEADLINE_HEADER.replace("-", "%-")}": ([%d%.]+)')
  return d and tonumber(d) or {_NO_DEADLINE}
end

local function due_first(queue, dl, cap)
  local count, stop = 0, -1
  while count < cap do
    local chunk = redis.call('LRANGE', queue, stop - {_CHUNK - 1}, stop)
    for i = #chunk, 1, -1 do
      if deadline_of(chunk[i]) > dl then
        return count, chunk[i]
      end
      count = count + 1
    end
    if #chunk < {_CHUNK} then
      return count, nil
    end
    stop = stop - {_CHUNK}
  end
  return count, nil
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
    local count, later = due_first(queue, dl, {WALK_LIMIT})
    if later then
      -- between the last message due first and the first one due later
      redis.call('LINSERT', queue, 'AFTER', later, message)
    else
      -- too many due first to walk: walk from the head past the ones due later
      local placed, start = false, 0
      while (not placed) and start < {WALK_LIMIT} do
        local chunk = redis.call('LRANGE', queue, start, start + {_CHUNK - 1})
        for j = 1, #chunk do
          if deadline_of(chunk[j]) <= dl then
            redis.call('LINSERT', queue, 'BEFORE', chunk[j], message)
            placed = true
            break
          end
        end
        if #chunk < {_CHUNK} then break end
        start = start + {_CHUNK}
      end
      if not placed then
        redis.call('LPUSH', queue, message)
      end
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
    """Queue `envelopes` ((deadline, envelope), in publish order) on `queue` in deadline order.
    A message without a deadline goes to the back."""
    args: list[Any] = []
    for deadline, envelope in envelopes:
        args += [repr(deadline.timestamp()) if deadline is not None else _NO_DEADLINE, envelope]
    return _insert_script(script_client)(keys=[queue], args=args, client=client)

"""Lua scripts on pipelines without redis-py's extra round trip, safe when Redis lost them.

redis-py's `Script(client=pipe)` makes the pipeline send SCRIPT EXISTS (one more round trip)
before every execute; the worker's recorder runs a pipeline with scripts for most of its batches
(measured: 187-226 SCRIPT EXISTS per 300 requests, bench/throughput.py). Here a script queues a
plain EVALSHA, and `execute` loads and re-runs only the scripts' own commands if the server
answers NOSCRIPT (it restarted, or SCRIPT FLUSH): every command runs once either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

_by_sha: dict[str, Script] = {}


def call(
    pipe: redis.client.Pipeline, script: Script, keys: Sequence[Any], args: Sequence[Any]
) -> None:
    """Queue `script` on `pipe` as one EVALSHA."""
    _by_sha[script.sha] = script
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def execute(pipe: redis.client.Pipeline) -> list[Any]:
    """`pipe.execute()`, re-running the EVALSHAs the server did not know after loading them;
    raises the first other error, as `execute` would, once every command ran."""
    stack = [args for args, _ in pipe.command_stack]
    results = pipe.execute(raise_on_error=False)
    missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
    if missing:
        # Built only here: a client costs ~90 us of Python (its response callbacks), on every
        # outcome's path to its caller when it was built for each execute.
        client = redis.Redis(connection_pool=pipe.connection_pool)
        for sha in {stack[i][1] for i in missing}:
            client.script_load(_by_sha[sha].script)
        again = client.pipeline(transaction=False)
        for i in missing:
            again.execute_command(*stack[i])
        for i, result in zip(missing, again.execute(raise_on_error=False), strict=True):
            results[i] = result
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results

"""Ten times the engine's capacity: the API keeps answering, the queue holds its cap, nothing
admitted is lost (bench/overload.py's run, shorter, its outcomes asserted exactly)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from bench import overload
from tests.reliability_record import record

# bench/reliability.py asks for the full minute; `make test` runs a shorter burst.
BURST_SECONDS = os.environ.get("LLMQUEUE_OVERLOAD_SECONDS", "10")


def test_ten_times_capacity_is_refused_fast_with_the_queue_capped_and_nothing_admitted_lost():
    db = urlsplit(os.environ["REDIS_URL"]).path.lstrip("/") or "0"
    args = overload.parse_args(["--seconds", BURST_SECONDS, "--redis-db", db, "--out", os.devnull])
    result = overload.measure(args)

    answers = result["answers"]
    # The load really was overload: most of it refused, some of each kind admitted.
    assert answers["flood"].get("503", 0) > 5 * answers["flood"].get("202", 0) > 0
    assert answers["capped"].get("429", 0) > 0 and answers["capped"].get("202", 0) > 0
    assert answers["floor"] == {"200": answers["floor"]["200"]}
    # No answer but the API's own: no 5xx besides backpressure, every refusal with Retry-After.
    assert result["unexpected"] == {}
    assert result["depth"]["max"] <= result["depth"]["cap"] == args.depth_cap
    settled = result["settled"]
    assert settled["stored"] == settled["admitted"]  # a refused request stored nothing
    assert settled["succeeded"] + settled["expired"] == settled["admitted"]
    assert (settled["lost"], settled["failed"], settled["expired_late"]) == (0, 0, 0)
    assert result["broker_messages_left"] == 0
    assert result["rss_mb"]["api_growth"] <= overload.GOAL_RSS_GROWTH_MB
    assert result["rss_mb"]["worker_growth"] <= overload.GOAL_RSS_GROWTH_MB
    record(
        "overload",
        reject_p99_ratio=result["reject_p99_ratio"],
        depth_max_over_cap=result["depth_max_over_cap"],
        reject_p99_ms=result["reject_p99_ms"],
        floor_p99_ms=result["floor_p99_ms"],
        accepted=settled["admitted"],
        completed=settled["succeeded"],
        expired=settled["expired"],
        lost=settled["lost"],
        offered_rps=result["offered_rps"],
        burst_s=result["burst_s"],
    )

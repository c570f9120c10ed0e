"""The dispatch policy and engine budget without a worker: order, starvation, caps, weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from celery_ext.queue_cycle import TierCycle
from contract.task import TaskPayload
from workers import queue_order
from workers.dispatch import (
    DispatchMode,
    QueueOrder,
    RoundRobinOrder,
    StrictOrder,
    TierPolicy,
    WeightedOrder,
)
from workers.engine import GenerationRequest
from workers.engine_budget import (
    NO_HOLD,
    EngineBudget,
    EngineLimits,
    RecentPeak,
    default_token_budget,
    estimated_tokens,
    guaranteed_requests,
    joins_engine,
    tier_request_cap,
    tier_token_cap,
)
from workers.options import SlotOptions, bulk_reserve, joins_per_step
from workers.queue_order import Dispatcher

INTER, BATCH = "default.interactive", "default.batch"
TIERS = {
    INTER: TierPolicy("interactive", priority=0, weight=8),
    BATCH: TierPolicy("batch", priority=6, weight=1, max_engine_share=0.75),
}
LIMITS = EngineLimits(max_num_seqs=16, task_slots=32, token_budget=16 * 1024)


def fetch(
    policy: QueueOrder,
    backlog: dict[str, int],
    n: int,
    tiers: dict[str, TierPolicy] = TIERS,
    queues: Sequence[str] = (INTER, BATCH),
) -> list[str]:
    """What n BRPOPs return: each asks the policy's order and pops the first non-empty queue."""
    served = []
    for _ in range(n):
        asked = policy.order(list(queues), tiers)
        queue = next((q for q in asked if backlog.get(q, 0) > 0), None)
        if queue is None:
            break
        backlog[queue] -= 1
        policy.served(queue, asked, tiers)
        served.append(queue)
    return served


def test_weighted_order_interleaves_tiers_in_their_weight_ratio():
    tiers = {INTER: TierPolicy("interactive", 0, 3), BATCH: TierPolicy("batch", 6, 1)}
    served = fetch(WeightedOrder(), {INTER: 100, BATCH: 100}, 12, tiers)
    assert served == [INTER, INTER, BATCH, INTER] * 3


def test_default_weights_never_starve_batch_under_a_sustained_interactive_backlog():
    served = fetch(WeightedOrder(), {INTER: 10_000, BATCH: 10_000}, 900)
    assert Counter(served) == {INTER: 800, BATCH: 100}
    # Not bursts: every 9 consecutive fetches hold exactly one batch request.
    for start in range(0, 900 - 9):
        assert served[start : start + 9].count(BATCH) == 1


def test_an_idle_tier_banks_no_credit_and_the_busy_one_owes_none():
    policy = WeightedOrder()
    assert fetch(policy, {INTER: 0, BATCH: 50}, 50) == [BATCH] * 50  # batch alone: takes everything
    # Interactive arrives: the ratio resumes at once, no burst either way.
    served = fetch(policy, {INTER: 100, BATCH: 100}, 18)
    assert Counter(served) == {INTER: 16, BATCH: 2}
    assert served[:9].count(BATCH) == 1


def test_weighted_order_drains_a_tier_left_alone():
    served = fetch(WeightedOrder(), {INTER: 3, BATCH: 5}, 10)
    assert Counter(served) == {INTER: 3, BATCH: 5}


def test_strict_order_serves_lower_tiers_only_when_higher_ones_are_empty():
    served = fetch(StrictOrder(), {INTER: 20, BATCH: 5}, 25, queues=(BATCH, INTER))
    assert served == [INTER] * 20 + [BATCH] * 5


def test_round_robin_takes_queues_in_turn_regardless_of_tier():
    assert fetch(RoundRobinOrder(), {INTER: 3, BATCH: 3}, 6) == [INTER, BATCH] * 3


def test_tier_caps_keep_headroom_of_the_engine_for_more_urgent_tiers():
    assert tier_request_cap(0.75, LIMITS) == 12  # floor(0.75 × 16): 4 sequences stay free
    assert tier_request_cap(1.0, LIMITS) == 32  # uncapped: every task slot
    assert tier_request_cap(0.01, LIMITS) == 1  # a tier always progresses
    assert tier_token_cap(0.75, LIMITS) == 12 * 1024
    assert tier_token_cap(1.0, LIMITS) == 16 * 1024
    assert default_token_budget(64, 1024) == 65_536


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_capped_tier_fills_the_engine_but_one_sequence_while_no_urgent_tier_held_any():
    budget = EngineBudget(LIMITS)  # 16 sequences, 32 task slots
    assert budget.joins_engine(BATCH, 14, 14, 0.75, urgent=[INTER])  # one more leaves one free
    assert not budget.joins_engine(BATCH, 15, 15, 0.75, urgent=[INTER])  # the last: interactive's
    assert budget.joins_engine(BATCH, 15, 15, 0.75)  # no more urgent tier here: none kept free
    assert budget.joins_engine(INTER, 16, 0, 1.0, urgent=[])  # uncapped: vLLM's queue orders it
    for i in range(30):  # fetched beyond the engine, batch's requests wait in the worker ...
        budget.hold(BATCH, f"b{i}", 10)
    assert budget.admits(BATCH, 0.75, urgent=[INTER])
    budget.hold(BATCH, "b30", 10)
    assert not budget.admits(BATCH, 0.75, urgent=[INTER])  # ... and leave a task slot free
    assert budget.admits(INTER, 1.0)


def test_a_capped_tier_leaves_free_what_the_urgent_tiers_held_at_their_recent_peak():
    clock = Clock()
    budget = EngineBudget(LIMITS, headroom_window_seconds=60, clock=clock)
    for i in range(4):  # an interactive burst of 4, then it finishes
        budget.hold(INTER, f"i{i}", 10)
    for hold in budget.take([f"i{i}" for i in range(4)]):
        hold.release()
    # Peak 4 + 1 = 5 free, but at most the share's 4: the 12th may join, not the 13th.
    assert budget.joins_engine(BATCH, 11, 11, 0.75, urgent=[INTER])
    assert not budget.joins_engine(BATCH, 12, 12, 0.75, urgent=[INTER])
    budget.hold(INTER, "i4", 10)
    budget.hold(INTER, "i5", 10)  # interactive holds 2 of its peak 4: 2 more + 1 stay free
    assert budget.joins_engine(BATCH, 12, 10, 0.75, urgent=[INTER])
    assert not budget.joins_engine(BATCH, 13, 11, 0.75, urgent=[INTER])
    clock.now += 61  # the burst is older than the window: only what interactive holds counts
    assert budget.joins_engine(BATCH, 14, 12, 0.75, urgent=[INTER])
    assert not budget.joins_engine(BATCH, 15, 13, 0.75, urgent=[INTER])  # the last stays free


def test_under_a_heavy_urgent_load_a_capped_tier_leaves_its_shares_rest_free():
    budget = EngineBudget(LIMITS)  # 16 sequences: batch (0.75) leaves at most 4 free
    for i in range(10):
        budget.hold(INTER, f"i{i}", 10)
    for hold in budget.take([f"i{i}" for i in range(9)]):
        hold.release()  # interactive peaked at 10, holds 1 now: spare 9, capped to 4
    assert budget.joins_engine(BATCH, 11, 10, 0.75, urgent=[INTER])
    assert not budget.joins_engine(BATCH, 12, 11, 0.75, urgent=[INTER])  # 4 stay free
    assert budget.joins_engine(BATCH, 14, 1, 0.75, 2, urgent=[INTER])  # its guaranteed share


def test_a_capped_tier_joins_at_most_its_joins_per_step_in_one_step():
    limits = EngineLimits(16, task_slots=32, token_budget=100_000, joins_per_step=2)
    assert joins_engine(0, 0, 0.75, 1, limits, None, tier_joined=1)
    assert not joins_engine(0, 0, 0.75, 1, limits, None, tier_joined=2)  # the next step's
    assert not joins_engine(0, 0, 0.75, 4, limits, None, tier_joined=2)  # its guarantee too
    assert joins_engine(0, 0, 1.0, 1, limits, None, tier_joined=9)  # uncapped: no spread
    assert joins_engine(0, 0, 0.75, 1, LIMITS, None, tier_joined=99)  # 0: no limit
    assert joins_per_step(0, 64) == 8  # an empty engine fills over 8 steps
    assert joins_per_step(0, 4) == 1
    assert joins_per_step(3, 64) == 3
    assert joins_per_step(-1, 64) == 0


def test_recent_peak_forgets_what_is_older_than_its_window_but_not_what_is_held_now():
    clock = Clock()
    peak = RecentPeak(10, clock)
    for held in (1, 2, 3, 2):
        peak.observe(held)
    assert peak.peak() == 3 and peak.now == 2
    clock.now += 5
    peak.observe(1)
    assert peak.peak() == 3
    clock.now += 11
    assert peak.peak() == 1  # the 3 aged out; the level held since counts
    peak.observe(0)
    assert peak.peak() == 1  # still this second's and the window's
    clock.now += 11
    assert peak.peak() == 0


def test_a_capped_tier_keeps_its_weights_share_however_busy_the_others_are():
    limits = EngineLimits(max_num_seqs=36, task_slots=40, token_budget=100_000)
    assert guaranteed_requests(1, 9, limits) == 4  # weights 8:1 → 1/9 of 36 sequences
    assert guaranteed_requests(8, 9, limits) == 32
    assert guaranteed_requests(1, 1000, limits) == 1  # at least one: it always progresses
    budget = EngineBudget(limits)
    for i in range(40):
        budget.hold(INTER, f"i{i}", 10)
    for i in range(4):
        assert budget.admits(BATCH, 0.75, guaranteed=4)
        budget.hold(BATCH, f"b{i}", 10)
    assert not budget.admits(BATCH, 0.75, guaranteed=4)
    assert not budget.admits(INTER, 1.0)  # every task slot is taken


def test_dispatcher_guarantees_each_tier_its_weights_share():
    d = dispatcher(limits=EngineLimits(max_num_seqs=36, task_slots=40, token_budget=100_000))
    for i in range(36):
        d.budget.hold(INTER, f"i{i}", 10)
    for hold in d.budget.take([f"i{i}" for i in range(6)]):
        hold.release()  # interactive peaked at 36: batch's headroom is the share's 9
    for i in range(3):
        d.budget.hold(BATCH, f"b{i}", 10)
    assert d.order([INTER, BATCH]) == [INTER, BATCH]  # 3 < 4 = 1/9 of 36
    d.budget.hold(BATCH, "b3", 10)
    assert d.order([INTER, BATCH]) == [INTER]


def payload(request_id: str, prompt: str = "abcd" * 10, max_tokens: int = 20) -> TaskPayload:
    return {
        "request_id": request_id, "kind": "completion", "model": "sim", "prompt": prompt,
        "messages": None, "params": {"max_tokens": max_tokens}, "priority": 0, "deadline_ts": 0.0,
    }  # fmt: skip


def test_estimated_tokens_are_prompt_bytes_per_token_plus_max_tokens():
    assert estimated_tokens(payload("r", "abcd" * 10, 20), 4.0) == 10 + 20
    chat = payload("c", "", 5)
    chat["messages"] = [{"role": "user", "content": "abcdefgh"}, {"role": "system", "content": ""}]
    assert estimated_tokens(chat, 4.0) == (2 + 4) + (0 + 4) + 5


def test_budget_counts_requests_from_delivery_to_release():
    budget = EngineBudget(LIMITS)
    for i in range(30):
        budget.hold(BATCH, f"b{i}", 100)
    assert budget.admits(BATCH, 0.75, urgent=[INTER])
    budget.hold(BATCH, "b30", 100)
    assert not budget.admits(BATCH, 0.75, urgent=[INTER])  # 31 held: one task slot stays free
    assert budget.admits(INTER, 1.0)
    [hold] = budget.take(["b3"])
    assert budget.take(["never-delivered"]) == [NO_HOLD]
    hold.release()
    hold.release()  # once only
    assert budget.usage(BATCH).requests == 30 and budget.usage(BATCH).tokens == 3000
    assert budget.admits(BATCH, 0.75, urgent=[INTER])


def test_token_budget_holds_back_every_tier_when_long_prompts_fill_it():
    budget = EngineBudget(EngineLimits(max_num_seqs=16, task_slots=32, token_budget=10_000))
    budget.hold(BATCH, "long-1", 4_000)
    budget.hold(BATCH, "long-2", 4_000)
    assert not budget.admits(BATCH, 0.75)  # 8000 ≥ 0.75 × 10 000: batch's share of the tokens
    assert budget.admits(INTER, 1.0)  # only 2 requests: a count budget alone would admit 14 more
    budget.hold(INTER, "long-3", 2_500)
    assert not budget.admits(INTER, 1.0)  # 10 500 ≥ the whole budget
    budget.take(["long-1"])[0].release()
    assert budget.admits(INTER, 1.0) and budget.admits(BATCH, 0.75)  # 6500 held, batch 4000


class FakeHub:
    def __init__(self) -> None:
        self.calls = 0

    def call_soon(self, callback: Any) -> None:
        self.calls += 1
        callback()


def dispatcher(mode: DispatchMode = DispatchMode.OURS, limits: EngineLimits = LIMITS) -> Dispatcher:
    d = Dispatcher(mode, limits, bytes_per_token=4.0)
    d.set_tiers(TIERS.values())
    d._hub = FakeHub()
    return d


def test_dispatcher_leaves_a_capped_tier_out_and_wakes_the_loop_when_all_are_out():
    d = dispatcher(limits=EngineLimits(max_num_seqs=4, task_slots=8, token_budget=100_000))
    for i in range(7):
        d.budget.hold(BATCH, f"b{i}", 10)
    assert d.order([INTER, BATCH]) == [INTER]  # batch leaves interactive one task slot
    assert d.held_back([INTER, BATCH])
    for i in range(8):
        d.budget.hold(INTER, f"i{i}", 10)
    assert d.order([INTER, BATCH]) == []  # interactive holds every task slot too
    d.budget.take(["i0"])[0].release()
    assert d._hub.calls == 1  # nothing was being fetched: the loop must look again
    assert d.order([INTER, BATCH]) == [INTER]  # batch stays out: the worker holds 14


def test_the_bulk_reserve_is_held_by_capped_tiers_only_and_parks_outside_the_engine():
    # 4 sequences, a short line of 5 task slots and a reserve of 4 more: 9 in all.
    d = dispatcher(limits=EngineLimits(4, task_slots=9, token_budget=100_000, reserve=4))
    d.budget.parked = lambda: max(0, d.budget.usage(BATCH).requests - 3)  # batch runs 3
    d.order([INTER, BATCH])
    for i in range(8):
        assert d.order([INTER, BATCH]) == [INTER, BATCH]
        d.budget.hold(BATCH, f"b{i}", 10)
    assert d.order([INTER, BATCH]) == [INTER]  # the last slot is interactive's headroom
    batch = GenerationRequest("b", lane=BATCH, priority=6)
    assert not d.may_start(batch, 3, 3)  # the reserve waits parked, not in the engine
    d.budget.hold(INTER, "i0", 10)
    assert d.order([INTER, BATCH]) == [INTER]
    d.budget.hold(INTER, "i1", 10)
    # Batch's 3 running and interactive's 2 fill the short line of 5: the reserve is batch's
    # parked requests only, never a longer line into the engine for the urgent tier.
    assert d.order([INTER, BATCH]) == []
    d.budget.take([f"b{i}" for i in range(8)] + ["i0", "i1"])
    budget = EngineBudget(EngineLimits(4, task_slots=9, token_budget=100_000, reserve=4))
    for i in range(5):
        assert budget.admits(INTER, 1.0)
        budget.hold(INTER, f"i{i}", 10)
    assert not budget.admits(INTER, 1.0)  # an urgent tier's line stays 5: it has no reserve


def test_the_bulk_reserve_is_one_engine_when_asked_and_only_with_our_dispatch():
    assert SlotOptions().bulk_reserve == 0  # off by default: see workers.options.bulk_reserve
    assert bulk_reserve(-1, 64, "ours") == 64
    assert bulk_reserve(16, 64, "ours") == 16
    assert bulk_reserve(0, 64, "ours") == 0
    assert bulk_reserve(-1, 64, "strict") == 0  # no parking there: it would lengthen vLLM's line
    assert bulk_reserve(-1, 64, "fifo") == 0


def test_dispatcher_parks_a_capped_tiers_request_while_the_engine_holds_the_headroom():
    d = dispatcher(limits=EngineLimits(max_num_seqs=4, task_slots=8, token_budget=100_000))
    d.order([INTER, BATCH])  # kombu asks for both queues: interactive is batch's urgent tier
    batch = GenerationRequest("b", lane=BATCH, priority=6)
    assert d.may_start(batch, 2, 2)
    assert not d.may_start(batch, 3, 3)  # the 4th sequence stays interactive's
    assert d.may_start(GenerationRequest("i", lane=INTER), 4, 0)
    assert d.may_start(GenerationRequest("x"), 4, 4)  # started by its task, not at delivery
    spread = dispatcher(
        limits=EngineLimits(4, task_slots=8, token_budget=100_000, joins_per_step=1)
    )
    spread.order([INTER, BATCH])
    assert spread.may_start(batch, 0, 0, 0) and not spread.may_start(batch, 1, 1, 1)
    assert dispatcher(DispatchMode.STRICT).may_start(batch, 16, 16)  # baselines park nothing


@pytest.mark.parametrize("mode", [DispatchMode.FIFO, DispatchMode.STRICT])
def test_baselines_have_no_budget_but_task_slots(mode: DispatchMode):
    d = dispatcher(mode)
    for i in range(30):
        d.budget.hold(BATCH, f"b{i}", 10_000)
    assert sorted(d.order([INTER, BATCH])) == sorted([INTER, BATCH])


def test_weight_changes_apply_to_the_next_fetch_without_a_restart():
    d = dispatcher()
    backlog = {INTER: 1000, BATCH: 1000}

    def run(n: int) -> list[str]:
        served = []
        for _ in range(n):
            queue = next(q for q in d.order([INTER, BATCH]) if backlog[q])
            backlog[queue] -= 1
            d.served(queue)
            served.append(queue)
        return served

    assert Counter(run(9)) == {INTER: 8, BATCH: 1}
    d.set_tiers([TierPolicy("interactive", 0, 8), TierPolicy("batch", 6, 8, 0.75)])
    assert Counter(run(16)) == {INTER: 8, BATCH: 8}
    assert d.fetched == {INTER: 16, BATCH: 9}


def test_dispatcher_counts_a_published_message_by_its_requests(transactional_db: None):
    import json

    from contract.task import GENERATE_TASK
    from llmqueue.queueing.publisher import task_envelope

    args = [[payload("r1", "x" * 400, 100), payload("r2", "y" * 40, 10)]]
    message = json.loads(task_envelope(GENERATE_TASK, "r1", BATCH, args, None, "(r1, r2)"))
    d = dispatcher()
    d.delivered(message, BATCH)
    assert d.budget.usage(BATCH).requests == 2
    assert d.budget.usage(BATCH).tokens == (100 + 100) + (10 + 10)
    assert [h.request_id for h in d.budget.take(["r2", "r1"])] == ["r2", "r1"]


def test_tier_cycle_is_kombus_round_robin_without_a_dispatcher_and_polls_fast_when_capped():
    cycle = TierCycle()
    cycle.update([INTER, BATCH])
    assert cycle.consume(2) == [INTER, BATCH]
    assert cycle.rotate(INTER) == INTER and cycle.consume(2) == [BATCH, INTER]
    assert cycle.poll_timeout(1.0) == 1.0
    d = dispatcher(limits=EngineLimits(max_num_seqs=4, task_slots=8, token_budget=100_000))
    d.plug_in()
    try:
        assert cycle.consume(2) == [INTER, BATCH]
        for i in range(7):
            d.budget.hold(BATCH, f"b{i}", 10)
        assert cycle.poll_timeout(1.0) == queue_order.HELD_BACK_POLL_SECONDS
        assert cycle.consume(2) == [INTER]
    finally:
        d.unplug()


def test_workers_read_tier_settings_as_the_admin_saves_them(transactional_db: None):
    from llmqueue.defaults import ensure_default_tiers
    from llmqueue.models import Tier
    from workers.tier_settings import load_tier_policies

    ensure_default_tiers()
    assert {t.name: t.weight for t in load_tier_policies()} == {"interactive": 8, "batch": 1}
    Tier.objects.filter(name="batch").update(weight=4, max_engine_share=0.5)
    batch = next(t for t in load_tier_policies() if t.name == "batch")
    assert batch == TierPolicy("batch", priority=6, weight=4, max_engine_share=0.5)


def test_shared_queue_puts_every_tier_of_a_pool_on_one_queue(transactional_db: None, settings):
    from llmqueue.defaults import ensure_default_tiers
    from llmqueue.queueing.lanes import pool_queues, queue_name

    ensure_default_tiers()
    assert pool_queues("chat") == ["chat.interactive", "chat.batch"]
    settings.LLMQUEUE_SHARED_QUEUE = True
    assert queue_name("chat", "batch") == queue_name("chat", "interactive") == "chat.all-tiers"
    assert pool_queues("chat") == ["chat.all-tiers"]


class StartedChains:
    """Prestarts that only keep what the dispatcher starts: a chain's hold is released when
    the test ends it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.holds: list[Any] = []

    def start(self, payload: TaskPayload, lane: str, hold: Any, redelivered: bool) -> None:
        self.started.append(payload["request_id"])
        self.holds.append(hold)


def test_a_lone_request_has_the_consumer_wait_for_its_recording_before_celery_sees_it(
    transactional_db: None,
):
    import json

    from contract.task import GENERATE_TASK
    from llmqueue.queueing.publisher import task_envelope

    def message(*ids: str) -> dict[str, Any]:
        args = [[payload(i, "x" * 40, 10) for i in ids]]
        return json.loads(task_envelope(GENERATE_TASK, ids[0], INTER, args, None, repr(ids)))

    waits: list[float] = []
    d, chains = dispatcher(), StartedChains()
    d.prestarts = chains  # type: ignore[assignment]
    d.recorder_quiet = waits.append
    d.delivered(message("r1"), INTER)
    d.held()
    d.held()  # once per delivery
    assert waits == [queue_order.LONE_REQUEST_WAIT_SECONDS]
    d.delivered(message("r2"), INTER)  # r1 is still in flight: r2 is not alone
    d.held()
    d.delivered(message("b1", "b2"), BATCH)  # a chunk of a bulk job is not a lone request
    d.held()
    assert waits == [queue_order.LONE_REQUEST_WAIT_SECONDS]
    for hold in chains.holds:  # their chains ended
        hold.release()
    d.delivered(message("r3"), INTER)  # the others ended: alone again
    d.held()
    assert waits == [queue_order.LONE_REQUEST_WAIT_SECONDS] * 2
    assert chains.started == ["r1", "r2", "b1", "b2", "r3"]

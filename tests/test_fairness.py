"""Token fairness between tenants of a tier (llmqueue/admission/fairness.py): service in tokens
follows the weights whatever the request sizes, idle time is no credit, and the service gap
between two backlogged tenants stays within a small multiple of the largest request."""

from __future__ import annotations

import random

from llmqueue.admission.fairness import VirtualTokenCounter


def release(vtc: VirtualTokenCounter, backlog: dict[int, list[int]], n: int) -> dict[int, int]:
    """Release `n` requests from the tenants' backlogs (tokens each) as the counter picks;
    the tokens each tenant got."""
    got = dict.fromkeys(backlog, 0)
    for _ in range(n):
        tenant = vtc.next_tenant(t for t, lines in backlog.items() if lines)
        if tenant is None:
            break
        tokens = backlog[tenant].pop(0)
        vtc.served(tenant, tokens)
        got[tenant] += tokens
    return got


def test_big_and_small_requests_get_equal_tokens_not_equal_requests():
    vtc = VirtualTokenCounter()
    got = release(vtc, {1: [2000] * 100, 2: [100] * 2000}, 420)
    assert abs(got[1] - got[2]) <= 2000  # round robin by request: 200,000 vs 10,000
    assert got[1] + got[2] >= 400 * 100


def test_weights_share_tokens_in_proportion():
    vtc = VirtualTokenCounter(weights={1: 3.0, 2: 1.0})
    got = release(vtc, {1: [300] * 1000, 2: [300] * 1000}, 400)
    assert got == {1: 300 * 300, 2: 100 * 300}


def test_idle_time_is_no_credit_for_a_tenant_that_comes_back():
    vtc = VirtualTokenCounter()
    release(vtc, {1: [100] * 50, 2: []}, 50)  # tenant 2 idle while 1 is served 5,000 tokens
    got = release(vtc, {1: [100] * 100, 2: [100] * 100}, 100)
    assert got == {1: 5000, 2: 5000}  # not 2 alone for the first 50 releases


def test_the_service_gap_of_two_backlogged_tenants_stays_within_twice_the_largest_request():
    rng = random.Random(7)
    sizes = {t: [rng.choice([50, 120, 800, 2000]) for _ in range(3000)] for t in (1, 2)}
    vtc = VirtualTokenCounter()
    got = dict.fromkeys(sizes, 0)
    largest, worst = max(max(s) for s in sizes.values()), 0
    for _ in range(2000):
        tenant = vtc.next_tenant(sizes)
        assert tenant is not None
        tokens = sizes[tenant].pop(0)
        vtc.served(tenant, tokens)
        got[tenant] += tokens
        worst = max(worst, abs(got[1] - got[2]))
    assert worst <= 2 * largest

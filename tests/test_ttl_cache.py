"""The per-process TTL cache stays bounded whatever keys callers make up."""

from __future__ import annotations

from llmqueue.ttl_cache import TtlCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_made_up_keys_never_grow_the_cache_past_its_bound():
    cache: TtlCache[str, None] = TtlCache(60.0, clock=Clock(), max_entries=100)
    for n in range(10_000):
        cache.get(f"key-{n}", lambda _key: None)
        assert len(cache) <= 100


def test_when_full_expired_entries_go_first_and_live_ones_stay():
    clock = Clock()
    cache: TtlCache[str, str] = TtlCache(10.0, clock=clock, max_entries=3)
    cache.get("old", str.upper)
    clock.now = 5.0
    cache.get("a", str.upper)
    cache.get("b", str.upper)
    clock.now = 12.0  # "old" has expired, "a" and "b" have not
    loads: list[str] = []

    def load(key: str) -> str:
        loads.append(key)
        return key.upper()

    cache.get("c", load)
    assert len(cache) == 3
    assert cache.get("a", load) == "A"
    assert loads == ["c"]  # "a" was kept, not loaded again


def test_the_api_caches_of_keys_and_models_are_bounded():
    from llmqueue.api.auth import _callers
    from llmqueue.queueing.routing import _routes

    assert _callers.max_entries == _routes.max_entries == 10_000

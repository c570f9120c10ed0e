"""Fair shares of a tier between tenants, by tokens: a virtual token counter (VTC) per tenant.

Round robin by request is unfair when requests differ in size: a tenant of 2,000-token requests
gets twenty times the service of one sending 100-token requests. VTC (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024) counts each tenant's service in tokens (prompt +
generated, so both what a request holds and what it makes count), divided by its weight, and
always serves the backlogged tenant with the least. A tenant that was idle is lifted to the least
counter among the backlogged ones when it comes back, so it cannot bank idle time and then
starve the others. Between two tenants backlogged over the same span, the weighted service
differs by at most a small multiple of the largest request (the paper bounds it by 2 × the
largest request's tokens with the lift; tests/test_fairness.py checks it on uneven traffic).

Pure and clock-free: the bulk pacer asks `next_tenant` which tenant's line to release next and
calls `served` with the tokens the line holds (estimated prompt + max_tokens; a line's real use
is charged when it ends, with `correct`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class VirtualTokenCounter:
    """Per-tenant service counters of one tier, in weighted tokens."""

    weights: Mapping[int, float] = field(default_factory=dict)  # tenant → weight (default 1)
    counters: dict[int, float] = field(default_factory=dict)
    _backlogged: set[int] = field(default_factory=set)
    _last_served: float = 0.0  # the counter of the tenant served last, after its charge

    def weight(self, tenant: int) -> float:
        return max(1e-9, float(self.weights.get(tenant, 1.0)))

    def next_tenant(self, backlogged: Iterable[int]) -> int | None:
        """The backlogged tenant to serve next: the least counter (ties: the lowest id, so
        the choice is reproducible); None when nobody waits."""
        waiting = set(backlogged)
        self._lift(waiting - self._backlogged, waiting & self._backlogged)
        self._backlogged = waiting
        if not waiting:
            return None
        return min(waiting, key=lambda tenant: (self.counters[tenant], tenant))

    def served(self, tenant: int, tokens: float) -> None:
        """Charge `tenant` for a released request of `tokens`."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weight(tenant)
        self._last_served = self.counters[tenant]

    def correct(self, tenant: int, charged: float, used: float) -> None:
        """A request charged `charged` tokens at release used `used`: charge the difference."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + (used - charged) / self.weight(
            tenant
        )

    def _lift(self, returning: set[int], staying: set[int]) -> None:
        """A tenant back in the backlog starts no lower than the least counter of those that
        stayed in it (no one staying: than the last one served), so idle time is not credit."""
        floor = min((self.counters[t] for t in staying), default=self._last_served)
        for tenant in returning:
            self.counters[tenant] = max(self.counters.get(tenant, floor), floor)

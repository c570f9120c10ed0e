"""Which tier a request runs on: OpenAI's `service_tier` field or the X-LLMQueue-Tier header,
within the tiers its tenant may use; neither given, the tenant's default tier.

`service_tier` keeps OpenAI's values: `auto` is the tenant's default tier, `default`, `flex` and
`priority` the tier the admin marked with that value (`default` unmarked: the tenant's default
tier too). The header names a tier directly. A tier that does not exist, or an OpenAI value no
tier serves here, is 422; a tier the tenant may not use is 403.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmqueue.api.auth import Caller
from llmqueue.api.errors import Forbidden, InvalidParameter

TIER_HEADER = "X-LLMQueue-Tier"
SERVICE_TIERS = ("auto", "default", "flex", "priority")


def caller_on_tier(
    caller: Callable[[bool], Caller], service_tier: Any, header: str | None
) -> Caller:
    """`choose_tier` for the cached caller (`caller(False)`); a refusal looks at the database
    first (`caller(True)`): a tier the admin has just allowed is not refused for the cache's
    TTL, which an admitted request's config-version check would have cut short."""
    try:
        return choose_tier(caller(False), service_tier, header)
    except Forbidden:
        return choose_tier(caller(True), service_tier, header)


def choose_tier(caller: Caller, service_tier: Any, header: str | None) -> Caller:
    """`caller` with its request on the tier it asked for (or unchanged: its default tier)."""
    name = requested_tier(caller, service_tier, header)
    tier = caller.tier_named(name) if name else None
    if tier is None or tier.name == caller.tier_name:
        return caller
    if tier.name not in caller.allowed_tiers:
        allowed = ", ".join(sorted(caller.allowed_tiers))
        raise Forbidden(
            f"Tenant {caller.tenant_name!r} may not use tier {tier.name!r}; its tiers: {allowed}.",
            code="tier_not_allowed",
        )
    return caller.on_tier(tier)


def requested_tier(caller: Caller, service_tier: Any, header: str | None) -> str | None:
    """The tier named by the header or the field (they must agree); None for the default."""
    by_header = tier_of_header(caller, header) if header is not None else None
    by_field = tier_of_service_tier(caller, service_tier) if service_tier is not None else None
    if by_header and by_field and by_header != by_field:
        raise InvalidParameter(
            f"{TIER_HEADER} names tier {by_header!r} but 'service_tier' {service_tier!r} "
            f"picks tier {by_field!r}: send one, or both naming the same tier.",
            code="conflicting_tier",
            param="service_tier",
        )
    return by_header or by_field


def tier_of_header(caller: Caller, header: str) -> str:
    name = header.strip()
    if caller.tier_named(name) is None:
        known = ", ".join(t.name for t in caller.tiers)
        raise InvalidParameter(
            f"{TIER_HEADER}: there is no tier {name!r}; tiers: {known}.",
            code="tier_not_found",
            param=TIER_HEADER,
        )
    return name


def tier_of_service_tier(caller: Caller, value: Any) -> str | None:
    if not isinstance(value, str) or value not in SERVICE_TIERS:
        raise InvalidParameter(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}; got {value!r}.",
            code="invalid_service_tier",
            param="service_tier",
        )
    tier = next((t for t in caller.tiers if value != "auto" and t.service_tier == value), None)
    if tier is None and value in ("flex", "priority"):
        raise InvalidParameter(
            f"No tier serves service_tier {value!r} here (an admin marks one in the tier's "
            "settings); send 'auto' or 'default', or name a tier in " + TIER_HEADER + ".",
            code="service_tier_unavailable",
            param="service_tier",
        )
    return None if tier is None else tier.name


def on_bulk_tier(caller: Caller, name: str | None = None) -> Caller:
    """`caller` on the tier a bulk job runs on: the one `name` names (403 if the tenant may not
    use it), else the flex tier when the tenant may use one (OpenAI's tier for work that can
    wait), else its default tier."""
    if name:
        return choose_tier(caller, None, name)
    flex = next(
        (t for t in caller.tiers if t.service_tier == "flex" and t.name in caller.allowed_tiers),
        None,
    )
    return caller if flex is None else caller.on_tier(flex)

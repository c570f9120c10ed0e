"""The demo's setup steps: the database, Redis, the tiny model, the tenant and the admin user."""

from __future__ import annotations

import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection

from devtools.demo_prompts import MODEL_NAME
from devtools.embedded_redis import (
    EmbeddedRedisError,
    local_port,
    redact,
    start_embedded_redis,
)
from devtools.tiny_model import build_tiny_model
from workers.processes import Child

POOL = "default"
TENANT = "demo"
ADMIN_USER = "admin"


class DemoError(RuntimeError):
    """A demo step failed; the message says which and why."""


def say(message: str) -> None:
    print(message, flush=True)


def state_dir() -> Path:
    return Path(settings.STATE_DIR)


def migrate_database() -> None:
    db = settings.DATABASES["default"]
    say(f"[1/7] migrating the database ({connection.vendor}: {db['NAME']})")
    call_command("migrate", interactive=False, verbosity=0)


def redis_data_dir(url: str) -> Path:
    # One folder per port: a second embedded server (e.g. the test's) never shares AOF files.
    return state_dir() / "redis" / str(local_port(url) or "remote")


def ensure_redis(children: list[Child]) -> None:
    url = settings.REDIS_URL
    data_dir = redis_data_dir(url)
    try:
        child = start_embedded_redis(url, data_dir, master=settings.REDIS_SENTINEL_MASTER)
    except EmbeddedRedisError as exc:
        raise DemoError(str(exc)) from exc
    if child is None:
        say(f"[2/7] Redis answers at {redact(url)}")
    else:
        say(f"[2/7] started an embedded Redis at {url} (pid {child.pid}, AOF in {data_dir})")
        children.append(child)


def build_model() -> Path:
    path = state_dir() / "models" / MODEL_NAME
    say(f"[3/7] tiny local model at {path}")
    return build_tiny_model(path)


def seed_tenant() -> str:
    """Tiers, the served model and the demo tenant; returns a new API key for it."""
    from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers, ensure_served_model

    tiers = ensure_default_tiers()
    ensure_served_model(name=MODEL_NAME, pool=POOL, context_length=2048, max_tokens=512)
    # Room for the whole burst at once, whatever the tenant defaults are.
    tenant, key = create_tenant_with_key(
        TENANT, tiers["interactive"], requests_per_second=100.0, burst=100
    )
    tenant.allowed_tiers.add(tiers["batch"])  # `"service_tier": "flex"` runs on batch
    say(f"[4/7] tiers {', '.join(tiers)}; model {MODEL_NAME!r} on pool {POOL!r}; tenant {TENANT!r}")
    return key


def ensure_admin_user() -> str | None:
    """Create the admin superuser with a random password (returned once); None if it exists."""
    users = get_user_model()
    if users.objects.filter(username=ADMIN_USER).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(ADMIN_USER, "", password)
    return password

"""API keys: creation (plaintext shown once, SHA-256 stored), revocation, lookup by hash."""

from __future__ import annotations

import hashlib
import secrets

from django.utils import timezone

from llmqueue.models import ApiKey, Tenant

KEY_PREFIX = "lq-"
VISIBLE_PREFIX_CHARS = 11


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def assign_new_secret(key: ApiKey) -> str:
    """Give an unsaved key a fresh secret; returns the plaintext, which is never stored."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key.prefix = plaintext[:VISIBLE_PREFIX_CHARS]
    key.key_hash = hash_key(plaintext)
    return plaintext


def create_api_key(tenant: Tenant, name: str = "") -> tuple[ApiKey, str]:
    """Create a key for `tenant`; the plaintext is returned here and never stored."""
    key = ApiKey(tenant=tenant, name=name)
    plaintext = assign_new_secret(key)
    key.save()
    return key, plaintext


def revoke_api_key(key: ApiKey) -> None:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])

"""Test settings: the project's settings with a dedicated Redis DB and fast redelivery.

Set through the environment before project.settings reads it, so worker subprocesses started by
tests (which inherit DJANGO_SETTINGS_MODULE=tests.settings) see exactly the same values.
"""

import os

os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/11")
os.environ.setdefault("SECRET_KEY", "tests-only-secret-key-not-for-production-use-0123456789")
# Seconds, not an hour: the SIGKILL test shows redelivery of a dead worker's messages.
os.environ.setdefault("LLMQUEUE_VISIBILITY_TIMEOUT_SECONDS", "8")
os.environ.setdefault("LLMQUEUE_UNACKED_RESTORE_INTERVAL_SECONDS", "1")
os.environ.setdefault("LLMQUEUE_AUTH_CACHE_SECONDS", "1")
os.environ.setdefault("LLMQUEUE_WORKER_HEARTBEAT_SECONDS", "0.5")
os.environ.setdefault("LLMQUEUE_WORKER_STALE_SECONDS", "3")
# The reconciler's timings shrunk to match: a lost message is republished within ~3 s.
os.environ.setdefault("LLMQUEUE_RECONCILE_INTERVAL_SECONDS", "0.5")
os.environ.setdefault("LLMQUEUE_RECONCILE_GRACE_SECONDS", "2")
os.environ.setdefault("LLMQUEUE_RECONCILE_CONFIRM_SECONDS", "1")

from project.settings import *  # noqa: F403

# Uploaded and rendered batch files of tests stay apart from the demo's.
MEDIA_ROOT = STATE_DIR / "test-media"  # noqa: F405

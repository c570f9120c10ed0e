"""GET /health: 200 while this process reaches Redis, the JSON 503 once it cannot."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import Client

from llmqueue.redis_client import get_redis
from workers.processes import free_port


@pytest.fixture
def fresh_client() -> Iterator[None]:
    get_redis.cache_clear()
    yield
    get_redis.cache_clear()


def test_health_answers_ok_while_redis_answers(clean_redis, fresh_client):
    response = Client().get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_health_is_a_json_503_when_redis_is_unreachable(settings, fresh_client):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    response = Client().get("/health")
    assert response.status_code == 503
    assert response.json() == {
        "error": {
            "message": "Redis is unreachable from this API process.",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }
    }


def test_health_refuses_other_methods(clean_redis, fresh_client):
    assert Client().post("/health").status_code == 405

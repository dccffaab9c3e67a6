"""Real services for tests: a private redis-server on a free loopback port, started once per
test session and stopped at its end. Imported by conftest.py as a pytest plugin."""
from __future__ import annotations

import pytest

from deploy.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url

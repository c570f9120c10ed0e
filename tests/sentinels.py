"""A Redis Sentinel deployment of a test's own: the Stack's server as master, a replica and three
sentinels on free ports, and every child of the stack pointed at the sentinels (REDIS_URL
`sentinel://…;…`, REDIS_SENTINEL_MASTER); each process is stopped by PID with the stack."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from contract.redis_url import connect
from devtools.embedded_redis import server_argv, server_binary
from tests.conftest import wait_until
from tests.stack import Stack, alive
from workers.processes import free_port

MASTER = "llmqueue-test"
SENTINELS = 3
QUORUM = 2  # two sentinels agree the master is down; a majority (two) elects the leader
# A master unanswering for 1 s is down; a failover that stalls is tried again after 2 × 5 s.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


def info(client: redis.Redis, section: str = "replication") -> dict[str, Any]:
    return dict(client.info(section))


@dataclass
class SentinelStack(Stack):
    """A Stack whose children find Redis through sentinels; `redis_port` is the first master."""

    replica_port: int = field(default_factory=free_port)
    sentinel_ports: tuple[int, ...] = field(
        default_factory=lambda: tuple(free_port() for _ in range(SENTINELS))
    )

    @property
    def sentinel_url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{port}/0" for port in self.sentinel_ports)

    def env(self) -> dict[str, str]:
        return super().env() | {"REDIS_URL": self.sentinel_url, "REDIS_SENTINEL_MASTER": MASTER}

    def client(self, **kwargs: object) -> redis.Redis:
        """A client of whichever server the sentinels call the master now."""
        return connect(self.sentinel_url, MASTER, **kwargs)

    def server(self, port: int) -> redis.Redis:
        """A client of the one server on `port` (no sentinel in between)."""
        return redis.Redis(port=port, socket_timeout=5)

    def master_port(self, sentinel_index: int = 0) -> int:
        """The master's port as the sentinel `sentinel_index` answers it."""
        sentinel = self.server(self.sentinel_ports[sentinel_index])
        address: Any = sentinel.sentinel_get_master_addr_by_name(MASTER)
        return int(address[1])

    def start_replica(self) -> subprocess.Popen[bytes]:
        """A replica of the first master, with data of its own; returns once it is in sync."""
        data_dir = self.tmp / "replica"
        data_dir.mkdir(exist_ok=True)
        argv = [
            *server_argv(server_binary(), self.replica_port, data_dir),
            "--save", "", "--replicaof", "127.0.0.1", str(self.redis_port),
        ]  # fmt: skip
        process = self.spawn("replica", argv, ports=(self.replica_port,))
        replica = self.server(self.replica_port)

        def in_sync() -> bool:
            alive(process, "replica")
            try:
                return info(replica).get("master_link_status") == "up"
            except redis.ConnectionError:
                return False

        wait_until(in_sync, 15, f"the replica on port {self.replica_port}")
        return process

    def start_sentinels(self) -> list[subprocess.Popen[bytes]]:
        """The sentinels, watching the first master; returns once each one knows the replica
        and the other sentinels (without them it could not fail over)."""
        started = [self._start_sentinel(port) for port in self.sentinel_ports]

        def acquainted() -> bool:
            for process, port in zip(started, self.sentinel_ports, strict=True):
                alive(process, f"sentinel {port}")
                sentinel = self.server(port)
                try:
                    replicas: Any = sentinel.sentinel_slaves(MASTER)
                    others: Any = sentinel.sentinel_sentinels(MASTER)
                except redis.ConnectionError:
                    return False
                if len(replicas) != 1 or len(others) != SENTINELS - 1:
                    return False
            return True

        # The sentinels find each other through the master's hello channel, every 2 s.
        wait_until(acquainted, 30, "the sentinels to know the replica and each other")
        return started

    def _start_sentinel(self, port: int) -> subprocess.Popen[bytes]:
        # A sentinel rewrites its config file as it learns the group: one file each.
        conf = self.tmp / f"sentinel-{port}.conf"
        conf.write_text(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    f"dir {self.tmp}",
                    f"sentinel monitor {MASTER} 127.0.0.1 {self.redis_port} {QUORUM}",
                    f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}",
                    "",
                ]
            )
        )
        argv = [str(server_binary()), str(conf), "--sentinel"]
        return self.spawn(f"sentinel-{port}", argv, ports=(port,))


@pytest.fixture(name="sentinel_stack")
def sentinel_stack_fixture(transactional_db: None, tmp_path: Path) -> Iterator[SentinelStack]:
    """Import it as `sentinel_stack_fixture` where a test takes a `sentinel_stack`."""
    started = SentinelStack(tmp_path)
    try:
        yield started
    finally:
        # Before transactional_db flushes the tables the children still use.
        started.stop_all()

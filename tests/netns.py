"""Hosts on one machine for partition tests: network namespaces on a bridge, each link cut at will.

Each host is a network namespace with its own loopback and one veth pair; the pair's other end is
a port of a bridge in this (the root) namespace, which holds the network's first address. A
server started here on that address (the test's Redis, a relay to the database) is what every
host reaches over its link. Cutting a host sets the bridge's end of its link down: the host's
packets are dropped silently from then on (the neighbour entries are fixed, so no failed ARP
tells a sender the host is unreachable), as in a partition beyond the first router: no reset
on its open connections, new ones time out. Healing sets the link up again. Names carry a
random tag, so parallel runs and a crashed run's leftovers never clash; `Network.remove`
deletes what it made.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

import pytest

SUBNET_PREFIX = "10.231"  # 10.231.<n>.0/24, n picked free at build time


@dataclass(frozen=True)
class Host:
    """Where a child process runs: a network namespace (None: this one) and the address it
    serves on there."""

    address: str = "127.0.0.1"
    netns: str | None = None

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace (`ip netns exec` execs it: same PID)."""
        return argv if self.netns is None else ["ip", "netns", "exec", self.netns, *argv]


LOCAL = Host()


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)
    return done.stdout


def mac(device: str, netns: str | None = None) -> str:
    where = [] if netns is None else ["-n", netns]
    return str(json.loads(ip(*where, "-j", "link", "show", "dev", device))[0]["address"])


def require_namespaces() -> None:
    """Skip (locally) or fail (under CI, which must run it) unless this process may build
    namespaces: root and iproute2's `ip`."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    if shutil.which("ip") is None:
        missing.append("iproute2's `ip`")
    if not missing:
        return
    reason = f"network namespaces need {' and '.join(missing)}"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(f"{reason} (CI runs this test)")


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(
        ["ip", "-4", "-o", "route", "show", "table", "all"],
        check=True,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    found = []
    for line in out.splitlines():
        words = line.split()
        target = words[1] if words[0] in {"local", "broadcast", "unicast"} else words[0]
        try:
            found.append(ipaddress.IPv4Network(target, strict=False))
        except ValueError:
            continue  # "default", "unreachable …"
    return found


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that no route of this machine overlaps (another run's network)."""
    used = [n for n in _used_networks() if n.prefixlen > 0]
    start = uuid.uuid4().int % 256
    for i in range(256):
        candidate = ipaddress.IPv4Network(f"{SUBNET_PREFIX}.{(start + i) % 256}.0/24")
        if not any(candidate.overlaps(n) for n in used):
            return candidate
    raise RuntimeError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16")


@dataclass
class Network:
    """A bridge here and the hosts linked to it; `address` is this namespace's on the bridge."""

    tag: str = field(default_factory=lambda: f"lq{uuid.uuid4().hex[:6]}")
    subnet: ipaddress.IPv4Network = field(default_factory=free_subnet)
    hosts: dict[str, Host] = field(default_factory=dict)
    _links: dict[str, str] = field(default_factory=dict)  # host name → the bridge's end
    _built: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def address(self) -> str:
        return str(self.subnet.network_address + 1)

    def build(self) -> None:
        """The bridge, up, with this namespace's address."""
        ip("link", "add", self.bridge, "type", "bridge")
        self._built = True
        # Its own MAC, set: a bridge otherwise takes the lowest of its ports', so adding a host
        # could change it under the neighbour entries the hosts before were given.
        local_mac = "02:" + ":".join(f"{b:02x}" for b in uuid.uuid4().bytes[:5])
        ip("link", "set", self.bridge, "address", local_mac)
        ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        """A namespace with its loopback up and a link to the bridge (Linux names: 15 chars)."""
        index = len(self.hosts) + 2
        netns, outer, inner = f"{self.tag}-{name}", f"{self.tag}h{index}", f"{self.tag}n{index}"
        address = str(self.subnet.network_address + index)
        ip("netns", "add", netns)
        host = self.hosts[name] = Host(address, netns)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._links[name] = outer
        ip("link", "set", inner, "netns", netns)
        ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inner)
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "link", "set", inner, "up")
        ip("link", "set", outer, "master", self.bridge, "up")
        # Neighbours fixed both ways: a cut link then drops packets silently, as a partition
        # beyond the first router does, instead of failing ARP and telling each sender at
        # once that the host is unreachable.
        bridge_mac, host_mac = mac(self.bridge), mac(inner, netns)
        ip("-n", netns, "neigh", "replace", self.address, "lladdr", bridge_mac, "dev", inner,
           "nud", "permanent")  # fmt: skip
        ip("neigh", "replace", address, "lladdr", host_mac, "dev", self.bridge, "nud", "permanent")
        return host

    def cut(self, name: str) -> None:
        """Drop every packet to and from host `name`; its connections see no reset."""
        ip("link", "set", self._links[name], "down")

    def heal(self, name: str) -> None:
        ip("link", "set", self._links[name], "up")

    def remove(self) -> None:
        """Delete the namespaces (their veth ends go with them, and so the pairs) and the bridge;
        run after the processes in them are stopped."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", str(host.netns)], capture_output=True, timeout=10)
        for link in self._links.values():  # gone with their pair, unless a namespace was not
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        if self._built:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
        self.hosts.clear()
        self._links.clear()
        self._built = False

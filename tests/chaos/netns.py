"""A small network of "hosts" on this machine, made of Linux network namespaces.

    switch namespace: a bridge `br0`
    <prefix>-pg:  Postgres, 10.231.0.10/24
    <prefix>-h1:  a worker host, 10.231.0.11/24   (h2: .12, h3: .13, ...)

Each host namespace has its own loopback and one veth (`eth0`) whose other end (`v-<name>`) is
a port of the bridge in the switch namespace; the root namespace is left alone (the test talks
to Postgres through its Unix socket, which namespaces do not separate). Everything the
topology creates is removed by `close()`, whatever happened.

Faults, from the switch's side:
- `cut(host)`: the host's bridge port goes down, so every packet to and from the host is
  dropped, like a pulled cable: the host's TCP connections are not reset, they go silent;
- `heal(host)`: the port comes back up, the same connections carry on (or have timed out);
- `netem(host, ...)`: delay and loss on what the host sends, with `tc netem`, when the kernel has
  `sch_netem` (`netem_available()`); otherwise the test impairs the host's link in user space
  (`tests/chaos/link_proxy.py`).

Needs root and `ip` (iproute2); `require_namespaces()` raises, saying which is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

import attrs

SUBNET = "10.231.0"
PG_ADDRESS = f"{SUBNET}.10"


class NamespacesUnavailableError(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def require_namespaces() -> None:
    """Raise `NamespacesUnavailableError`, saying why, unless `ip netns add` works here."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailableError(
            "the multi-host test needs `ip` from iproute2 (apt-get install iproute2)"
        )
    if os.geteuid() != 0:
        raise NamespacesUnavailableError(
            "the multi-host test needs root: it creates network namespaces with `ip netns add` "
            "(run the tests as root, as CI does, or in a container with CAP_SYS_ADMIN and "
            "CAP_NET_ADMIN)"
        )
    probe = f"umt-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NamespacesUnavailableError(
            f"`ip netns add` failed here ({made.stderr.strip()}): the multi-host test needs "
            "network namespaces (a container needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        )
    _ip("netns", "del", probe, check=False)


def netem_available() -> bool:
    """Whether the kernel has `sch_netem` (`tc qdisc add ... netem` works)."""
    if shutil.which("tc") is None:
        return False
    probe = f"umt-netem-{os.getpid()}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return done.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


@attrs.define
class Topology:
    """The namespaces of one test: `pg` and the hosts, on one bridge."""

    prefix: str
    hosts: tuple[str, ...]
    made: list[str] = attrs.field(factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def address(self, name: str) -> str:
        if name == "pg":
            return PG_ADDRESS
        return f"{SUBNET}.{11 + self.hosts.index(name)}"

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program in `name`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def create(self) -> None:
        require_namespaces()
        self._add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for name in ("pg", *self.hosts):
            ns = self.namespace(name)
            self._add(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are made in the root namespace and moved at once: nothing stays there.
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"v-{name}",
                "netns",
                self.switch,
            )
            _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"v-{name}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"v-{name}", "up")

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)

    def close(self) -> None:
        """Remove every namespace made (their veths go with them)."""
        errors = []
        for ns in reversed(self.made):
            done = _ip("netns", "del", ns, check=False)
            if done.returncode != 0:
                errors.append(f"{ns}: {done.stderr.strip()}")
        self.made.clear()
        if errors:
            raise RuntimeError(f"could not remove network namespaces: {errors}")

    # -- faults ---------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Drop every packet to and from `name` (its bridge port goes down)."""
        _ip("-n", self.switch, "link", "set", f"v-{name}", "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", f"v-{name}", "up")

    def netem(self, name: str, *options: str) -> None:
        """`tc netem` with `options` on what `name` sends (its `eth0`; needs sch_netem): a
        delay there is added once to every round trip."""
        self._tc(self.namespace(name), "qdisc", "add", "dev", "eth0", "root", "netem", *options)

    def clear_netem(self, name: str) -> None:
        self._tc(self.namespace(name), "qdisc", "del", "dev", "eth0", "root")

    @staticmethod
    def _tc(ns: str, *args: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )

    def run(self, name: str, command: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.exec_prefix(name), *command],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )

"""Several test hosts on one machine: named network namespaces on a private bridge.

One namespace per host and one for the bridge, joined by veth pairs, in a random
``10.200-250.x.0/24`` so that parallel runs do not clash.  Nothing touches the machine's
own namespace, and each fault (cut, partition, lossy or slow link) is undone by its twin.
Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.closing import Closing
from kvpool.testing import lifetime
from kvpool.testing.agent import Agent, kill_group

__all__ = [
    "PREFIX",
    "Topology",
    "netem_missing",
    "remove_namespaces",
    "run_prefix",
]

#: every namespace a Topology makes starts with this
PREFIX = "kvp-"
_BRIDGE = "br0"


def run_prefix() -> str:
    """A fresh ``kvp-<6 hex>-`` for one test run's namespaces."""
    return f"{PREFIX}{uuid.uuid4().hex[:6]}-"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise RuntimeError("ip (iproute2) is not installed: apt-get install iproute2") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")
    return done


def remove_namespaces(prefix: str) -> list[str]:
    """Delete every network namespace whose name starts with ``prefix`` (what a run that
    died left behind); returns their names."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]
    gone = [name for name in names if name.startswith(prefix)]
    for name in gone:
        _ip("netns", "del", name, check=False)
    return gone


def netem_missing() -> str:
    """Why ``tc netem`` cannot be used here ("" when it can): tried on a throwaway
    namespace's ``lo``, so the answer is the kernel's, not a guess."""
    name = f"{run_prefix()}probe"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        done = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        _ip("netns", "del", name, check=False)
    if done.returncode == 0:
        return ""
    return (
        f"tc netem is not available in this kernel ({os.uname().release}: "
        f"{done.stderr.strip() or 'tc failed'}; it needs CONFIG_NET_SCH_NETEM / sch_netem)"
    )


@dataclass(frozen=True)
class _Host:
    name: str
    netns: str
    address: str
    port: str  # its veth end on the bridge


class Topology(Closing):
    """Hosts on one bridge, each in its own network namespace (see the module's doc):
    ``lo`` is up everywhere; the host's end of its veth pair is its ``eth0``, the other
    end a port of the bridge.  Reach a host through :meth:`popen` (servers, each in a
    session of its own) or :meth:`agent` (calls run there over a pipe: pipes cross
    namespaces, sockets do not)."""

    def __init__(self, hosts: Sequence[str], *, prefix: str | None = None) -> None:
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 200:
            raise ValueError(f"hosts must be 1..200 distinct names, got {list(hosts)}")
        self.prefix = prefix or run_prefix()
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.subnet = f"{net}.0/24"
        self.bridge_ns = f"{self.prefix}bridge"
        self.hosts: dict[str, _Host] = {
            name: _Host(name, f"{self.prefix}{name}", f"{net}.{i + 10}", f"p{i}")
            for i, name in enumerate(hosts)
        }
        self._started: list[subprocess.Popen[bytes]] = []
        self._agents: list[Agent] = []
        self._made: list[str] = []
        self._cut: set[str] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self._made.append(br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", br, "link", "set", _BRIDGE, "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.netns)
            self._made.append(host.netns)
            _ip("-n", br, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                "netns", host.netns)  # fmt: skip
            _ip("-n", br, "link", "set", host.port, "master", _BRIDGE, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")

    # ---------------------------------------------------------------------------- hosts
    def address(self, host: str) -> str:
        return self.hosts[host].address

    def command(self, host: str, *argv: str) -> list[str]:
        """``argv`` as a command line that runs on ``host`` (its network namespace)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` in a session of its own; :meth:`close` kills its
        process group if it is still there."""
        proc = lifetime.popen(self.command(host, *argv), start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def agent(
        self, host: str, *, timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> Agent:
        """A Python helper on ``host`` that runs calls there (:class:`Agent`), in a
        session of its own; :meth:`close` stops it."""
        agent = Agent.start(
            self.command(host),
            name=f"the agent on {host}",
            log_prefix=f"kvpool-agent-{host}-",
            timeout_s=timeout_s,
            env=env or {},
            own_session=True,
        )
        self._agents.append(agent)
        return agent

    # ---------------------------------------------------------------------------- faults
    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its bridge port goes down (both ends lose carrier, every
        packet to and from the host is lost)."""
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[host].port, "down")
        self._cut.add(host)

    def restore(self, host: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[host].port, "up")
        self._cut.discard(host)

    def _blackhole(self, at: str, to: str, verb: str) -> None:
        # a route through a neighbour nobody answers for: ARP for it never resolves, so
        # packets are lost and connects time out (a "blackhole" route would fail them at
        # once with EINVAL, which no real partition does)
        ghost = self.subnet.rsplit(".", 1)[0] + ".254"
        _ip("-n", self.hosts[at].netns, "route", verb, f"{self.address(to)}/32", "via", ghost,
            check=verb == "add")  # fmt: skip

    def partition(self, a: str, b: str) -> None:
        """``a`` and ``b`` stop reaching each other; both still reach every other host."""
        self._blackhole(a, b, "add")
        self._blackhole(b, a, "add")

    def heal(self, a: str, b: str) -> None:
        self._blackhole(a, b, "del")
        self._blackhole(b, a, "del")

    def _tc(self, netns: str, *argv: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", netns, "tc", *argv], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"tc {' '.join(argv)} in {netns}: {done.stderr.strip()}")

    def _both_ends(self, host: str) -> list[tuple[str, str]]:
        h = self.hosts[host]
        return [(h.netns, "eth0"), (self.bridge_ns, h.port)]

    def impair(self, host: str, *, delay_ms: int, loss_pct: float) -> None:
        """Delay and lose packets both ways on ``host``'s link (``tc netem``); raises
        RuntimeError naming :func:`netem_missing`'s reason where the kernel lacks it."""
        for netns, dev in self._both_ends(host):
            self._tc(netns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                     f"{delay_ms}ms", "loss", f"{loss_pct}%")  # fmt: skip

    def throttle(self, host: str, *, rate_kbit: int, queue_bytes: int) -> None:
        """Shape ``host``'s link both ways to ``rate_kbit`` with a queue of
        ``queue_bytes``: what does not fit waits, then is dropped (``tc tbf``, which kernels
        without netem usually still have)."""
        for netns, dev in self._both_ends(host):
            self._tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                     f"{rate_kbit}kbit", "burst", "16kb", "limit", str(queue_bytes))  # fmt: skip

    def unimpair(self, host: str) -> None:
        for netns, dev in self._both_ends(host):
            with contextlib.suppress(RuntimeError):  # nothing to remove
                self._tc(netns, "qdisc", "del", "dev", dev, "root")

    # -------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop the agents, kill what :meth:`popen` started (by process group), and delete
        every namespace."""
        for agent in reversed(self._agents):
            agent.close()
        self._agents.clear()
        for proc in reversed(self._started):
            kill_group(proc, grace_s=10.0)
        self._started.clear()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

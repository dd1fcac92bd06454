"""Several test hosts on one machine: named network namespaces on a private bridge.

A :class:`Topology` makes one network namespace per host (``kvp-<run>-<host>``) and one
more for a Linux bridge that joins them, each host by a veth pair: the host's end is its
``eth0`` with a test address in a random ``10.200-250.x.0/24`` (parallel runs do not
clash), the other end a port of the bridge.  ``lo`` is up everywhere.  Nothing touches
the machine's own namespace: a process there cannot reach these addresses, so the test
talks to its hosts through processes it starts inside them -- :meth:`Topology.popen`
for servers (each in a session of its own), :meth:`Topology.agent` for a Python helper
that runs calls there over a pipe (pipes cross namespaces, sockets do not).

Faults, each undone by its twin:

- :meth:`~Topology.cut` / :meth:`~Topology.restore`: the host's bridge port goes down
  (a pulled cable: both ends lose carrier, every packet to and from the host is lost).
- :meth:`~Topology.partition` / :meth:`~Topology.heal`: ``a`` and ``b`` stop reaching
  each other while both still reach everyone else (routes to a neighbour that does not
  exist, so packets vanish as in a real partition: connects time out, they are not
  refused).
- :meth:`~Topology.impair` / :meth:`~Topology.unimpair`: loss and delay on a host's link
  with ``tc netem`` -- only where the kernel has it (:func:`netem_missing` says why
  not); :meth:`~Topology.throttle` shapes the link with ``tbf`` (a slow link with a short
  queue: packets queue, then drop), which kernels without netem usually still have.

:meth:`Topology.close` (``with``) kills what was started, by process group, and deletes
every namespace; :func:`remove_namespaces` deletes whatever a crashed run left under its
prefix (a session finalizer calls it).  Everything needs root and iproute2 (``ip``,
``tc``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.connection as mpc
import os
import random
import subprocess
import sys
import tempfile
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.errors import PeerTimeout
from kvpool.testing.mooncake import kill_group

__all__ = [
    "PREFIX",
    "Agent",
    "AgentRef",
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
    """Hosts on one bridge, each in its own network namespace (see the module's doc)."""

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
        proc = subprocess.Popen(self.command(host, *argv), start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def agent(
        self, host: str, *, timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> Agent:
        """A Python helper on ``host`` that runs calls there (:class:`Agent`)."""
        agent = Agent(self, host, timeout_s=timeout_s, env=env)
        self._agents.append(agent)
        return agent

    # ---------------------------------------------------------------------------- faults
    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its bridge port goes down."""
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
        ``queue_bytes``: what does not fit waits, then is dropped (``tc tbf``)."""
        for netns, dev in self._both_ends(host):
            self._tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                     f"{rate_kbit}kbit", "burst", "16kb", "limit", str(queue_bytes))  # fmt: skip

    def unimpair(self, host: str) -> None:
        for netns, dev in self._both_ends(host):
            with contextlib.suppress(RuntimeError):  # nothing to remove
                self._tc(netns, "qdisc", "del", "dev", dev, "root")

    # -------------------------------------------------------------------------- teardown
    def close(self) -> None:
        for agent in reversed(self._agents):
            agent.close()
        self._agents.clear()
        for proc in reversed(self._started):
            kill_group(proc, grace_s=10.0)
        self._started.clear()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()


# ---------------------------------------------------------------------------- the agent
@dataclass(frozen=True)
class AgentRef:
    """An object kept in an agent, passed back to it as an argument."""

    handle: int


class Agent(Closing):
    """A Python process on one host that runs calls there: ``run("pkg.mod:func", ...)``
    calls a function, ``new(...)`` keeps what it returns (an :class:`AgentRef`),
    ``call(ref, method, ...)`` calls a method of it.  Results and exceptions come back
    pickled; every answer is awaited at most ``timeout_s``."""

    def __init__(
        self, topology: Topology, host: str, *, timeout_s: float, env: dict[str, str] | None
    ) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix=f"kvpool-agent-{host}-", suffix=".log"
        )
        ours, theirs = mpc.Pipe()
        code = "import sys; from kvpool.testing.netns import _serve; _serve(int(sys.argv[1]))"
        try:
            argv = topology.command(host, sys.executable, "-c", code, str(theirs.fileno()))
            self.proc = subprocess.Popen(
                argv,
                pass_fds=[theirs.fileno()],
                env={**os.environ, **(env or {})},
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._conn = ours
        try:
            self.run("os:getpid")
        except BaseException:
            self.close()
            raise

    @property
    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-8000:]

    def _ask(self, *message: Any) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the agent on {self.host} exited ({self.proc.returncode}):\n{self.log}"
            )
        self._conn.send(message)
        if not self._conn.poll(self.timeout_s):
            raise PeerTimeout(f"no answer from the agent on {self.host} in {self.timeout_s} s")
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the agent on {self.host} died:\n{self.log}") from None
        if not ok:
            raise value
        return value

    def run(self, target: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask("run", target, args, kwargs)

    def new(self, target: str, *args: Any, **kwargs: Any) -> AgentRef:
        return AgentRef(self._ask("new", target, args, kwargs))

    def call(self, ref: AgentRef, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", ref.handle, (method, *args), kwargs)

    def close(self) -> None:
        if self._conn.closed:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(("stop", None, (), {}))
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_group(self.proc, grace_s=5.0)
        self._conn.close()
        self._log.close()


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _serve(fd: int) -> None:
    """The agent's loop: answer calls until "stop" (or EOF), then close what it kept."""
    conn = mpc.Connection(fd)
    kept: dict[int, Any] = {}

    def deref(value: Any) -> Any:
        return kept[value.handle] if isinstance(value, AgentRef) else value

    while True:
        try:
            op, what, args, kwargs = conn.recv()
        except EOFError:
            break
        if op == "stop":
            break
        try:
            args = tuple(deref(a) for a in args)
            kwargs = {k: deref(v) for k, v in kwargs.items()}
            if op == "call":
                method, *rest = args
                result = getattr(kept[what], method)(*rest, **kwargs)
            else:
                result = _resolve(what)(*args, **kwargs)
                if op == "new":
                    kept[len(kept) + 1] = result
                    result = len(kept)
            conn.send((True, result))
        except BaseException as exc:  # the caller gets it
            traceback.print_exc()
            try:
                conn.send((False, exc))
            except Exception:
                conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    for value in reversed(list(kept.values())):
        close = getattr(value, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
    conn.close()

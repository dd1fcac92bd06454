"""A kvpool cluster across test hosts: a master host, storage-node hosts, a client host.

:func:`start_kvpool` is the one place a master or node process of this suite starts, and
what every one of them is given goes there: the run's cluster secret
(:func:`cluster_env`), since a master or node bound to a 10.x address refuses to start
without a credential (docs/security.md).  Each process
runs on its host through :meth:`Topology.popen <kvpool.testing.netns.Topology.popen>`,
logs to a file under the test's tmp dir, and is ready when its "listening on" line is
written (waited for, bounded).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.testing.agent import Agent, Ref
from kvpool.testing.netns import Topology

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = 50051

# The configured timeouts every bound of the suite is derived from.
CLIENT_TIMEOUT_S = 2.0  # kvpool.Client(timeout_s=...): connect and every transfer
NODE_TIMEOUT_MS = 2000  # the nodes' connect_timeout_ms and transfer_timeout_ms
CLIENT_TTL_S = 4  # master --client_ttl: silence after which a node is dropped
HEARTBEAT_S = 1.0  # the master's heartbeat interval (its default)


def cluster_env(log_dir: Path) -> dict[str, str]:
    """The environment that gives a process this run's cluster secret (one file per log
    dir, made on first use, readable by its owner only, as kvpool demands)."""
    path = log_dir / "cluster.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    return {"KVPOOL_SECRET_FILE": str(path)}


@dataclass
class HostProcess:
    """A kvpool process on a test host and its log."""

    host: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            found = rx.search(self.log())
            if found:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = "exited" if self.proc.poll() is not None else f"silent {timeout_s} s"
                raise AssertionError(
                    f"{self.host}: no {pattern!r} ({state}):\n{self.log()[-4000:]}"
                )
            time.sleep(0.05)


def start_kvpool(
    topology: Topology, host: str, argv: list[str], log_dir: Path, *, ready_timeout_s: float = 60.0
) -> HostProcess:
    """``python -m kvpool <argv>`` on ``host``, waited for until it listens."""
    log_path = log_dir / f"{host}.log"
    with open(log_path, "ab") as log:
        proc = topology.popen(
            host,
            [sys.executable, "-m", "kvpool", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **cluster_env(log_dir)},
        )
    process = HostProcess(host, proc, log_path)
    process.wait_for(r"listening on", ready_timeout_s)
    return process


def node_config(path: Path, topology: Topology, host: str, size: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "local_hostname": topology.address(host),
                "metadata_server": f"{topology.address('master')}:{MASTER_PORT}",
                "protocol": "tcp",
                "global_segment_size": size,
                "connect_timeout_ms": NODE_TIMEOUT_MS,
                "transfer_timeout_ms": NODE_TIMEOUT_MS,
            }
        )
    )
    return path


@dataclass
class Cluster:
    """The hosts, the processes on them, and a client on the client host."""

    topology: Topology
    master: HostProcess
    nodes: dict[str, HostProcess]
    agent: Agent
    client: Ref
    log_dir: Path
    node_addresses: dict[str, str] = field(default_factory=dict)  # host -> data address

    @property
    def master_address(self) -> str:
        return f"{self.topology.address('master')}:{MASTER_PORT}"

    def on_client(self, func: str, *args: object) -> object:
        """``tests.multihost.client_side.<func>(client, *args)`` on the client host."""
        return self.agent.run(f"tests.multihost.client_side:{func}", self.client, *args)

    def new_client(self) -> Ref:
        return self.agent.new(
            "tests.multihost.client_side:open_client", self.master_address, CLIENT_TIMEOUT_S
        )

    def logs(self) -> str:
        parts = [f"--- {p.host}\n{p.log()[-3000:]}" for p in [self.master, *self.nodes.values()]]
        return "\n".join(parts)


def start_cluster(topology: Topology, log_dir: Path, node_size: str = "64MiB") -> Cluster:
    """A master (no memory of its own: every object lands on a node), a node on each
    ``node*`` host, and a client on ``client``; waits until both nodes registered."""
    master = start_kvpool(
        topology,
        "master",
        ["master", "--host", topology.address("master"), "--port", str(MASTER_PORT),
         "--client_ttl", str(CLIENT_TTL_S), "--segment_size", "0"],
        log_dir,
    )  # fmt: skip
    nodes = {}
    for host in (h for h in topology.hosts if h.startswith("node")):
        config = node_config(log_dir / f"{host}.json", topology, host, node_size)
        nodes[host] = start_kvpool(topology, host, ["node", "--config", str(config)], log_dir)
    agent = topology.agent("client", env={"PYTHONPATH": str(REPO), **cluster_env(log_dir)})
    address = f"{topology.address('master')}:{MASTER_PORT}"
    client = agent.new("tests.multihost.client_side:open_client", address, CLIENT_TIMEOUT_S)
    cluster = Cluster(topology, master, nodes, agent, client, log_dir)
    deadline = time.monotonic() + 30
    while len(cluster.on_client("nodes")) < len(nodes):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, f"nodes did not register:\n{cluster.logs()}"
        time.sleep(0.1)
    for host, proc in nodes.items():
        cluster.node_addresses[host] = proc.wait_for(r"listening on (\S+),", 1).group(1)
    return cluster

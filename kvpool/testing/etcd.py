"""Real etcd for tests and benchmarks: Debian's ``etcd`` on 127.0.0.1 (or a namespace's
address), free ports, its own data directory, stopped by its own PID."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvpool.closing import Closing
from kvpool.net import free_port
from kvpool.testing import lifetime

__all__ = ["EtcdCluster", "EtcdMember", "etcd_binary", "free_port"]


def etcd_binary() -> str:
    """The etcd server (scripts/setup.sh installs Debian's ``etcd-server``)."""
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd is not installed: run scripts/setup.sh (Debian's etcd-server)")
    return found


class EtcdMember(Closing):
    """One etcd member; ``prefix`` runs it elsewhere (``ip netns exec NAME``)."""

    def __init__(
        self,
        name: str,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        initial_cluster: str = "",
        prefix: Sequence[str] = (),
    ) -> None:
        self.name, self.host = name, host
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.data_dir = data_dir
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.prefix = tuple(prefix)
        self.log_path = data_dir.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> EtcdMember:
        argv = [
            *self.prefix, etcd_binary(), "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "kvpool-test",
            # short elections: a member lost is noticed in a second, not five
            "--heartbeat-interval", "100", "--election-timeout", "1000",
        ]  # fmt: skip
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = lifetime.popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=1.0) as reply:
                return b'"true"' in reply.read()
        except (OSError, http.client.HTTPException):
            return False

    def wait_healthy(self, timeout_s: float = 30.0) -> EtcdMember:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd {self.name} not healthy in {timeout_s}s")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None:
            lifetime.stop(self.proc)


class EtcdCluster(Closing):
    """``size`` members on 127.0.0.1, started together, healthy before it returns."""

    def __init__(self, directory: Path, size: int = 1) -> None:
        ports = [(free_port(), free_port()) for _ in range(size)]
        names = [f"e{i}" for i in range(size)]
        initial = ",".join(
            f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports, strict=True)
        )
        self.members = [
            EtcdMember(n, directory / n, client_port=c, peer_port=p, initial_cluster=initial)
            for n, (c, p) in zip(names, ports, strict=True)
        ]
        try:
            for member in self.members:
                member.start()
            for member in self.members:
                member.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> str:
        """``host:port,...``: what ``--etcd_endpoints`` and ``etcd://`` take."""
        return ",".join(m.endpoint for m in self.members)

    def close(self) -> None:
        for member in self.members:
            member.close()

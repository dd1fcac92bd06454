"""Real Mooncake for tests and benchmarks, only ever inside a private network namespace.

Mooncake's listeners bind every interface, so no Mooncake process may run in the machine's
own namespace; the test drives it over a :class:`Namespace` helper's pipe.  Without the
wheel everything raises :class:`MooncakeMissing`: CI installs the extra, so a missing
wheel is a failure, not a skip.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.mooncake.wheel import INSTALL_HINT, wheel_dir
from kvpool.net import http_get
from kvpool.testing import lifetime
from kvpool.testing.agent import Agent, Ref, kill_group

__all__ = [
    "INSTALL",
    "MooncakeMaster",
    "MooncakeMissing",
    "Namespace",
    "Ref",
    "http_json",
    "master_up",
    "mooncake_binary",
    "private_netns",
]

INSTALL = f"{INSTALL_HINT} (scripts/setup.sh does both)"


class MooncakeMissing(RuntimeError):
    """The Mooncake wheel (or ``unshare``) is not installed here."""


def mooncake_binary(
    name: str = "mooncake_master", *, find_spec: Callable[[str], Any] | None = None
) -> Path:
    """A binary the wheel ships inside its package (``mooncake_master``, ...);
    ``find_spec`` stands in for :func:`importlib.util.find_spec` in tests."""
    folder = wheel_dir(find_spec)
    if folder is None:
        raise MooncakeMissing(f"the Mooncake wheel is not installed: {INSTALL}")
    path = folder / name
    if not path.exists():
        raise MooncakeMissing(f"{path} is missing from the Mooncake wheel: {INSTALL}")
    return path


# The network namespace a Namespace was made from, for its helper to compare against
# (a container may not let it read init's /proc/1/ns/net).
_HOST_NETNS_VAR = "KVPOOL_HOST_NETNS"


def _netns(path: str = "/proc/self/ns/net") -> int:
    return os.stat(path).st_ino


def private_netns() -> bool:
    """Whether this process runs in a network namespace other than the machine's (the
    one its :class:`Namespace` was made from, else init's)."""
    try:
        host = os.environ.get(_HOST_NETNS_VAR)
        return _netns() != (int(host) if host else _netns("/proc/1/ns/net"))
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------- the master
def master_up(metrics_address: str, rpc_address: str) -> bool:
    """Whether a ``mooncake_master`` serves both its metrics and its RPC port: its
    metrics server can answer before the RPC listener is bound, and a client that
    connects in between is refused."""
    if http_get(f"http://{metrics_address}/health", 1.0).status != 200:
        return False
    host, _, port = rpc_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


class MooncakeMaster:
    """The wheel's ``mooncake_master`` with the given flags on 127.0.0.1 (RPC
    ``rpc_port``, metrics ``metrics_port``), up once both ports answer (bounded; with
    ``rpc_ready`` False only the metrics port: an ``--enable_ha`` standby binds its RPC
    port only once it leads).  It refuses to start outside a private namespace
    (:func:`private_netns`)."""

    def __init__(
        self,
        *flags: str,
        rpc_port: int = 50051,
        metrics_port: int = 9003,
        log_path: str | None = None,
        ready_timeout_s: float = 30.0,
        rpc_ready: bool = True,
    ) -> None:
        if not private_netns():
            raise RuntimeError(
                "refusing to start mooncake_master outside a private network namespace"
                " (it binds every interface); run it through kvpool.testing.mooncake.Namespace"
            )
        self.rpc_address = f"127.0.0.1:{rpc_port}"
        self.metrics_address = f"127.0.0.1:{metrics_port}"
        argv = [
            str(mooncake_binary()),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            *flags,
        ]
        self.log_path = log_path or os.devnull
        with open(self.log_path, "ab") as log:
            self.proc = lifetime.popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while not (
            master_up(self.metrics_address, self.rpc_address)
            if rpc_ready
            else http_get(f"http://{self.metrics_address}/health", 1.0).status == 200
        ):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start: {' '.join(argv)}")
            time.sleep(0.05)

    def stop(self) -> int:
        lifetime.stop(self.proc)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        self.stop()


# ---------------------------------------------------------------------- the namespace
class Namespace(Closing):
    """A helper process under ``unshare -n`` (a new network namespace with only ``lo``,
    brought up), and calls run there (:class:`~kvpool.testing.agent.Agent`: ``run``,
    ``new``, ``call``, :class:`Ref`).  Other processes join the namespace through
    :meth:`popen` / :meth:`command` (vLLM, ``vllm serve``, ``kvpool proxy`` beside a real
    master); :func:`http_json` run there is how the test reaches their HTTP ports.
    Closing it kills what :meth:`popen` started (each its process group) and ends the
    helper (by its PID), and with them the namespace."""

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        mooncake_binary()  # fail here, with the install hint, not in the helper
        try:
            self._agent = Agent.start(
                ["unshare", "-n"],
                name="the namespace helper",
                log_prefix="kvpool-mooncake-",
                timeout_s=timeout_s,
                env={_HOST_NETNS_VAR: str(_netns())},
                setup=f"{__name__}:_enter",
            )
        except FileNotFoundError:
            raise MooncakeMissing("unshare (util-linux) is not installed") from None
        self._started: list[subprocess.Popen[bytes]] = []

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The helper, whose network namespace this is."""
        return self._agent.proc

    @property
    def log(self) -> str:
        """What the helper and Mooncake wrote (glog lines), for failure messages."""
        return self._agent.log

    def run(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """``module:function(*args, **kwargs)`` called in the namespace."""
        return self._agent.run(target, *args, **kwargs)

    def new(self, target: str, *args: Any, **kwargs: Any) -> Ref:
        """Like :meth:`run`, and keep the result there: a :class:`Ref` to it."""
        return self._agent.new(target, *args, **kwargs)

    def call(self, ref: Ref, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._agent.call(ref, method, *args, **kwargs)

    def command(self, *argv: str) -> list[str]:
        """``argv`` as a command line that runs inside this namespace: ``nsenter`` joins
        the helper's network namespace (only ``lo``), nothing else changes."""
        return ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "--", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the namespace in a session of its own; :meth:`close`
        kills its process group if it is still there (a test that failed halfway)."""
        self.run("os:getpid")  # the namespace is still there
        proc = lifetime.popen(self.command(*argv), start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self._started):
            kill_group(proc)
        self._started.clear()
        self._agent.close()


def _enter() -> None:
    """The helper's first step: bring ``lo`` up, and be sure the namespace is private."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    assert private_netns(), "the helper is not in a private network namespace"


def http_json(url: str, body: Any = None, timeout_s: float = 120.0) -> tuple[int | None, Any]:
    """``(status, decoded JSON or text)`` of a GET (no ``body``) or a JSON POST; status
    None when nothing answered.  Run inside a namespace (``ns.run("kvpool.testing.mooncake:
    http_json", ...)``) to reach a server there."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            status, raw = reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, http.client.HTTPException) as exc:
        return None, str(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")

"""Real Mooncake for tests and benchmarks, only ever inside a private network namespace.

Mooncake's listeners (the Transfer Engine's RPC and data ports, the store's segment
server) bind every interface, so no Mooncake process may run in the machine's own
network namespace.  This module gives tests one way in:

- :class:`Namespace` starts a helper process under ``unshare -n`` (a new, empty network
  namespace with only ``lo``, brought up), and runs calls there over a pipe (pipes cross
  namespaces, sockets do not): ``run("pkg.mod:func", ...)`` calls a function,
  ``new(...)`` keeps the object it returns under a handle, ``call(handle, method, ...)``
  calls a method of it, and :class:`Ref` passes a kept object as an argument.  Results
  and exceptions (kvpool's errors included) come back pickled.  Other processes join the
  namespace through :meth:`Namespace.popen` / :meth:`Namespace.command` (``nsenter`` into
  the helper's namespace: vLLM, ``vllm serve``, ``kvpool proxy`` beside a real master);
  :func:`http_json` run there is how the test reaches their HTTP ports.  Closing the
  namespace kills what :meth:`~Namespace.popen` started (each its process group) and
  ends the helper (by its PID), and with them the namespace.
- :class:`MooncakeMaster` starts the wheel's ``mooncake_master`` with the guide's flags on
  127.0.0.1 and waits (bounded) until its metrics port answers.  It refuses to start
  outside a private namespace (:func:`private_netns`).

The test process itself never opens a Mooncake socket: the engine under test lives in
the helper, and the test talks to it through the pipe.  Without the wheel, everything
here raises :class:`MooncakeMissing` naming the install commands: CI installs the extra,
so a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing.connection as mpc
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.errors import PeerTimeout
from kvpool.net import http_get

__all__ = [
    "INSTALL",
    "MooncakeMaster",
    "MooncakeMissing",
    "Namespace",
    "Ref",
    "http_json",
    "mooncake_binary",
    "private_netns",
]

INSTALL = (
    "pip install 'kvpool[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1) and"
    " apt-get install -y libibverbs1 ibverbs-providers librdmacm1 libnuma1"
    " (scripts/setup.sh does both)"
)


class MooncakeMissing(RuntimeError):
    """The Mooncake wheel (or ``unshare``) is not installed here."""


def mooncake_binary(
    name: str = "mooncake_master", *, find_spec: Callable[[str], Any] | None = None
) -> Path:
    """A binary the wheel ships inside its package (``mooncake_master``, ...);
    ``find_spec`` stands in for :func:`importlib.util.find_spec` in tests."""
    import importlib.util

    spec = (find_spec or importlib.util.find_spec)("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMissing(f"the Mooncake wheel is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / name
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
class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 (RPC ``rpc_port``, metrics ``metrics_port``)."""

    def __init__(
        self,
        *flags: str,
        rpc_port: int = 50051,
        metrics_port: int = 9003,
        log_path: str | None = None,
        ready_timeout_s: float = 30.0,
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
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while http_get(f"http://{self.metrics_address}/health", 1.0).status != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start: {' '.join(argv)}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        self.stop()


# ---------------------------------------------------------------------- the namespace
@dataclass(frozen=True)
class Ref:
    """An object kept in the namespace, passed as an argument."""

    handle: int


class Namespace(Closing):
    """A helper process in its own network namespace, and calls run there."""

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        mooncake_binary()  # fail here, with the install hint, not in the helper
        self.timeout_s = timeout_s
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix="kvpool-mooncake-", suffix=".log"
        )
        ours, theirs = mpc.Pipe()
        code = "import sys; from kvpool.testing.mooncake import _serve; _serve(int(sys.argv[1]))"
        try:
            self.proc = subprocess.Popen(
                ["unshare", "-n", sys.executable, "-c", code, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env={**os.environ, _HOST_NETNS_VAR: str(_netns())},
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        except FileNotFoundError:
            raise MooncakeMissing("unshare (util-linux) is not installed") from None
        finally:
            theirs.close()
        self._conn = ours
        self._started: list[subprocess.Popen[bytes]] = []
        try:
            self.run("os:getpid")  # the helper is up and in its namespace
        except BaseException:
            self.close()
            raise

    @property
    def log(self) -> str:
        """What the helper and Mooncake wrote (glog lines), for failure messages."""
        return Path(self._log.name).read_text(errors="replace")[-8000:]

    def _ask(self, *message: Any) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the namespace helper exited ({self.proc.returncode}):\n{self.log}")
        self._conn.send(message)
        if not self._conn.poll(self.timeout_s):
            raise PeerTimeout(f"no answer from the namespace in {self.timeout_s} s:\n{self.log}")
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the namespace helper died:\n{self.log}") from None
        if not ok:
            raise value
        return value

    def run(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """``module:function(*args, **kwargs)`` called in the namespace."""
        return self._ask("run", target, args, kwargs)

    def new(self, target: str, *args: Any, **kwargs: Any) -> Ref:
        """Like :meth:`run`, and keep the result there: a :class:`Ref` to it."""
        return Ref(self._ask("new", target, args, kwargs))

    def call(self, ref: Ref, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", ref.handle, (method, *args), kwargs)

    def command(self, *argv: str) -> list[str]:
        """``argv`` as a command line that runs inside this namespace: ``nsenter`` joins
        the helper's network namespace (only ``lo``), nothing else changes."""
        return ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "--", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the namespace in a session of its own; :meth:`close`
        kills its process group if it is still there (a test that failed halfway)."""
        self._ask("run", "os:getpid", (), {})  # the namespace is still there
        proc = subprocess.Popen(self.command(*argv), start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def close(self) -> None:
        if self._conn.closed:
            return
        for proc in reversed(self._started):
            kill_group(proc)
        if self.proc.poll() is None:
            try:
                self._conn.send(("stop", None, (), {}))
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._conn.close()
        self._log.close()


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM ``proc``'s process group (a session of its own), then SIGKILL whatever of
    the group is left (vLLM's engine processes may outlive the API server)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(grace_s)


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
    except OSError as exc:
        return None, str(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _serve(fd: int) -> None:
    """The helper's loop: bring ``lo`` up, then answer calls until "stop" (or EOF)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    assert private_netns(), "the helper is not in a private network namespace"
    conn = mpc.Connection(fd)
    kept: dict[int, Any] = {}

    def deref(value: Any) -> Any:
        return kept[value.handle] if isinstance(value, Ref) else value

    while True:
        try:
            op, what, args, kwargs = conn.recv()
        except EOFError:
            op = "stop"
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
        except BaseException as exc:  # the caller gets it, with the helper's traceback
            traceback.print_exc()
            try:
                conn.send((False, exc))
            except Exception:
                conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    for value in reversed(list(kept.values())):
        close = getattr(value, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                traceback.print_exc()
    conn.close()

"""Start kvpool processes for tests and benchmarks: real processes on 127.0.0.1, each with
``--port 0``, awaited (bounded) until it announces its address, stopped by its own PID only.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from kvpool.closing import Closing
from kvpool.testing import lifetime

__all__ = [
    "PoolProcess",
    "node_config",
    "start_master",
    "start_node",
]

_LISTENING = re.compile(r"listening on (?P<host>[\d.]+):(?P<port>\d+)")


class PoolProcess(Closing):
    """A running kvpool subprocess and the address it announced."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 30.0,
        log_path: Path | None = None,
        program: Sequence[str] = (),
    ) -> None:
        """``program`` is what runs ``kvpool``'s arguments (default: this interpreter's
        ``python -m kvpool``); it gets SIGTERM to stop, so it must pass the signal on."""
        self.argv = argv
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = lifetime.popen(
            [*(program or (sys.executable, "-m", "kvpool")), *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        self.lines: deque[str] = deque(maxlen=2000)
        self._new_line = threading.Condition()  # notified per line: waiters never poll
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed in stop
        self._ready = threading.Event()
        self.host = ""
        self.port = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout_s):
            self.stop()
            raise RuntimeError(
                f"kvpool {' '.join(argv)} did not start in {ready_timeout_s}s:\n"
                + "\n".join(self.lines)
            )
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvpool {' '.join(argv)} exited:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._new_line:
                self.lines.append(line.rstrip())
                self._new_line.notify_all()
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            if not self._ready.is_set():
                match = _LISTENING.search(line)
                if match:
                    self.host, self.port = match["host"], int(match["port"])
                    self._ready.set()
        self._ready.set()  # exited: let the waiter see it

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: a crash, no clean-up."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.stop()  # reap the log reader and close the pipe

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
        lifetime.stop(self.proc, timeout_s)
        # a killed process cannot unlink its shared-memory segments: its name carries
        # its PID (kvpool.storage.segment), so what it left is removed by that PID
        for leftover in glob.glob(f"/dev/shm/kvpool-{self.proc.pid}-*"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        self._reader.join(5)
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def close(self) -> None:
        """What ``with`` calls on the way out: :meth:`stop`."""
        self.stop()

    def wait_for_line(self, pattern: str, timeout_s: float = 10.0) -> str:
        """The first logged line matching ``pattern`` (bounded wait)."""
        rx = re.compile(pattern)
        found: list[str] = []

        def matched() -> bool:
            found.extend(line for line in self.lines if rx.search(line))
            return bool(found)

        with self._new_line:
            if self._new_line.wait_for(matched, timeout_s):
                return found[0]
        raise TimeoutError(f"no line matching {pattern!r} in {timeout_s}s")


def start_master(
    *flags: str, env: dict[str, str] | None = None, log_path: Path | None = None
) -> PoolProcess:
    """``kvpool master --port 0 <flags>`` (a free port unless flags name one); its log is
    also appended to ``log_path`` when given."""
    argv = ["master"]
    if not any(f.startswith(("--port", "--port=")) for f in flags):
        argv += ["--port", "0"]
    return PoolProcess([*argv, *flags], env=env, log_path=log_path)


def node_config(directory: Path, master: str, size: str = "16MiB", **extra: object) -> Path:
    """Write ``directory/mooncake.json`` for a node on 127.0.0.1 over TCP that contributes
    ``size`` of memory to the pool at ``master`` (``extra`` adds or overrides keys)."""
    path = directory / "mooncake.json"
    keys: dict[str, object] = {
        "local_hostname": "127.0.0.1",
        "metadata_server": master,
        "protocol": "tcp",
        "global_segment_size": size,
    }
    path.write_text(json.dumps({**keys, **extra}))
    return path


def start_node(config_path: Path, *flags: str, env: dict[str, str] | None = None) -> PoolProcess:
    """``kvpool node`` with ``KVPOOL_CONFIG_PATH`` pointing at ``config_path``."""
    full_env = dict(env or {}, KVPOOL_CONFIG_PATH=str(config_path))
    return PoolProcess(["node", "--data-port", "0", *flags], env=full_env)

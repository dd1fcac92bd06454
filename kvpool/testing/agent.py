"""A Python helper process that runs a test's calls somewhere else, driven over a pipe.

It runs under a command prefix (``unshare -n``, ``ip netns exec NS``) and talks over a
pipe, which crosses network namespaces where sockets do not.  Results and exceptions come
back pickled, each awaited at most ``timeout_s``; on "stop" (or EOF) the helper closes what
it kept, newest first, and exits, or is killed.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.connection as mpc
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvpool.closing import Closing
from kvpool.errors import PeerTimeout
from kvpool.named import resolve
from kvpool.testing import lifetime

__all__ = ["STOP_S", "Agent", "Ref", "kill_group", "serve"]

#: how long a helper told to stop may take to close what it kept before it is killed
STOP_S = 20.0
_CODE = "import sys; from kvpool.testing.agent import serve; serve(int(sys.argv[1]), sys.argv[2])"


@dataclass(frozen=True)
class Ref:
    """An object kept in the helper, passed back to it as an argument."""

    handle: int


class Agent(Closing):
    """The test's end of one helper process (see the module's doc)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        conn: mpc.Connection,
        log: IO[bytes],
        *,
        name: str,
        timeout_s: float,
        own_session: bool,
    ) -> None:
        self.proc = proc
        self.name = name  # "the agent on host-a": how errors name it
        self.timeout_s = timeout_s
        self._conn = conn
        self._log = log
        self._own_session = own_session

    @classmethod
    def start(
        cls,
        prefix: Sequence[str],
        *,
        name: str,
        log_prefix: str,
        timeout_s: float,
        env: Mapping[str, str],
        setup: str = "",
        own_session: bool = False,
    ) -> Agent:
        """Start the helper under ``prefix`` with ``env`` added to ours; it calls ``setup``
        (``"pkg.mod:func"``, if any) first, and is up once it has answered a first call.
        ``own_session``: in a session of its own, killed by process group."""
        log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log")  # noqa: SIM115
        ours, theirs = mpc.Pipe()
        try:
            proc = lifetime.popen(
                [*prefix, sys.executable, "-c", _CODE, str(theirs.fileno()), setup],
                pass_fds=[theirs.fileno()],
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=own_session,
            )
        except BaseException:
            ours.close()
            log.close()
            raise
        finally:
            theirs.close()
        agent = cls(proc, ours, log, name=name, timeout_s=timeout_s, own_session=own_session)
        try:
            agent.run("os:getpid")
        except BaseException:
            agent.close()
            raise
        return agent

    @property
    def log(self) -> str:
        """The end of what the helper wrote, for failure messages."""
        return Path(self._log.name).read_text(errors="replace")[-8000:]

    def _ask(self, *message: Any) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log}")
        self._conn.send(message)
        if not self._conn.poll(self.timeout_s):
            raise PeerTimeout(f"no answer from {self.name} in {self.timeout_s} s:\n{self.log}")
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"{self.name} died:\n{self.log}") from None
        if not ok:
            raise value
        return value

    def run(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """``module:function(*args, **kwargs)`` called in the helper."""
        return self._ask("run", target, args, kwargs)

    def new(self, target: str, *args: Any, **kwargs: Any) -> Ref:
        """Like :meth:`run`, and keep the result there: a :class:`Ref` to it."""
        return Ref(self._ask("new", target, args, kwargs))

    def call(self, ref: Ref, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", ref.handle, (method, *args), kwargs)

    def close(self) -> None:
        if self._conn.closed:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(("stop", None, (), {}))
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self._kill()
        self._conn.close()
        self._log.close()

    def _kill(self) -> None:
        if self._own_session:
            kill_group(self.proc, grace_s=5.0)
        else:
            self.proc.kill()
            self.proc.wait(10)


def kill_group(
    proc: subprocess.Popen[Any], grace_s: float = 20.0, *, leader_first: bool = False
) -> bool:
    """End ``proc`` and its process group (a session of its own): SIGTERM to the group,
    then SIGKILL to whatever of it is left, each wait bounded by ``grace_s``.  With
    ``leader_first``, SIGTERM goes to ``proc`` alone first: a vLLM API server then shuts
    its engine processes down itself and their shared memory goes with them (SIGTERM to
    the whole group at once kills the processes that would unlink it); not for a leader
    such as ``unshare --kill-child``, which answers SIGTERM by SIGKILLing its child.
    Returns whether SIGKILL was needed; then what the group held in /dev/shm is left, and
    the caller removes it (:func:`kvpool.testing.shm.remove_orphans`)."""
    to_group = functools.partial(os.killpg, proc.pid)
    steps: list[tuple[Callable[[int], None], int]] = [
        (to_group, signal.SIGTERM),
        (to_group, signal.SIGKILL),
    ]
    if leader_first:
        steps.insert(0, (proc.send_signal, signal.SIGTERM))
    for send, sig in steps:
        with contextlib.suppress(ProcessLookupError):
            send(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        if _group_gone(proc.pid, grace_s):
            return sig == signal.SIGKILL
    return True


def _group_gone(pgid: int, wait_s: float) -> bool:
    """Whether no process of group ``pgid`` is left within ``wait_s`` (polled)."""
    from kvpool.ops.up.supervisor import group_alive

    deadline = time.monotonic() + wait_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def serve(fd: int, setup: str) -> None:
    """The helper's loop: call ``setup`` (if any), then answer calls on the pipe ``fd``
    until "stop" (or EOF), then close what it kept."""
    if setup:
        resolve(setup)()
    conn = mpc.Connection(fd)
    kept: dict[int, Any] = {}

    def deref(value: Any) -> Any:
        return kept[value.handle] if isinstance(value, Ref) else value

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
                result = resolve(what)(*args, **kwargs)
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

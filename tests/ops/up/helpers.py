"""What the tests of ``kvpool up`` share."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SETUP = "scripts/setup.sh"


def up_argv(command: str) -> list[str]:
    """A docs' ``kvpool up`` command line as argv, to run from the repository root.  Of
    ``scripts/setup.sh && COMMAND`` it is COMMAND: the suite runs after scripts/setup.sh
    (``.ci/run``), and running it again from a test would reinstall the environment the
    test runs in."""
    before, _, after = command.rpartition("&&")
    assert before.strip() in ("", SETUP), command
    argv = shlex.split(after, comments=True)
    assert argv[1:2] == ["up"], command
    return argv


@contextmanager
def reaped(up: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``up`` for the block; if it still runs when the block ends (an assertion failed, a
    wait ran out), it is killed and reaped, so that no test leaves a stack behind."""
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=10)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its (dead) parent counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


# ------------------------------------------------------- private network namespaces
# Mooncake binds every interface, so a test runs each Mooncake process inside a network
# namespace of its own: ``kvpool up`` is started under ``unshare -n`` (only ``lo``, brought
# up), and the test reaches it by running a small client there with ``nsenter``.

NS_CLIENT = """
import json, sys, urllib.error, urllib.request
url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
data = body.encode() if body else None
request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        status, text = reply.status, reply.read().decode()
except urllib.error.HTTPError as exc:
    status, text = exc.code, exc.read().decode()
except OSError as exc:
    status, text = None, repr(exc)
print(json.dumps([status, text]))
"""


def unshared(argv: list[str]) -> list[str]:
    """``argv`` in a new network namespace with ``lo`` up; ``unshare`` execs without a
    fork, so the returned command's pid is the program's own."""
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def ns_http(
    pid: int, url: str, body: object = None, *, timeout_s: float = 30.0
) -> tuple[int | None, str]:
    """GET (or POST ``body`` as JSON) ``url`` from inside the network namespace of ``pid``."""
    payload = "" if body is None else json.dumps(body)
    done = subprocess.run(
        [
            "nsenter",
            f"--net=/proc/{pid}/ns/net",
            sys.executable,
            "-c",
            NS_CLIENT,
            url,
            payload,
            str(timeout_s),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s + 30,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    status, text = json.loads(done.stdout)
    return status, text


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )

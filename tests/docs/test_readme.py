"""README.md, run as written: the test command CI runs, and the pool alone — ``kvpool
master``, the §8.1 ``curl … | grep`` and ``kvpool status`` — with the client snippet
against that master.  (``kvpool up`` and its streamed curl are run by
tests/e2e/test_up_stack.py.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvpool.net import free_port
from kvpool.testing import lifetime
from tests.docs.blocks import ROOT, doc_block
from tests.waiting import wait_until

#: what .ci/run runs after the README's command: a narrowed run of the benches' Mooncake
#: tests, as README.md says
NARROWED = ".venv/bin/python -m pytest -q -p no:cacheprovider tests/bench -k mooncake"


def test_ci_runs_the_readmes_test_command_then_a_narrowed_run() -> None:
    # The suite cannot run itself from inside itself: CI runs this command (.ci/run), so
    # what a test can hold is that .ci/run is this command, after only `set` and `cd`,
    # and then only the narrowed run the README names.
    (command,) = doc_block("readme.test").commands()
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK)
    lines = [line.strip() for line in script.read_text().splitlines()]
    steps = [line for line in lines if line and not line.startswith("#")]
    assert steps[-2:] == [command, NARROWED], steps
    assert all(step.split()[0] in ("set", "cd") for step in steps[:-2]), steps
    assert "`pytest tests/bench -k mooncake`" in (ROOT / "README.md").read_text()


def _fresh_shell_env() -> dict[str, str]:
    """This environment without kvpool's and Mooncake's settings (a secret, a node
    config): the README's block is typed into a fresh shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "MOONCAKE_"))}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=ROOT, env=_fresh_shell_env(), capture_output=True, text=True, timeout=60
    )


def _blocks_in_pool(master: str) -> float:
    with urllib.request.urlopen(f"{master}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r"^kvpool_kv_cache_blocks_total (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


def test_the_pool_alone_answers_the_guides_check_status_and_the_client(tmp_path: Path) -> None:
    port = str(free_port())
    values = {"50088": port}  # the default port may be held by another test or stack in CI
    serve, metrics, status = doc_block("readme.pool").commands(values)
    log = tmp_path / "master.log"
    # The master and status lines name no port (they take the default): the port is the one
    # flag the test adds to each.  The master runs in the background, as in a second shell.
    with log.open("w") as out:
        master = lifetime.popen(
            [*shlex.split(serve, comments=True), "--port", port],
            cwd=ROOT, env=_fresh_shell_env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        health = ["curl", "-sf", "-o", "/dev/null", "-m", "2", f"{url}/health"]

        def up() -> bool:
            assert master.poll() is None, log.read_text()
            return subprocess.run(health, check=False).returncode == 0

        wait_until(up, 60, interval_s=0.2, what=f"kvpool master on {port}")
        grep = _run(["bash", "-o", "pipefail", "-c", metrics])
        assert grep.returncode == 0, grep.stdout + grep.stderr
        assert re.search(r"^kvpool_kv_cache_blocks_total \S+$", grep.stdout, re.M), grep.stdout
        assert re.search(r"^kvpool_connected_clients \S+$", grep.stdout, re.M), grep.stdout

        shown = _run([*shlex.split(status, comments=True), "--master", f"127.0.0.1:{port}"])
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert f"kvpool 127.0.0.1:{port}" in shown.stdout, shown.stdout

        snippet = doc_block("readme.client").text_for(values)
        client = _run([sys.executable, "-c", snippet])
        assert client.returncode == 0, client.stdout + client.stderr
        assert _blocks_in_pool(url) == 1  # its put is in the pool
    finally:
        master.terminate()
        master.wait(timeout=30)

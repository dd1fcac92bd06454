"""``kvpool up``'s edge: a failed start, and ``kvpool up --no-vllm`` as a subprocess with a
real master."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from kvpool.ops.up.lifecycle import STATE_FILE, run
from kvpool.ops.up.options import UpOptions
from kvpool.testing import lifetime
from tests.docs.blocks import doc_block
from tests.ops.up.helpers import REPO, gone, reaped, up_argv
from tests.waiting import wait_until


def test_run_prints_the_failing_process_log_and_leaves_nothing(tmp_path: Path) -> None:
    fake_python = tmp_path / "fake-python"
    fake_python.write_text("#!/bin/sh\necho 'fatal: segment could not be mapped'\nexit 3\n")
    fake_python.chmod(0o755)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = io.StringIO()
    status = run(
        UpOptions(
            state_dir=tmp_path / "state",
            no_vllm=True,
            master_port=port,
            python=str(fake_python),
            start_timeout_s=30,
        ),
        console=Console(file=out, width=200),
    )
    text = out.getvalue()
    assert status == 1, text
    assert "master failed to start: exited with exit status 3 while starting" in text
    assert "fatal: segment could not be mapped" in text
    assert not (tmp_path / "state" / STATE_FILE).exists()


# --------------------------------------------------------------------------- kvpool up --no-vllm

PYTHON_UP = (sys.executable, "-m", "kvpool", "up")


def start_up(*flags: str, command: Sequence[str] = PYTHON_UP) -> subprocess.Popen[str]:
    return lifetime.popen(
        [*command, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )


def read_state(state: Path, pid: int, timeout_s: float = 60.0) -> dict[str, object]:
    """``up.json`` once the ``kvpool up`` with this pid says it is ready."""
    path = state / STATE_FILE

    def ready() -> dict[str, object] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        ok = data.get("status") == "ready" and data.get("pid") == pid
        return data if ok else None

    return wait_until(ready, timeout_s, interval_s=0.1, what=f"kvpool up (pid {pid}) ready")


def test_up_no_vllm_serves_the_guides_metrics_and_stops_clean(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # docs/quickstart.md's command, plus the test's own state directory and any free port
    # for the master (the default 50088 may be taken in CI)
    (command,) = doc_block("quickstart.no-vllm").commands()
    up = start_up("--state-dir", str(state), "--master-port", "0", command=up_argv(command))
    with reaped(up):
        info = read_state(state, up.pid)
        master = info["master"]
        assert isinstance(master, str)
        master_pid = info["processes"]["master"]["pid"]  # type: ignore[index]
        # the production guide's §8.1 command, as written
        grep = subprocess.run(
            ["bash", "-c", f'curl -s {master}/metrics | grep -E "kv_cache|connected"'],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "kvpool_kv_cache_blocks_total 0.0" in grep
        assert "kvpool_connected_clients 1.0" in grep  # the master's own segment
        assert (state / "ssd").is_dir() and not (state / "model").exists()
        # the same state directory is refused while this one runs, and so is a taken port
        second = subprocess.run(
            [sys.executable, "-m", "kvpool", "up", "--no-vllm", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert second.returncode == 2 and "in use by another kvpool up" in second.stderr
        port = master.rsplit(":", 1)[1]
        third = subprocess.run(
            [sys.executable, "-m", "kvpool", "up", "--no-vllm", "--master-port", port,
             "--state-dir", str(tmp_path / "other")],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert third.returncode == 2 and "--master-port: 127.0.0.1:" in third.stderr
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "kvpool up: ready" in out and "master     stopped" in out
    # what the page says it prints: the metrics curl, and the node config for your vLLM
    assert f'curl -s {master}/metrics | grep -E "kv_cache|connected"' in out, out
    assert f"export KVPOOL_CONFIG_PATH={state / 'mooncake.json'}" in out, out
    assert gone(master_pid)
    assert not (state / STATE_FILE).exists()


def _run_no_vllm(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, object], int]:
    state = tmp_path / "state"
    up = start_up("--no-vllm", "--state-dir", str(state), "--master-port", "0")
    info = read_state(state, up.pid)
    master_pid = info["processes"]["master"]["pid"]  # type: ignore[index]
    assert isinstance(master_pid, int)
    return up, info, master_pid


def test_ctrl_c_stops_the_stack(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    with reaped(up):
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "master     stopped" in out and gone(master_pid)


def test_a_dead_master_ends_the_stack(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    with reaped(up):
        os.kill(master_pid, signal.SIGKILL)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 1, out
    assert "master exited (signal SIGKILL)" in out
    assert "the master is gone; stopping the stack" in out


def test_a_killed_kvpool_up_takes_its_children_along(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    up.kill()  # no chance to clean up: the children's parent-death signal must do it
    up.communicate(timeout=10)
    wait_until(lambda: gone(master_pid), 30, what="the master outlived a SIGKILLed kvpool up")
    # the up.json it left behind names a dead pid: the next kvpool up takes the directory
    again, _, again_master = _run_no_vllm(tmp_path)
    again.send_signal(signal.SIGTERM)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0, out
    assert gone(again_master)


def test_without_vllm_installed_the_error_says_what_to_do(tmp_path: Path) -> None:
    # sys.modules["vllm"] = None makes the import system report vLLM as absent
    code = (
        "import sys; sys.modules['vllm'] = None; from kvpool.cli import main;"
        f" sys.exit(main(['up', '--state-dir', {str(tmp_path)!r}, '--master-port', '0']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vLLM is not installed" in done.stderr and "--no-vllm" in done.stderr
    assert not (tmp_path / "model").exists()  # refused before building anything

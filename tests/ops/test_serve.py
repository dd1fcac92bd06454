"""``kvpool master`` and ``kvpool node`` start-up, as an operator runs them (issue 11, item 8).

Each bad start runs the real command in a subprocess and must end in one line on stderr
naming the flag and its fix, no traceback, exit status 2, and nothing left behind: no
``/dev/shm/kvpool-<its pid>-…`` segment.  A small ``/dev/shm`` is simulated with a
segment larger than the free space ``os.statvfs`` reports (nothing is mounted).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.config import MasterConfig
from kvpool.storage.segment import SHM_DIR
from kvpool.testing.processes import node_config, start_master


def run_kvpool(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, int]:
    """Run ``python -m kvpool ARGV`` to its end; (exit status, stderr, pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **(env or {})),
    )
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise AssertionError(f"kvpool {' '.join(argv)} did not exit") from None
    return proc.returncode, err, proc.pid


def segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kvpool-{pid}-*"))


def assert_one_line_exit_2(
    argv: tuple[str, ...], *, names: str, env: dict[str, str] | None = None
) -> str:
    rc, err, pid = run_kvpool(*argv, env=env)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert names in lines[0], lines[0]
    assert segments_of(pid) == [], "a segment was left in /dev/shm"
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def too_big_for_shm() -> int:
    """Larger than the free space of /dev/shm whatever other processes free meanwhile:
    twice its whole size."""
    st = os.statvfs(SHM_DIR)
    return 2 * st.f_blocks * st.f_frsize


# -- kvpool master -------------------------------------------------------------------


def test_master_on_a_busy_port_says_so_before_allocating(busy_port: int) -> None:
    line = assert_one_line_exit_2(
        ("master", "--port", str(busy_port), "--segment_size", "64MiB"), names="--port"
    )
    assert "already in use" in line


def test_master_on_an_address_of_another_host_names_host() -> None:
    # --insecure: past the credential rule, to the bind itself
    argv = ("master", "--host", "192.0.2.1", "--port", "0", "--insecure")
    line = assert_one_line_exit_2(argv, names="--host")
    assert "0.0.0.0" in line


def test_master_on_another_hosts_address_without_a_credential_names_the_fixes() -> None:
    line = assert_one_line_exit_2(("master", "--host", "192.0.2.1", "--port", "0"), names="--host")
    assert "--secret_file" in line and "--insecure" in line


@pytest.mark.parametrize("warmup", ["background", "sync", "off"])
def test_master_segment_larger_than_dev_shm_names_the_fixes(warmup: str) -> None:
    # whatever the warm-up mode, the memory is committed before the master serves
    size = str(too_big_for_shm())
    line = assert_one_line_exit_2(
        ("master", "--port", "0", "--segment_size", size, "--segment_warmup", warmup),
        names="--segment_size",
    )
    assert "shm_size" in line and "ipc: host" in line


def test_master_unusable_ssd_path_names_the_flag(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert_one_line_exit_2(
        (
            "master",
            "--port",
            "0",
            "--segment_size",
            "8MiB",
            "--enable_offload=true",
            "--ssd_offload_path",
            str(blocker / "ssd"),
        ),
        names="--ssd_offload_path",
    )


def test_master_unknown_log_level_names_the_flag() -> None:
    line = assert_one_line_exit_2(
        ("master", "--port", "0", "--segment_size", "8MiB", "--log_level", "loud"),
        names="--log_level",
    )
    assert "debug" in line


def test_settings_that_would_do_nothing_are_warned_about(tmp_path: Path) -> None:
    with start_master("--segment_size", "8MiB", "--ssd_offload_path", str(tmp_path)) as proc:
        proc.wait_for_line(r"WARNING .*--ssd_offload_path is set but --enable_offload is false")
    with start_master("--segment_size", "8MiB", "--enable_offload=true") as proc:
        proc.wait_for_line(
            r"WARNING .*--enable_offload=true but this master has no --ssd_offload_path"
        )


def test_the_start_up_line_lists_the_effective_flags() -> None:
    with start_master("--segment_size", "8MiB", "--eviction_ratio", "0.2") as proc:
        line = proc.wait_for_line(r"listening on .* flags: ")
    flags = line.split("flags: ", 1)[1].split()
    assert f"--port={proc.port}" in flags and "--eviction_ratio=0.2" in flags
    # the line reads back as the very configuration that runs
    config = MasterConfig.from_argv(["kvpool", "master", *flags])
    assert config.port == proc.port and config.segment_size == 8 << 20
    assert config.eviction_ratio == 0.2


# -- kvpool node ---------------------------------------------------------------------


UNREACHED = "127.0.0.1:1"  # the nodes' master: never reached, start-up fails before


def test_node_on_a_busy_data_port_says_so_before_allocating(tmp_path: Path, busy_port: int) -> None:
    line = assert_one_line_exit_2(
        ("node", "--config", str(node_config(tmp_path, UNREACHED)), "--data-port", str(busy_port)),
        names="--data-port",
    )
    assert "already in use" in line


@pytest.mark.parametrize("warmup", ["background", "off"])
def test_node_segment_larger_than_dev_shm_names_the_fixes(tmp_path: Path, warmup: str) -> None:
    config = node_config(
        tmp_path, UNREACHED, global_segment_size=too_big_for_shm(), segment_warmup=warmup
    )
    line = assert_one_line_exit_2(("node", "--config", str(config)), names="global_segment_size")
    assert "shm_size" in line and "ipc: host" in line


def test_node_unknown_log_level_names_the_flag(tmp_path: Path) -> None:
    assert_one_line_exit_2(
        ("node", "--config", str(node_config(tmp_path, UNREACHED)), "--log_level", "loud"),
        names="--log_level",
    )


def test_start_up_errors_read_as_one_line_with_the_command_name(busy_port: int) -> None:
    line = assert_one_line_exit_2(("master", "--port", str(busy_port)), names="--port")
    assert re.match(r"^kvpool master: ", line)


def test_offload_with_no_ssd_tier_anywhere_is_warned_about_when_it_evicts() -> None:
    with start_master("--segment_size", "4MiB", "--enable_offload=true") as proc:
        with Client(proc.address, timeout_s=10) as client:
            for i in range(12):  # 12 x 512 KiB through a 4 MiB segment: evictions
                client.put(f"fill-{i}", bytes(512 << 10))
        line = proc.wait_for_line(r"WARNING .*no SSD tier is registered")
    assert "dropped, not demoted" in line


# -- kvpool proxy --------------------------------------------------------------------


def test_proxy_on_a_busy_port_says_so_in_one_line(busy_port: int) -> None:
    argv = ("proxy", "--port", str(busy_port), "--prefill", "http://127.0.0.1:9",
            "--decode", "http://127.0.0.1:9")  # fmt: skip
    line = assert_one_line_exit_2(argv, names="--port")
    assert "already in use" in line

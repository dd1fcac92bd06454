from __future__ import annotations

import subprocess
import sys

import pytest

import kvpool
from kvpool.cli import main


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert kvpool.__version__ in capsys.readouterr().out


def test_python_dash_m_is_the_same_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: kvpool" in done.stdout


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvpool" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["master", "--eviction_ratio", "2"], "kvpool master: --eviction_ratio: must be in (0, 1]"),
        (["master", "--enable_offload=maybe"], "kvpool master: --enable_offload: expected true"),
        (["node", "--config", "/nonexistent/mooncake.json"], "kvpool node: "),
        (["proxy"], "kvpool proxy: "),
        (["status", "--watch", "0"], "kvpool status: --watch: SECONDS must be positive"),
        (["config", "check", "/nonexistent/mooncake.json"], "kvpool config check: "),
        (["config", "render", "/nonexistent.toml", "--out", "x"], "kvpool config render: "),
        (["up", "--cpus", "one"], "kvpool up: --cpus: expected core numbers"),
    ],
)
def test_a_config_error_is_one_line_on_stderr_and_exit_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err

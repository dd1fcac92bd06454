"""Where a process finds its credential, and when it may run without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.security.credentials import Credential
from kvpool.security.secret import (
    is_loopback,
    load_credential,
    operator_headers,
    read_secret_file,
    require_credential,
)

A = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"
B = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"


def _file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "s") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_the_setting_wins_over_the_file_variable_over_the_secret_variable(
    tmp_path: Path,
) -> None:
    own, env_file = _file(tmp_path, A, name="a"), _file(tmp_path, B, name="b")
    env = {"KVPOOL_SECRET_FILE": env_file, "KVPOOL_SECRET": B}
    assert load_credential(own, env, key="--secret_file") == Credential(secret=A.encode())
    assert load_credential("", env, key="--secret_file") == Credential(secret=B.encode())
    assert load_credential("", {"KVPOOL_SECRET": A}, key="x") == Credential(secret=A.encode())
    assert load_credential("", {"KVPOOL_SECRET": ""}, key="x") is None
    assert load_credential("", {}, key="x") is None


@pytest.mark.parametrize("mode", [0o644, 0o602, 0o666])
def test_a_secret_file_every_user_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, A, mode)
    with pytest.raises(ConfigError, match=f"--secret_file: {path} is readable or writable"):
        read_secret_file(path, "--secret_file")
    Path(path).chmod(0o640)  # the group may read it (a deployment's service group)
    assert read_secret_file(path, "--secret_file").is_cluster


def test_a_missing_or_weak_secret_file_says_the_key_and_the_fix(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"KVPOOL_SECRET_FILE: cannot read .* chmod 600"):
        load_credential("", {"KVPOOL_SECRET_FILE": missing}, key="--secret_file")
    weak = _file(tmp_path, "short")
    with pytest.raises(ConfigError, match=r"--secret_file \(.*\): the secret has 5 characters"):
        read_secret_file(weak, "--secret_file")
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_secret_file(str(tmp_path), "--secret_file")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("p0.cluster", False),
        ("::", False),
    ],
)
def test_only_loopback_may_be_served_without_a_credential(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    if loopback:
        require_credential(host, None, False, key="--host")
    else:
        with pytest.raises(ConfigError, match=f"--host {host}: .* or pass --insecure"):
            require_credential(host, None, False, key="--host")
    require_credential(host, None, True, key="--host")
    require_credential(host, Credential(secret=A.encode()), False, key="--host")


def test_the_operators_header_comes_from_the_environments_cluster_secret() -> None:
    token = Credential(secret=A.encode()).operator_token()
    assert operator_headers({"KVPOOL_SECRET": A}) == {"Authorization": f"Bearer {token}"}
    assert operator_headers({}) == {}
    node = Credential(secret=A.encode()).node_credential("node-a")
    assert operator_headers({"KVPOOL_SECRET": node}) == {}

"""A secret file holding the new secret and, on a second line, the previous one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.security.credentials import Credential
from kvpool.security.secret import load_credential, read_secret_file

OLD = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"
NEW = "7d2a9c4e6b1f3a5c8e0d2b4f6a8c1e3d5b7f9a0c2e4b6d8f1a3c5e7b9d0f2a4c"


def secret_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "secret"
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


def test_two_lines_are_the_new_secret_then_the_previous_one(tmp_path: Path) -> None:
    credential = read_secret_file(secret_file(tmp_path, f"{NEW}\n{OLD}\n"), "--secret_file")
    assert credential.secret == NEW.encode()
    assert credential.previous == Credential.parse(OLD, "k")
    assert [c.secret for c in credential.candidates()] == [NEW.encode(), OLD.encode()]
    assert all(c.previous is None for c in credential.candidates())
    # the token an operator sends is the new secret's
    assert credential.operator_token() == Credential.parse(NEW, "k").operator_token()


def test_one_line_has_no_previous_and_blank_lines_do_not_count(tmp_path: Path) -> None:
    credential = read_secret_file(secret_file(tmp_path, f"\n{NEW}\n\n"), "--secret_file")
    assert credential.previous is None and credential.candidates() == (credential,)


def test_the_environment_variable_may_hold_two_lines() -> None:
    credential = load_credential("", {"KVPOOL_SECRET": f"{NEW}\n{OLD}"}, key="secret_file")
    assert credential is not None and credential.previous is not None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (f"{NEW}\n{OLD}\n{OLD}\n", "3 lines"),
        (f"{NEW}\nshort\n", "line 2"),
        (f"{NEW}\n{Credential.parse(OLD, 'k').node_credential('n1')}\n", "different kinds"),
        (
            f"{Credential.parse(NEW, 'k').node_credential('n1')}\n"
            f"{Credential.parse(OLD, 'k').node_credential('n2')}\n",
            "two nodes",
        ),
    ],
)
def test_a_bad_rotation_file_is_one_line_naming_the_setting(
    tmp_path: Path, text: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=said) as caught:
        read_secret_file(secret_file(tmp_path, text), "--secret_file")
    assert "--secret_file" in str(caught.value) and "\n" not in str(caught.value)

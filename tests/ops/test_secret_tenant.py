"""``kvpool secret tenant-key``: a tenant's credential, derived from the cluster secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.security.credentials import Credential
from tests.master.auth_pool import SECRET, secret_file


def test_tenant_key_prints_the_tenants_credential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = secret_file(tmp_path)
    assert main(["secret", "tenant-key", "--tenant", "teamA", "--secret-file", str(path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == Credential.parse(SECRET, "k").tenant_credential("teamA")
    assert Credential.parse(line, "k").tenant == "teamA"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tenant", ""], "--tenant: name it"),
        (["--tenant", "a/b"], "not a tenant name"),
    ],
)
def test_tenant_key_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    path = secret_file(tmp_path)
    assert main(["secret", "tenant-key", *argv, "--secret-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_tenant_credential_cannot_make_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    red = Credential.parse(SECRET, "k").tenant_credential("red")
    path = secret_file(tmp_path, red, name="red.cred")
    assert main(["secret", "tenant-key", "--tenant", "blue", "--secret-file", str(path)]) == 1
    assert "derives from the cluster secret" in capsys.readouterr().err

"""``kvpool quota``: set and show tenants' quotas on a real secured master and node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.client.client import Client
from kvpool.errors import QuotaExceeded
from kvpool.ops.quota import TenantUsage, parse_tenants
from kvpool.protocol import messages as m
from kvpool.security.credentials import Credential
from tests.master.auth_pool import SECRET, SecuredPool, secret_file, secured_pool

CLUSTER = Credential.parse(SECRET, "k")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SecuredPool, Path]]:
    directory = tmp_path_factory.mktemp("quota")
    with secured_pool(directory) as p:
        yield p, secret_file(directory, name="operator-secret")


def _put(c: Client, key: str, size: int) -> None:
    placement = c.call(m.PutStart(c.client_id, key, size))
    assert isinstance(placement, m.Placement)
    c.call(m.PutEnd(c.client_id, key, 0))


def _kvpool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *argv], capture_output=True, text=True, timeout=60
    )


def test_set_then_show_and_the_master_enforces_it(pool: tuple[SecuredPool, Path]) -> None:
    p, secret = pool
    address = p.master.address
    done = _kvpool(
        "quota", "set", "teal", "2KiB", "--master", address, "--secret-file", str(secret)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tenant teal: quota 2.0 KiB, holds 0 B"
    teal = CLUSTER.tenant_credential("teal")
    with Client(address, credential=teal, allow_shm=False, timeout_s=5) as c:
        _put(c, "a", 1500)
        with pytest.raises(QuotaExceeded):  # larger than the quota: refused, "a" kept
            _put(c, "b", 2500)
    shown = _kvpool("quota", "show", "--master", address, "--secret-file", str(secret), "--json")
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    (row,) = [r for r in rows if r["tenant"] == "teal"]
    assert (row["quota_bytes"], row["bytes"], row["objects"]) == (2048, 1500, 1)
    assert row["refused"] >= 1
    table = _kvpool("quota", "show", "teal", "--master", address, "--secret-file", str(secret))
    head, line = table.stdout.splitlines()
    assert head.split() == [
        "tenant", "quota", "holds", "objects", "hits", "misses", "evicted", "refused"
    ]  # fmt: skip
    assert line.split()[:4] == ["teal", "2.0", "KiB", "1.5"]
    # 0 lifts it: the same put now fits
    assert (
        main(["quota", "set", "teal", "0", "--master", address, "--secret-file", str(secret)]) == 0
    )
    with Client(address, credential=teal, allow_shm=False, timeout_s=5) as c:
        _put(c, "b", 2500)


def test_a_tenant_cannot_set_a_quota(
    pool: tuple[SecuredPool, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p, _ = pool
    own = tmp_path / "tenant-secret"
    own.write_text(CLUSTER.tenant_credential("teal") + "\n")
    own.chmod(0o600)
    argv = ["quota", "set", "teal", "1GB", "--master", p.master.address, "--secret-file", str(own)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--secret-file: a quota is the operator's" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["set", "teal"], "name the tenant and the size"),
        (["set", "a/b", "1GB"], "not a tenant name"),
        (["set", "teal", "lots"], "SIZE"),
        (["show", "teal", "1GB"], "show takes at most a TENANT"),
    ],
)
def test_usage_errors_are_one_line(
    pool: tuple[SecuredPool, Path], argv: list[str], says: str
) -> None:
    p, secret = pool
    done = _kvpool("quota", *argv, "--master", p.master.address, "--secret-file", str(secret))
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_show_without_the_operators_token_says_so(pool: tuple[SecuredPool, Path]) -> None:
    p, _ = pool
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "quota", "show", "--master", p.master.address],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
    )
    assert done.returncode == 1
    assert "wants the operator's token" in done.stderr and "Traceback" not in done.stderr


def test_a_master_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    secret = secret_file(tmp_path)
    done = _kvpool(
        "quota", "set", "teal", "1GB", "--master", "127.0.0.1:9", "--secret-file", str(secret)
    )
    assert done.returncode == 1
    assert done.stderr.startswith("kvpool quota set: 127.0.0.1:9: ")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_parse_tenants_reads_the_masters_series() -> None:
    text = (
        'kvpool_tenant_quota_bytes{tenant="a"} 100.0\n'
        'kvpool_tenant_bytes{tenant="a"} 40.0\n'
        'kvpool_tenant_hits_total{tenant="a"} 3.0\n'
        'kvpool_tenant_bytes{tenant="b"} 7.0\n'
        "kvpool_objects 2.0\n"
    )
    assert parse_tenants(text) == [
        TenantUsage("a", quota_bytes=100, bytes=40, hits=3),
        TenantUsage("b", bytes=7),
    ]

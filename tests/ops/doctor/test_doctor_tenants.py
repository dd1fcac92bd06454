"""Doctor and tenants: a tenant's credential on kvpool's engine is checked as what it is;
on Mooncake, doctor says the pool is open (no credentials, no tenants) and what to do."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.ops.doctor import DoctorOptions, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.doctor.checks_security import check_master_auth, check_secret_file
from kvpool.ops.doctor.probes import master_auth_probe, secret_file_facts
from kvpool.security.credentials import Credential
from kvpool.testing.processes import start_master
from tests.master.auth_pool import SECRET, secret_file

RED = Credential.parse(SECRET, "k").tenant_credential("red")


def test_a_tenant_credential_is_checked_against_the_master(tmp_path: Path) -> None:
    path = secret_file(tmp_path, RED, name="red.cred")
    file_check = check_secret_file(secret_file_facts("KVPOOL_SECRET_FILE", str(path)))
    assert file_check.status is Status.PASS
    assert "tenant red's credential" in file_check.message
    master_secret = secret_file(tmp_path)
    with start_master("--segment_size", "1MiB", "--secret_file", str(master_secret)) as master:
        check = check_master_auth(master_auth_probe(master.address, Credential.parse(RED, "k")))
        assert check is not None and check.status is Status.PASS, check
        assert "as tenant" in check.message


def test_doctor_on_mooncake_says_the_pool_is_open_and_to_isolate_it(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # nothing listens there: the master's checks fail alone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"127.0.0.1:{port}",
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    checks = {
        c.name: c
        for c in run_doctor(
            DoctorOptions(probe_keys=False), env={"MOONCAKE_CONFIG_PATH": str(config)}
        )
    }
    security = checks["security.credentials"]
    assert security.status is Status.WARN
    for words in ("the pool is open", "no credentials of its own", "no tenants or quotas"):
        assert words in security.message
    assert "network isolation is the only protection" in security.message
    assert "private network" in security.fix and "tenant credential" in security.fix

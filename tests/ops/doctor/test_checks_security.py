"""Doctor's credential checks on kvpool's engine, driven with broken setups: secret files
(missing, loose modes, bad text), binds beyond loopback without a secret or with
--insecure, the master's handshake verdicts; and on Mooncake, the plain warning that the
pool is open."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from kvpool.config import MasterConfig
from kvpool.config.node import parse_node_config
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Check, Status
from kvpool.ops.doctor.checks_security import (
    MasterAuthFacts,
    SecretFileFacts,
    check_master_auth,
    check_master_bind,
    check_node_bind,
    check_secret_file,
)
from kvpool.ops.doctor.probes import secret_file_facts
from kvpool.security.credentials import Credential

SECRET = secrets.token_hex(32)


def _file(tmp_path: Path, text: str, mode: int, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_a_secret_file_must_exist_be_the_owners_only_and_hold_a_secret(tmp_path: Path) -> None:
    def check(path: str) -> Check:
        return check_secret_file(secret_file_facts("KVPOOL_SECRET_FILE", path))

    good = check(_file(tmp_path, SECRET, 0o600))
    assert good.status is Status.PASS and "the cluster secret, mode 600" in good.message
    assert good.name == "security.secret_file[KVPOOL_SECRET_FILE]"
    read_only = check(_file(tmp_path, SECRET, 0o400, "ro"))
    assert read_only.status is Status.PASS
    node = Credential.parse(SECRET, "k").node_credential("node-s0")
    assert "node node-s0's credential" in check(_file(tmp_path, node, 0o600, "cred")).message
    missing = check(str(tmp_path / "nowhere"))
    assert missing.status is Status.FAIL and "does not exist" in missing.message
    assert "kvpool config render" in missing.fix
    world = check(_file(tmp_path, SECRET, 0o644, "world"))
    assert world.status is Status.FAIL and world.fix == f"chmod 600 {tmp_path / 'world'}"
    group = check(_file(tmp_path, SECRET, 0o640, "group"))
    assert group.status is Status.WARN and "group" in group.message
    short = check(_file(tmp_path, "tooshort", 0o600, "short"))
    assert short.status is Status.FAIL and "at least 32" in short.message
    assert "KVPOOL_SECRET_FILE" in short.message  # names the setting that chose the file
    bad_node = check(_file(tmp_path, "kvpool-node:node-x:zz", 0o600, "badnode"))
    assert bad_node.status is Status.FAIL and "kvpool-node:<node id>" in bad_node.message


def _node(host: str, **keys: object) -> object:
    return parse_node_config(
        {"local_hostname": host, "metadata_server": "10.0.0.1:50088", **keys},
        source="/etc/kvpool/mooncake.json",
    )


def test_a_node_beyond_loopback_without_a_credential_fails_with_the_fix() -> None:
    no_secret = check_node_bind(_node("10.0.0.2"), has_credential=False)  # type: ignore[arg-type]
    assert no_secret is not None and no_secret.status is Status.FAIL
    assert "refuses to start" in no_secret.message
    assert '"secret_file"' in no_secret.fix and "/etc/kvpool/mooncake.json" in no_secret.fix
    ok = check_node_bind(_node("10.0.0.2", secret_file="/c"), has_credential=True)  # type: ignore[arg-type]
    assert ok is not None and ok.status is Status.PASS
    local = check_node_bind(_node("127.0.0.1"), has_credential=False)  # type: ignore[arg-type]
    assert local is not None and local.status is Status.PASS
    assert check_node_bind(None, has_credential=False) is None


def test_a_master_beyond_loopback_needs_a_secret_and_insecure_is_an_open_pool() -> None:
    insecure = check_master_bind(MasterConfig(host="10.0.0.1", insecure=True), False)
    assert insecure is not None and insecure.status is Status.WARN
    assert "the pool is open" in insecure.message and "--secret_file" in insecure.fix
    bare = check_master_bind(MasterConfig(host="10.0.0.1"), False)
    assert bare is not None and bare.status is Status.FAIL and "refuses to start" in bare.message
    with_file = check_master_bind(MasterConfig(host="10.0.0.1", secret_file="/s"), False)
    assert with_file is not None and with_file.status is Status.PASS
    from_env = check_master_bind(MasterConfig(host="10.0.0.1"), True)
    assert from_env is not None and from_env.status is Status.PASS
    loopback = check_master_bind(MasterConfig(host="127.0.0.1", insecure=True), False)
    assert loopback is not None and loopback.status is Status.PASS


@pytest.mark.parametrize(
    ("facts", "status", "fragment"),
    [
        (MasterAuthFacts("m:1", "client"), Status.PASS, "accepted this host's credential"),
        (
            MasterAuthFacts(
                "m:1",
                "client",
                "AuthError: the server's proof is wrong: different secrets, "
                "or this is not the real server",
            ),
            Status.FAIL,
            "holds a different secret",
        ),
        (
            MasterAuthFacts("m:1", "client", "AuthError: m:1 does not speak the handshake (x)"),
            Status.FAIL,
            "runs without a secret",
        ),
        (MasterAuthFacts("m:1", "", required=True), Status.FAIL, "requires a credential"),
        (MasterAuthFacts("m:1", "client", "PeerTimeout: no answer"), Status.FAIL, "failed"),
    ],
)
def test_the_masters_handshake_verdicts(
    facts: MasterAuthFacts, status: Status, fragment: str
) -> None:
    check = check_master_auth(facts)
    assert check is not None and check.status is status and fragment in check.message
    assert check.name == "security.master_auth"


def test_no_handshake_check_when_neither_side_has_a_secret() -> None:
    assert check_master_auth(MasterAuthFacts("m:1", "", required=False)) is None


def test_doctor_on_a_rendered_insecure_master_warns_that_the_pool_is_open(tmp_path: Path) -> None:
    cmd = "kvpool master --host 10.0.0.1 --port 50088 --insecure"
    checks = run_doctor(DoctorOptions(master_cmd=cmd, probe_keys=False), env={})
    by = {c.name: c for c in checks}
    assert by["security.master_bind"].status is Status.WARN, format_text(checks)
    assert "the pool is open" in by["security.master_bind"].message
    # a node config beyond loopback with no credential anywhere: FAIL, with the fix
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"local_hostname": "10.0.0.2", "metadata_server": "10.0.0.1:1"}))
    checks = run_doctor(DoctorOptions(config=str(config), probe_keys=False), env={})
    node = {c.name: c for c in checks}["security.node_bind"]
    assert node.status is Status.FAIL and "secret_file" in node.fix
    # its secret_file, broken: the file's own check names it
    config.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.2",
                "metadata_server": "10.0.0.1:1",
                "secret_file": _file(tmp_path, SECRET, 0o666, "loose"),
            }
        )
    )
    checks = run_doctor(DoctorOptions(config=str(config), probe_keys=False), env={})
    by = {c.name: c for c in checks}
    assert by["security.secret_file[secret_file]"].status is Status.FAIL
    assert by["security.node_bind"].status is Status.PASS  # configured: the file is the fault


def test_on_mooncake_doctor_says_the_pool_is_open_and_checks_no_kvpool_secret() -> None:
    cmd = "mooncake_master --rpc_address=10.0.0.1 --rpc_port=50051 --metrics_port=9003"
    checks = run_doctor(
        DoctorOptions(master_cmd=cmd, probe_keys=False), env={"KVPOOL_SECRET_FILE": "/nowhere"}
    )
    by = {c.name: c for c in checks}
    open_pool = by["security.credentials"]
    assert open_pool.status is Status.WARN, format_text(checks)
    assert "no credentials of its own" in open_pool.message
    assert "network isolation" in open_pool.message and "private network" in open_pool.fix
    assert not [c for c in checks if c.name.startswith(("security.secret_file", "security.master"))]


def test_secret_file_facts_are_plain_values() -> None:
    facts = SecretFileFacts("secret_file", "/x", 0o600, holds="the cluster secret")
    assert check_secret_file(facts).status is Status.PASS

"""``kvpool config render`` and the cluster secret: who gets which credential, how the
files are written, that a re-render keeps the secret, the opt-out, and the proof that a
real master started from the rendered files accepts every host's credential as
``kvpool doctor`` checks it."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpool.client.client import Client
from kvpool.config import load_node_config
from kvpool.errors import ConfigError
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Check, Status
from kvpool.ops.render import RenderOptions, parse_inventory, render, run, write_rendered
from kvpool.security.credentials import Credential
from kvpool.testing.processes import start_master, start_node
from tests.ops.test_render import example

SECRET = secrets.token_hex(32)


def cluster(**top: Any) -> dict[str, Any]:
    """The example's P and D hosts and a storage-only host, all on 10.x addresses."""
    data = example()
    data["hosts"].append({"name": "s0", "address": "10.0.0.3", "role": "storage"})
    return {**data, **top}


def _argv(script: str) -> list[str]:
    return shlex.split(script.splitlines()[-1])[1:]  # after `exec`


def test_a_reachable_cluster_gets_one_secret_and_a_storage_host_only_its_node_key() -> None:
    files = render(parse_inventory(cluster()), SECRET)
    assert files["secret"] == files["p0/secret"] == files["d0/secret"] == SECRET + "\n"
    storage = {k: v for k, v in files.items() if k.startswith("s0/")}
    assert set(storage) == {"s0/mooncake.json", "s0/env.sh", "s0/node.sh", "s0/node.cred"}
    assert not any(SECRET in text for text in storage.values())  # never the cluster secret
    node = Credential.parse(files["s0/node.cred"], "node.cred")
    assert node.node_id == "node-s0" and not node.is_cluster
    assert node.node_key == Credential.parse(SECRET, "k").node_key_of("node-s0")
    # the secret itself is in the secret files only, never in a script or a config
    for rel, text in files.items():
        if Path(rel).name != "secret":
            assert SECRET not in text, rel
    assert json.loads(files["p0/mooncake.json"])["secret_file"] == "/workspace/config/secret"
    assert json.loads(files["s0/mooncake.json"])["secret_file"] == "/workspace/config/node.cred"
    master = _argv(files["master.sh"])
    at = master.index("--secret_file")
    assert master[at + 1] == "/workspace/config/secret" and "--insecure" not in master
    assert "export KVPOOL_SECRET_FILE=/workspace/config/secret" in files["d0/env.sh"]
    assert "KVPOOL_SECRET_FILE" not in files["s0/env.sh"]
    assert "node.cred to /workspace/config/node.cred (mode 600)" in files["s0/env.sh"]
    assert _argv(files["s0/node.sh"]) == ["kvpool", "node"]
    assert "mode 600" in files["README.md"] and "node.cred" in files["README.md"]
    # no secret given: a fresh, valid one, the same for every host
    fresh = render(parse_inventory(cluster()))
    assert fresh["secret"] != files["secret"] and fresh["secret"] == fresh["p0/secret"]
    Credential.parse(fresh["secret"], "secret")
    with pytest.raises(ConfigError, match="at least 32"):
        render(parse_inventory(cluster()), "short")


def test_rendered_node_configs_with_secrets_load(tmp_path: Path) -> None:
    write_rendered(render(parse_inventory(cluster()), SECRET), tmp_path)
    node = load_node_config(tmp_path / "s0" / "mooncake.json", env={})
    assert node.secret_file == "/workspace/config/node.cred"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_files_are_private_never_printed_and_kept_on_a_re_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps(cluster()))
    out = tmp_path / "out"
    assert run(RenderOptions(str(inventory), str(out))) == 0
    printed = capsys.readouterr().out
    first = (out / "secret").read_text()
    assert first.strip() not in printed and "cluster secret (new)" in printed
    for rel in ("secret", "p0/secret", "d0/secret", "s0/node.cred"):
        assert _mode(out / rel) == 0o600, rel
    assert _mode(out / "master.sh") == 0o755
    node_cred = (out / "s0" / "node.cred").read_text()
    # a re-render keeps the secret (a running cluster keeps working), even over a loose mode
    (out / "p0" / "secret").chmod(0o644)
    run(RenderOptions(str(inventory), str(out)))
    assert "kept from the last render" in capsys.readouterr().out
    assert (out / "secret").read_text() == first and (out / "p0/secret").read_text() == first
    assert (out / "s0" / "node.cred").read_text() == node_cred
    assert _mode(out / "p0" / "secret") == 0o600
    # --new-secret replaces it, and every credential derived from it
    cmd = [sys.executable, "-m", "kvpool", "config", "render", str(inventory), "--out", str(out)]
    done = subprocess.run([*cmd, "--new-secret"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    second = (out / "secret").read_text()
    assert second != first and second.strip() not in done.stdout
    assert (out / "s0" / "node.cred").read_text() != node_cred
    # a kept secret that is no secret is named, with the way out
    (out / "secret").write_text(Credential.parse(second, "s").node_credential("node-x"))
    with pytest.raises(ConfigError, match="--new-secret"):
        run(RenderOptions(str(inventory), str(out)))


def test_insecure_renders_an_open_pool_and_loopback_needs_no_secret() -> None:
    files = render(parse_inventory(cluster(insecure=True)))
    assert not [rel for rel in files if Path(rel).name in ("secret", "node.cred")]
    assert "--insecure" in _argv(files["master.sh"]) and "--secret_file" not in files["master.sh"]
    assert _argv(files["s0/node.sh"]) == ["kvpool", "node", "--insecure"]
    assert "secret_file" not in json.loads(files["p0/mooncake.json"])
    assert "KVPOOL_SECRET_FILE" not in files["p0/env.sh"]
    assert "OPEN" in files["README.md"]
    local = cluster()
    for host in local["hosts"]:
        host["address"] = "127.0.0.1"
    files = render(parse_inventory(local))
    assert "secret" not in files and "--insecure" not in files["master.sh"]
    assert "loopback" in files["README.md"]
    with pytest.raises(ConfigError, match="insecure"):
        parse_inventory(cluster(insecure="sure"))
    with pytest.raises(ConfigError, match="role storage"):
        parse_inventory(cluster(), engine="mooncake")
    with pytest.raises(ConfigError, match=r"hosts\[2\]\.role"):
        parse_inventory(cluster() | {"hosts": [*example()["hosts"], {"address": "h", "role": "x"}]})


def test_mooncake_renders_no_secret_and_says_the_pool_is_open() -> None:
    files = render(parse_inventory(example(), engine="mooncake"))
    assert "secret" not in files and not any(r.endswith("/secret") for r in files)
    assert not any("secret_file" in text for text in files.values())
    readme = files["README.md"]
    assert "OPEN" in readme and "Network isolation" in readme


# ------------------------------------------------------------------ against a real master


def _loopback(out: Path, host: str, master: str, **keys: object) -> Path:
    """A rendered node config moved onto this host: 127.0.0.1, the test's master, and its
    credential where the test wrote it (the rendered path is /workspace/config/...)."""
    path = out / host / "mooncake.json"
    data = json.loads(path.read_text())
    data.update(local_hostname="127.0.0.1", metadata_server=master, global_segment_size="16MiB")
    data["secret_file"] = str(out / host / Path(data["secret_file"]).name)
    data.pop("enable_ssd_offload", None), data.pop("ssd_offload_path", None)
    data.pop("ssd_offload_limit", None)
    path.write_text(json.dumps({**data, **keys}))
    return path


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_master_started_from_the_rendered_files_accepts_every_hosts_credential(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(cluster()), SECRET), out)
    # the rendered master command, moved onto loopback: its flags, the test's port and file
    argv = _argv((out / "master.sh").read_text())[2:]
    moved = {"--host": "127.0.0.1", "--secret_file": str(out / "secret"), "--port": None}
    line: list[str] = []
    for i, arg in enumerate(argv):
        if arg in moved or (i and argv[i - 1] in moved):
            continue
        line.append(arg)
    assert argv[argv.index("--host") + 1] == "10.0.0.1"
    assert argv[argv.index("--secret_file") + 1] == "/workspace/config/secret"
    line += ["--host", "127.0.0.1", "--secret_file", str(out / "secret"), "--segment_size", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_SECRET")}
    with start_master(*line, env=env) as master:
        s0 = _loopback(out, "s0", master.address)
        with start_node(s0, env=env):
            # the storage host's rendered node.cred made it node-s0, and nothing else
            with Client(master.address, credential=SECRET, timeout_s=5) as client:
                ids = [c["client_id"] for c in client.stats()["clients"]]
            assert "node-s0" in ids, ids
            master_cmd = shlex.join(["kvpool", "master", *line, "--port", str(master.port)])
            options = DoctorOptions(master=master.address, master_cmd=master_cmd, probe_keys=False)
            # a P/D host: the cluster secret, from its node config and env.sh's variable
            p0 = _loopback(out, "p0", master.address)
            checks = run_doctor(
                replace(options, probe_keys=True),  # keys.cross_node: a client on that secret
                env={"KVPOOL_CONFIG_PATH": str(p0), "KVPOOL_SECRET_FILE": str(out / "p0/secret")},
            )
            report = format_text(checks)
            assert [c for c in checks if c.status is Status.FAIL] == [], report
            by = _by_name(checks)
            assert by["security.secret_file[secret_file]"].status is Status.PASS, report
            assert "the cluster secret, mode 600" in by["security.secret_file[secret_file]"].message
            assert by["security.master_auth"].status is Status.PASS, report
            assert "as client" in by["security.master_auth"].message
            assert by["security.node_bind"].status is Status.PASS, report
            assert by["security.master_bind"].status is Status.PASS, report
            assert by["master.health"].status is Status.PASS, report
            assert by["keys.cross_node"].status is Status.PASS, report
            # the storage host: only its node key, accepted as that node
            checks = run_doctor(options, env={"KVPOOL_CONFIG_PATH": str(s0)})
            report = format_text(checks)
            assert [c for c in checks if c.status is Status.FAIL] == [], report
            by = _by_name(checks)
            assert by["master.metrics"].status is Status.SKIP, report  # no operator token
            assert "node node-s0's credential" in by["security.secret_file[secret_file]"].message
            assert by["security.master_auth"].status is Status.PASS, report
            assert "as node" in by["security.master_auth"].message
            # a host with another cluster's secret, and one with none
            other = tmp_path / "other"
            other.write_text(secrets.token_hex(32))
            other.chmod(0o600)
            checks = run_doctor(options, env={"KVPOOL_SECRET_FILE": str(other)})
            auth = _by_name(checks)["security.master_auth"]
            assert auth.status is Status.FAIL and "different secret" in auth.message, auth
            checks = run_doctor(options, env={})
            auth = _by_name(checks)["security.master_auth"]
            assert auth.status is Status.FAIL and "requires a credential" in auth.message, auth

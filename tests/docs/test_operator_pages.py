"""docs/operations.md, docs/monitoring.md and docs/security.md, run as written.

Each marked block is read from its page and run with bash (``kvpool`` is this
interpreter's); a ``kvpool master`` line is started in the background, as in a second
shell.  What the tests change is only what differs between the docs' cluster and this
machine: /etc/kvpool, /etc/prometheus, /workspace/config and rendered/ become folders of
tmp_path, the master's 10.0.0.1 is 127.0.0.1, and its port a free one.  The Prometheus
blocks are run by tests/deploy/test_prometheus.py.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvpool.testing.processes import PoolProcess, node_config, start_node
from tests.deploy.doc_commands import bash, kvpool_on_path
from tests.docs.blocks import ROOT, Block, doc_block, read_blocks
from tests.tls_material import make_material
from tests.waiting import wait_until


@dataclass
class Host:
    """This machine, standing in for the docs' hosts."""

    tmp: Path
    env: dict[str, str]
    values: dict[str, str] = field(default_factory=dict)
    masters: list[PoolProcess] = field(default_factory=list)

    def run(self, command: str, **extra: str) -> subprocess.CompletedProcess[str]:
        text = Block("", 0, "sh", command, None).text_for({**self.values, **extra})
        return bash(text, self.env, timeout_s=60)

    def serve(self, command: str) -> str:
        """Start the doc's ``kvpool master ...`` line; its address."""
        argv = shlex.split(Block("", 0, "sh", command, None).text_for(self.values))
        assert argv[:2] == ["kvpool", "master"], command
        master = PoolProcess([*argv[1:], "--port", "0"], env=self.env)
        self.masters.append(master)
        return master.address

    def at(self, address: str) -> dict[str, str]:
        return {"10.0.0.1:50088": address}


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    env = {k: v for k, v in kvpool_on_path(tmp_path / "bin").items()
           if not k.startswith(("KVPOOL_", "MOONCAKE_"))}  # fmt: skip
    values = {
        "/etc/kvpool": str(tmp_path / "etc" / "kvpool"),
        "/etc/prometheus": str(tmp_path / "etc" / "prometheus"),
        "/workspace/config": str(tmp_path / "workspace" / "config"),
        "rendered/": f"{tmp_path / 'rendered'}/",
        "examples/inventory.toml": str(ROOT / "examples" / "inventory.toml"),
        "10.0.0.1": "127.0.0.1",
    }
    for folder in ("etc/kvpool", "etc/prometheus", "workspace/config"):
        (tmp_path / folder).mkdir(parents=True)
    h = Host(tmp_path, env, values)
    try:
        yield h
    finally:
        for master in h.masters:
            master.stop()


def commands(marker: str) -> list[str]:
    return doc_block(marker).commands()


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def http(url: str, token: str = "") -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def with_secret(host: Host) -> str:
    """security.md's first block: the secret, and a master started on it."""
    make, serve = commands("security.secret")
    ok(host.run(make))
    secret = host.tmp / "etc" / "kvpool" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    return host.serve(serve)


# ------------------------------------------------------------------ operations.md
def test_render_and_check(host: Host) -> None:
    render, check = commands("ops.render")
    ok(host.run(render))
    assert (host.tmp / "rendered" / "p0" / "mooncake.json").is_file()
    assert "local_hostname = '10.0.0.1'" in ok(host.run(check))


def test_doctor_on_a_host_with_its_rendered_folder(host: Host) -> None:
    ok(host.run(commands("ops.render")[0]))
    config = host.tmp / "workspace" / "config"
    for item in (host.tmp / "rendered" / "p0").iterdir():  # the folder copied to p0
        text = item.read_text().replace("/workspace/config", str(config))
        (config / item.name).write_text(text)
        (config / item.name).chmod(item.stat().st_mode)
    done = host.run("\n".join(commands("ops.doctor")))
    # no master runs here, 10.0.0.1 is not this host and it has no NVMe at the
    # inventory's /mnt/nvme: doctor says so, and only so
    assert done.returncode == 1, done.stdout + done.stderr
    failed = set(re.findall(r"^FAIL\s+(\S+)", done.stdout, re.M))
    assert failed and failed <= {"config.local_hostname", "master.reachable",
                                 "security.master_auth", "ssd.offload"}, done.stdout  # fmt: skip
    assert re.search(r"^PASS\s+connector\.roles\[prefill\]", done.stdout, re.M), done.stdout
    assert re.search(r"^\d+ failed, \d+ warnings?, \d+ passed", done.stdout, re.M)


def test_the_health_checks_on_a_master_with_a_secret(host: Host) -> None:
    address = with_secret(host)
    bare, token, doctor = commands("ops.metrics")
    done = host.run(bare, **host.at(address))
    assert (done.returncode, done.stdout) == (1, "")  # the master answered 401
    found = ok(host.run(token, **host.at(address)))
    assert re.search(r"^kvpool_kv_cache_blocks_total ", found, re.M), found
    assert re.search(r"^kvpool_connected_clients ", found, re.M), found
    done = host.run(doctor, **host.at(address))
    for check in ("master.reachable", "master.health", "master.metrics"):
        assert re.search(rf"^(PASS|WARN)\s+{re.escape(check)}\s", done.stdout, re.M), done.stdout


def test_logs_go_to_the_journal_and_the_containers_log(host: Host) -> None:
    journal, containers = commands("ops.logs")
    units = re.findall(r"-u (\S+)", journal)
    assert {f"{u}.service" for u in units} == {p.name for p in (ROOT / "deploy/systemd").iterdir()}
    for unit in units:  # no StandardOutput/StandardError: stderr goes to the journal
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        parser.read(ROOT / "deploy" / "systemd" / f"{unit}.service")
        assert not {"standardoutput", "standarderror"} & set(parser["Service"]), unit
    assert shutil.which("journalctl"), "scripts/setup.sh installs systemd"
    ok(host.run(journal))
    compose = yaml.safe_load((ROOT / "deploy/compose/docker-compose.yml").read_text())
    names = {s["container_name"] for s in compose["services"].values()}
    assert names == {"kvpool-master", "kvpool-node", "kvpool-proxy"}
    assert not any("logging" in s for s in compose["services"].values())  # the default log
    assert containers.split()[-1] in names
    if shutil.which("podman"):  # no such container runs here: podman says so, exit 125
        done = host.run(containers)
        assert done.returncode == 0 or (
            done.returncode == 125 and "no container with name" in done.stderr
        ), done.stderr
    # and the master's log is its stderr: PoolProcess reads "listening on" from there
    master = host.serve("kvpool master --host 127.0.0.1")
    assert any("listening on" in line for line in host.masters[-1].lines), master


# ------------------------------------------------------------------ monitoring.md
def test_status_once_and_as_json(host: Host) -> None:
    address = host.serve("kvpool master --host 127.0.0.1")
    once, as_json = commands("monitoring.status")
    assert f"kvpool {address}" in ok(host.run(once, **host.at(address)))
    assert json.loads(ok(host.run(as_json, **host.at(address))))["objects"] == 0


def test_the_metrics_check_with_the_token(host: Host) -> None:
    address = with_secret(host)
    (check,) = commands("monitoring.metrics")
    found = ok(host.run(check, **host.at(address)))
    assert re.search(r"^kvpool_connected_clients ", found, re.M), found


# -------------------------------------------------------------------- security.md
def test_secret_token_and_a_node_on_its_own_key(host: Host) -> None:
    address = with_secret(host)
    metrics, status = commands("security.check")
    assert "kvpool_kv_cache_blocks_total" in ok(host.run(metrics, **host.at(address)))
    assert json.loads(ok(host.run(status, **host.at(address))))["objects"] == 0
    (node_key,) = commands("security.node-key")
    ok(host.run(node_key))
    cred = host.tmp / "etc" / "kvpool" / "node.cred"
    assert re.fullmatch(r"kvpool-node:node-gpu3:[0-9a-f]{64}\n?", cred.read_text())
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    with start_node(node_config(host.tmp, address, secret_file=str(cred))) as node:
        assert node.address
        token = ok(host.run("kvpool secret token --secret-file /etc/kvpool/secret")).strip()
        wait_until(lambda: "kvpool_registered_nodes 2.0" in http(f"http://{address}/metrics",
                                                                 token)[1])  # fmt: skip


def test_an_open_master_refuses_with_the_documented_line(host: Host) -> None:
    (command,) = commands("security.open")
    done = host.run(command)
    blocks = read_blocks("docs/security.md")
    shown = blocks[blocks.index(doc_block("security.open")) + 1]
    assert (done.returncode, done.stderr.strip()) == (2, shown.text.strip())


def test_tls_master_and_status_with_the_ca(host: Host) -> None:
    pki = make_material(host.tmp / "pki")
    etc = host.tmp / "etc" / "kvpool"
    ok(host.run(commands("security.secret")[0]))
    shutil.copy(pki.server.cert, etc / "master.pem")
    shutil.copy(pki.server.key, etc / "master.key")
    shutil.copy(pki.ca.cert, etc / "ca.pem")
    serve, *client = commands("security.tls")
    address = host.serve(serve)
    shown = ok(host.run("\n".join(client), **host.at(address)))
    assert f"kvpool {address}" in shown, shown
    done = host.run("kvpool status --master 10.0.0.1:50088", **host.at(address))
    assert done.returncode == 1  # without the CA: refused, not served in plain text


def test_rotation_keeps_both_secrets_good(host: Host) -> None:
    ok(host.run(commands("security.secret")[0]))
    etc = host.tmp / "etc" / "kvpool"
    old = etc / "secret"
    shutil.copy(old, etc / "old")
    ok(host.run("\n".join(commands("security.rotate"))))
    lines = old.read_text().splitlines()
    assert len(lines) == 2 and lines[1] == (etc / "old").read_text().strip()
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    (etc / "new").write_text(lines[0] + "\n")
    address = host.serve(commands("security.secret")[1])
    for one in ("old", "new"):
        os.chmod(etc / one, 0o600)
        token = ok(host.run(f"kvpool secret token --secret-file /etc/kvpool/{one}")).strip()
        assert http(f"http://{address}/api/status", token)[0] == 200, one


def test_a_re_render_keeps_the_secret_and_new_secret_replaces_it(host: Host) -> None:
    render = commands("ops.render")[0]
    secret = host.tmp / "rendered" / "secret"
    ok(host.run(render))
    first = secret.read_text()
    ok(host.run(render))
    assert secret.read_text() == first
    (rotate,) = commands("security.render-rotate")
    ok(host.run(rotate))
    assert secret.read_text() != first


def test_a_tenant_key_and_its_quota(host: Host) -> None:
    ok(host.run(commands("security.secret")[0]))
    make, serve = commands("security.tenant")
    ok(host.run(make))
    cred = (host.tmp / "etc" / "kvpool" / "teamA.cred").read_text()
    assert re.fullmatch(r"kvpool-tenant:teamA:[0-9a-f]{64}\n?", cred)
    address = host.serve(serve)
    token = ok(host.run("kvpool secret token --secret-file /etc/kvpool/secret")).strip()
    _, metrics = http(f"http://{address}/metrics", token)
    quota = re.search(r'^kvpool_tenant_quota_bytes\{tenant="teamA"\} (\S+)$', metrics, re.M)
    assert quota and float(quota[1]) == 8 * 2**30, metrics
    set_b, show = commands("security.quota")
    assert (
        ok(host.run(set_b, **host.at(address))).strip() == "tenant teamB: quota 4.0 GiB, holds 0 B"
    )
    rows = {
        line.split()[0]: line.split()[1:3]
        for line in ok(host.run(show, **host.at(address))).splitlines()
    }
    assert rows["teamA"] == ["8.0", "GiB"] and rows["teamB"] == ["4.0", "GiB"], rows


# -------------------------------------------------------------------- connectors.md
def test_the_device_benchmark_refuses_clearly_without_cuda() -> None:
    (block,) = [b for b in read_blocks("docs/connectors.md") if b.marker == "connectors.device"]
    (command,) = block.commands()
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    import torch

    if torch.cuda.is_available():  # a GPU host: the measurement runs
        assert done.returncode == 0, done.stdout + done.stderr
        return
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 1 and len(out.splitlines()) == 1, out
    assert out.startswith("device_pages: no CUDA device here"), out

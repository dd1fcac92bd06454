"""Node identity bound to the credential, and safe defaults at start-up.

The issue's takeover: a node started with a live node's id made the master drop the real
node (its readable objects went from 40 to 0).  With a secret, an id that owns storage
belongs to the connection that registered it, and a node credential is one id's only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import AuthError, PoolError
from kvpool.protocol import messages as m
from kvpool.security.credentials import Credential
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.master.auth_pool import SECRET, secret_file, secured_pool
from tests.waiting import wait_until

CLUSTER = Credential.parse(SECRET, "k")


def _readable(c: Client, values: dict[str, bytes]) -> int:
    return sum(c.get(k) == v for k, v in values.items())


def test_a_live_nodes_id_cannot_be_taken_over(tmp_path: Path) -> None:
    with secured_pool(tmp_path) as pool, Client(pool.master.address, credential=SECRET) as c:
        values = {f"k{i}": bytes([i]) * 4096 for i in range(40)}
        for key, value in values.items():
            c.put(key, value)
        assert _readable(c, values) == 40
        real = pool.node_id
        # another node's credential: it may speak only as its own id
        other = Credential.parse(CLUSTER.node_credential("node-intruder"), "k")
        with (
            Client(
                pool.master.address, credential=other, client_id="node-intruder", role="node"
            ) as intruder,
            pytest.raises(AuthError, match="may not send Register as " + real),
        ):
            intruder.call(m.Register(real, "127.0.0.1:9", ""))
        # registered as itself, it cannot announce objects in the real node's segment
        (owner,) = [o for o in c.stats()["clients"] if o["client_id"] == real]
        with Client(
            pool.master.address, credential=other, client_id="node-intruder", role="node"
        ) as intruder:
            intruder.call(m.Register("node-intruder", "127.0.0.1:9", ""))
            with pytest.raises(PoolError, match="a node restores only its own segments"):
                intruder.call(m.Restore("node-intruder", owner["segments"][0], [("k0", 0, 9, 1)]))
        # cannot even claim the id in the handshake: the key is not derivable
        with (
            Client(pool.master.address, credential=other, client_id=real, role="node") as bad,
            pytest.raises(AuthError, match="cannot act for " + real),
        ):
            bad.call(m.Heartbeat(real))
        # the cluster secret on another connection: the live node keeps its id
        with Client(pool.master.address, credential=SECRET, client_id=real) as thief:
            for request in (
                m.Register(real, "127.0.0.1:9", ""),
                m.AddSegment(real, "stolen", 1 << 20),
                m.Heartbeat(real),
            ):
                with pytest.raises(AuthError, match="live node on another connection"):
                    thief.call(request)
        assert _readable(c, values) == 40
        (owner,) = [o for o in c.stats()["clients"] if o["client_id"] == real]
        assert owner["address"] == pool.data_address


def test_a_second_node_with_a_live_nodes_credential_is_refused(tmp_path: Path) -> None:
    node_cred = secret_file(tmp_path, CLUSTER.node_credential("node-fixed"), "node-fixed")
    cluster = secret_file(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with start_master("--segment_size", "0", "--secret_file", str(cluster)) as master:
        first = node_config(tmp_path / "a", master.address, secret_file=str(node_cred))
        with start_node(first) as node, Client(master.address, credential=SECRET) as c:
            wait_until(lambda: c.stats()["tiers"]["memory"]["capacity"] > 0)
            (owner,) = [o for o in c.stats()["clients"] if o["client_id"].startswith("node-")]
            assert owner["client_id"] == "node-fixed"  # the credential names the id
            values = {f"k{i}": bytes([i]) * 4096 for i in range(10)}
            for key, value in values.items():
                c.put(key, value)
            second = node_config(tmp_path / "b", master.address, secret_file=str(node_cred))
            # it never gets to serve: each registration is refused (and retried, logged).
            # The wait is for the refusal to be logged at least once: 4 s was too short for
            # a node to start and be refused on a host loaded by other jobs.
            env = {"KVPOOL_CONFIG_PATH": str(second)}
            with pytest.raises(RuntimeError, match="live node on another connection"):
                PoolProcess(["node", "--data-port", "0"], env=env, ready_timeout_s=15)
            assert node.proc.poll() is None
            assert _readable(c, values) == 10


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# An address of no interface here: had the command tried to bind it, it would say it
# cannot listen; the refusal says why first, so it comes before any bind.
ELSEWHERE = "10.254.0.1"


def test_a_master_beyond_loopback_without_a_secret_refuses_to_start() -> None:
    done = _run("master", "--host", ELSEWHERE, "--port", "0", "--segment_size", "0")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"--host {ELSEWHERE}" in line and "--secret_file" in line and "--insecure" in line
    done = _run("master", "--host", ELSEWHERE, "--port", "0", "--insecure", "--segment_size", "0")
    assert done.returncode == 2 and "cannot listen on" in done.stderr  # it got to the bind


def test_a_node_beyond_loopback_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    config = node_config(tmp_path, "127.0.0.1:1", local_hostname=ELSEWHERE)
    env = {"KVPOOL_CONFIG_PATH": str(config), "PATH": "/usr/bin:/bin"}
    done = _run("node", env=env)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"local_hostname {ELSEWHERE}" in line and "--insecure" in line


def test_a_world_readable_secret_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    path.chmod(0o644)
    done = _run("master", "--port", "0", "--secret_file", str(path))
    assert done.returncode == 2
    assert f"run `chmod 600 {path}`" in done.stderr and len(done.stderr.splitlines()) == 1


_IN_NAMESPACE = """
import json, subprocess, sys
for cmd in ("ip link set lo up", "ip link add v0 type veth peer name v1",
            "ip addr add 10.77.0.1/24 dev v0", "ip link set v0 up", "ip link set v1 up"):
    subprocess.run(cmd.split(), check=True, timeout=10)
from kvpool.errors import AuthError, PoolError
from kvpool.client.client import Client
from kvpool.testing.processes import start_master
argv = [sys.executable, "-m", "kvpool", "master", "--host", "10.77.0.1", "--port", "0"]
done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
out = {"rc": done.returncode, "refusal": done.stderr.strip()}
with start_master("--host", "10.77.0.1", "--segment_size", "1MiB",
                  "--secret_file", sys.argv[1]) as master:
    out["host"] = master.host
    with Client(master.address, credential=sys.argv[2], allow_shm=False) as c:
        c.put("k", b"served on 10.77.0.1")
        out["get"] = c.get("k").decode()
    try:
        with Client(master.address, credential=None) as c:
            c.exists("k")
    except AuthError as exc:
        out["no_credential"] = str(exc)
print(json.dumps(out))
"""


def test_on_a_10x_address_in_a_namespace_the_pool_needs_the_secret(tmp_path: Path) -> None:
    """A real non-loopback bind: a veth link on 10.77.0.1 in a network namespace this
    test creates (unshare -n), reached from inside it."""
    path = secret_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", _IN_NAMESPACE, str(path), SECRET],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rc"] == 2 and "--host 10.77.0.1" in out["refusal"]
    assert "--insecure" in out["refusal"]
    assert out["host"] == "10.77.0.1" and out["get"] == "served on 10.77.0.1"
    assert "requires a credential" in out["no_credential"]

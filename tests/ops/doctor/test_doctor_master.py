"""``kvpool doctor`` against a real ``kvpool master`` process on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.net import http_get
from kvpool.ops.doctor import DoctorOptions, format_text, probes, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.render import parse_inventory, render, write_rendered
from kvpool.testing import lifetime
from tests.ops.helpers import MLA_MODEL, free_port_range


@pytest.fixture
def real_master(tmp_path: Path) -> Iterator[str]:
    port = free_port_range(1)
    log = (tmp_path / "master.log").open("w")
    argv = [
        sys.executable,
        "-m",
        "kvpool",
        "master",
        "--port",
        str(port),
        "--segment_size",
        "16MiB",
    ]
    proc = lifetime.popen(argv, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while http_get(f"http://{address}/health", 1.0).status != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    "kvpool master did not come up:\n" + (tmp_path / "master.log").read_text()
                )
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


def test_doctor_reads_a_real_master(real_master: str) -> None:
    checks = {c.name: c for c in run_doctor(DoctorOptions(master=real_master), env={})}
    for name in ("master.reachable", "master.health", "master.metrics"):
        assert checks[name].status is Status.PASS, checks[name]
    assert "kvpool_connected_clients" in checks["master.metrics"].message


def test_nodes_compare_block_keys_through_the_pool(real_master: str) -> None:
    first = probes.cross_node_probe(real_master, "10.0.0.1", "x")
    assert first == (None, True, None)  # published
    other, published, error = probes.cross_node_probe(real_master, "10.0.0.2", "x")
    assert error is None and not published and other is not None
    assert other["host"] == "10.0.0.1" and other["keys"] == probes.local_probe_keys()
    options = DoctorOptions(master=real_master)
    check = next(c for c in run_doctor(options, env={}) if c.name == "keys.cross_node")
    assert check.status is Status.PASS and "10.0.0.1" in check.message


def test_a_node_with_other_block_keys_is_caught(real_master: str) -> None:
    with Client(real_master) as client:
        stale = {"host": "10.0.0.7", "version": "0.0.1", "keys": ["00" * 16]}
        client.put(probes.CROSS_NODE_KEY, json.dumps(stale).encode())
    options = DoctorOptions(master=real_master)
    check = next(c for c in run_doctor(options, env={}) if c.name == "keys.cross_node")
    assert check.status is Status.FAIL
    assert "10.0.0.7" in check.message and "same kvpool version" in check.fix


def test_rendered_configs_pass_doctor_against_a_real_master(
    tmp_path: Path, real_master: str
) -> None:
    base = free_port_range(102)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MLA_MODEL))
    inventory = {
        "model": str(model),
        "master_port": int(real_master.rpartition(":")[2]),
        "prefill_kv_port": base,
        "decode_kv_port": base + 100,
        "consumer_is_to_put": True,
        "hosts": [
            {"name": "p0", "address": "127.0.0.1", "role": "prefill", "tp_size": 2},
            {"name": "d0", "address": "127.0.0.1", "role": "decode"},
        ],
    }
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(inventory)), out)
    options = DoctorOptions(
        prefill_config=str(out / "p0" / "serve.sh"),
        decode_config=str(out / "d0" / "serve.sh"),
        model=str(model),
        master_cmd=str(out / "master.sh"),
    )
    checks = run_doctor(options, env={"KVPOOL_CONFIG_PATH": str(out / "p0" / "mooncake.json")})
    report = format_text(checks)
    assert [c for c in checks if c.status in (Status.FAIL, Status.WARN)] == [], report
    passed = {c.name for c in checks if c.status is Status.PASS}
    assert {"master.health", "keys.agreement", "keys.cross_node", "config.master"} <= passed

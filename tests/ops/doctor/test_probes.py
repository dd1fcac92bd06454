"""The edge probes against real sockets, files and subprocesses on this machine."""

from __future__ import annotations

import socket
from pathlib import Path

from kvpool.ops.doctor import probes
from tests.ops.helpers import StandInMaster, free_ports


def test_bind_probe_sees_a_listener_and_a_free_port() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert probes.port_bind_error(port) is not None
    assert probes.port_bind_error(port) is None


def test_connect_probe_to_a_closed_port_reports_the_refusal() -> None:
    [port] = free_ports(1)
    error = probes.tcp_connect_error("127.0.0.1", port, timeout_s=2)
    assert error is not None


def test_address_probe_knows_loopback_is_local_and_test_net_is_not() -> None:
    assert probes.address_is_local("127.0.0.1") is None
    assert probes.address_is_local("192.0.2.1") is not None  # RFC 5737 TEST-NET-1
    assert probes.address_is_local("no-such-host.invalid") is not None


def test_master_probe_reads_health_and_metrics(master: StandInMaster) -> None:
    facts = probes.probe_master(master.address)
    assert facts.connect_error is None and facts.health_status == 200
    assert facts.metrics_text is not None and "kvpool_connected_clients" in facts.metrics_text


def test_master_probe_on_a_non_master_port_reports_the_http_status() -> None:
    with StandInMaster(health_status=503) as sick:
        facts = probes.probe_master(sick.address)
    assert facts.health_status == 503 and facts.metrics_text is None
    [port] = free_ports(1)
    assert probes.probe_master(f"127.0.0.1:{port}").connect_error is not None


def test_ssd_probe_counts_free_space_and_tier_bytes(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "block").write_bytes(b"x" * 4096)
    facts = probes.ssd_facts(str(tmp_path))
    assert facts.exists and facts.is_dir and facts.writable
    assert facts.free_bytes is not None and facts.free_bytes > 0
    assert facts.tier_bytes == 4096
    assert list(tmp_path.glob(".kvpool-doctor-*")) == []  # the write probe cleans up
    missing = probes.ssd_facts(str(tmp_path / "nope"))
    assert not missing.exists
    not_dir = probes.ssd_facts(str(tmp_path / "sub" / "block"))
    assert not_dir.exists and not not_dir.is_dir


def test_key_probe_agrees_across_pythonhashseed_values() -> None:
    results = probes.key_probe(("0", "1", "random"))
    assert set(results) == {
        "this process",
        "PYTHONHASHSEED=0",
        "PYTHONHASHSEED=1",
        "PYTHONHASHSEED=random",
    }
    values = list(results.values())
    assert all(isinstance(v, list) and len(v) == 4 for v in values)  # 64 tokens / chunks of 16
    assert all(v == values[0] for v in values)

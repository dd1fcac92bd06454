"""A kvpool client (and ``kvpool node``) pointed at a real ``mooncake_master``.

Mooncake's RPC port closes a kvpool frame without a word; the client must then say what
answered, at connect time, instead of "peer closed the connection after 0 of 12 bytes".
Everything Mooncake runs in a private network namespace (kvpool.testing.mooncake), and
so does the client under test.  The master's metrics port is not Mooncake's default 9003,
so nothing here can lean on finding it: what answers is told from the RPC port itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.testing.mooncake import Namespace
from kvpool.testing.processes import node_config

RPC = "127.0.0.1:50051"


@pytest.fixture(scope="module")
def ns() -> Iterator[Namespace]:
    with Namespace() as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster", metrics_port=9113)
        yield ns


# ------------------------------------------------------------- in the namespace
def client_error(address: str) -> tuple[str, str]:
    """The error a kvpool client meets on its first call to ``address``."""
    from kvpool.client.client import Client

    client = Client(address, timeout_s=5)
    try:
        client.exists("some-key")
    except Exception as exc:  # the test asserts on the class
        return type(exc).__name__, str(exc)
    finally:
        client.close()
    return "", "no error"


# ------------------------------------------------------------------- in the test
def test_a_client_says_a_mooncake_master_answered(ns: Namespace) -> None:
    kind, message = ns.run("tests.client.test_master_link_mooncake:client_error", RPC)
    assert kind == "ConfigError", message
    assert "Mooncake master" in message and RPC in message
    assert "backend mooncake" in message and "docs/mooncake.md" in message
    assert "0 of 12 bytes" not in message


def test_kvpool_node_stops_with_status_2_and_one_line(ns: Namespace, tmp_path: Path) -> None:
    config = node_config(tmp_path, RPC)
    done = ns.run(
        "subprocess:run",
        [sys.executable, "-m", "kvpool", "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len([line for line in lines if "Mooncake master" in line]) == 1, done.stderr
    assert "retrying" not in done.stderr and "0 of 12 bytes" not in done.stderr

"""Credentials on the prefill's ``kv_port``, on both transports: a D with no credential,
a wrong secret or a node's credential is refused (its load fails, so vLLM recomputes) and
P keeps serving a D with the right secret; a P reachable beyond loopback without a
credential does not start.

kvpool's TCP runs in this process on 127.0.0.1; the Transfer Engine's control channel
runs in a private network namespace (the engine binds every interface), as in
test_transports.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import load_any_node_config
from kvpool.security.credentials import Credential
from kvpool.security.secret import connector_credential
from tests.connectors.transfer import auth_scenarios, scenarios
from tests.connectors.transfer.helpers import POLL_S, Run, on_transport

SECRET = "0f6c1d7e5a9b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d"
WRONG = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d"


def _secret(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("kv-secrets")
    node = auth_scenarios.make_credential_text(SECRET, "node-a")
    return {
        "right": _secret(tmp, "right", SECRET),
        "wrong": _secret(tmp, "wrong", WRONG),
        "node": _secret(tmp, "node", node),
    }


@pytest.fixture(params=["kvpool", scenarios.ENGINE])
def run(request: pytest.FixtureRequest) -> Run:
    return on_transport(request, auth_scenarios)


def _refused_then_served(got: dict[str, Any]) -> None:
    assert got["failed"] == {"a"} and got["load_errors"] == {0, 1}  # vLLM recomputes
    assert not got["a_equal"]  # not one page of P's reached the refused D
    assert got["elapsed"] < POLL_S
    assert got["refused_auth"] >= 2  # the worker's pull and the hand-made one
    # the server kept serving: a D with the right secret gets its pages
    assert got["good_failed"] == set() and got["b_equal"] and got["b_sent"]


def test_a_decode_without_a_credential_is_refused_in_the_pull_protocols_words(
    run: Run, files: dict[str, str]
) -> None:
    got = run("credentials", files["right"], "", files["right"])
    _refused_then_served(got)
    assert got["raw_error"].startswith(
        "TransferError: prefill refused: AuthError: prefill 127.0.0.1:"
    ), got["raw_error"]
    assert "requires a credential" in got["raw_error"]
    assert "KVPOOL_SECRET_FILE" in got["raw_error"]


def test_a_decode_with_a_wrong_secret_is_refused(run: Run, files: dict[str, str]) -> None:
    got = run("credentials", files["right"], files["wrong"], files["right"])
    _refused_then_served(got)
    assert got["raw_error"].startswith("AuthError: prefill 127.0.0.1:"), got["raw_error"]
    assert "different secrets" in got["raw_error"]


def test_the_right_secret_pulls_byte_equal(run: Run, files: dict[str, str]) -> None:
    got = run("credentials", files["right"], files["right"], files["right"])
    assert got["failed"] == set() and got["load_errors"] == set() and got["a_equal"]
    assert got["raw_error"] == "no error"  # the hand-made pull was served too
    assert got["refused_auth"] == 0
    assert got["good_failed"] == set() and got["b_equal"]


def test_a_decode_with_a_secret_is_not_fooled_by_an_open_prefill(
    run: Run, files: dict[str, str]
) -> None:
    # a prefill without a secret cannot prove one: D refuses to take its pages
    got = run("credentials", "", files["right"], "")
    assert got["failed"] == {"a"} and not got["a_equal"]
    assert got["raw_error"].startswith("AuthError: prefill 127.0.0.1:"), got["raw_error"]
    assert "handshake" in got["raw_error"]


def test_a_flood_with_no_credential_locks_no_decode_out(run: Run, files: dict[str, str]) -> None:
    # 2,000 idle and 2,000 slow-handshake connections on P's kv_port: they wait without
    # a thread and go after the handshake deadline, or when the room is full
    got = run("flooded", files["right"], 2000)
    assert got["failed"] == set() and got["load_errors"] == set() and got["equal"]
    assert got["refused"] > 0  # the flood was met, and closed


def test_a_storage_nodes_credential_cannot_pull(files: dict[str, str]) -> None:
    error = auth_scenarios.node_credential_cannot_pull("kvpool", files["right"], files["node"])
    assert error.startswith("AuthError: prefill 127.0.0.1:"), error
    assert "cannot be a client" in error


# -- safe by default -------------------------------------------------------------------


def _producer(kv_host: str, **extra: Any) -> TransferConfig:
    return TransferConfig.from_values(
        role="kv_producer",
        kv_port=30000,
        engine_id="g",
        extra={"decode": {"tp_size": 1}, "kv_host": kv_host, **extra},
        env={},
    )


def test_a_prefill_beyond_loopback_without_a_credential_does_not_start() -> None:
    cfg = _producer("10.7.0.2")
    with pytest.raises(ConfigError) as info:
        TransferWorker(cfg, RankInfo(0, 1, 0, 2), env={})
    message = str(info.value)
    assert "\n" not in message
    assert "kv_host 10.7.0.2" in message and "secret_file" in message
    assert '"insecure": true' in message and "KVPOOL_INSECURE=1" in message


def test_insecure_or_a_credential_or_loopback_lets_a_prefill_start(files: dict[str, str]) -> None:
    rank = RankInfo(0, 1, 0, 2)
    cases = [
        TransferConfig.from_values(
            role="kv_producer",
            kv_port=30000,
            engine_id="g",
            extra={"decode": {"tp_size": 1}, "kv_host": "10.7.0.2", "insecure": True},
            env={},
        ),
        TransferConfig.from_values(
            role="kv_producer",
            kv_port=30000,
            engine_id="g",
            extra={"decode": {"tp_size": 1}, "kv_host": "10.7.0.2"},
            env={"KVPOOL_INSECURE": "1"},
        ),
        _producer("127.0.0.1"),
    ]
    assert [c.insecure for c in cases] == [True, True, False]
    for cfg in cases:
        TransferWorker(cfg, rank, env={}).close()
    # the credential from the environment, as vLLM's processes get it
    TransferWorker(_producer("10.7.0.2"), rank, env={"KVPOOL_SECRET_FILE": files["right"]}).close()
    # a decode never listens: it needs no credential to start
    decode = TransferConfig(role="kv_consumer", kv_port=30100, engine_id="g",
                            peer=Topology(1, 1), kv_host="10.7.0.3")  # fmt: skip
    TransferWorker(decode, rank, env={}).close()


def test_a_bad_insecure_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r'kv_connector_extra_config\["insecure"\]'):
        _producer("10.7.0.2", insecure="maybe")
    with pytest.raises(ConfigError, match="KVPOOL_INSECURE"):
        TransferConfig.from_values(
            role="kv_producer",
            kv_port=30000,
            engine_id="g",
            extra={"decode": {"tp_size": 1}},
            env={"KVPOOL_INSECURE": "sure"},
        )


def test_the_node_configs_secret_file_is_the_connectors_and_wins_over_the_environment(
    files: dict[str, str], tmp_path: Path
) -> None:
    node_json = tmp_path / "mooncake.json"
    node = {
        "local_hostname": "10.7.0.2",
        "metadata_server": "10.7.0.1:50088",
        "protocol": "tcp",
        "secret_file": files["right"],
    }
    node_json.write_text(json.dumps(node))
    cfg = TransferConfig.from_values(
        role="kv_producer",
        kv_port=30000,
        engine_id="g",
        extra={"decode": {"tp_size": 1}},
        env={},
        node=load_any_node_config(node_json, env={}),
    )
    assert cfg.kv_host == "10.7.0.2" and cfg.secret_file == files["right"]
    env = {"KVPOOL_SECRET_FILE": files["wrong"]}
    found = connector_credential(cfg.secret_file, env)
    assert found == Credential.parse(SECRET, "k")
    assert connector_credential("", env) == Credential.parse(WRONG, "k")
    assert connector_credential("", {}) is None
    TransferWorker(cfg, RankInfo(0, 1, 0, 2), env={}).close()  # starts: it has a credential

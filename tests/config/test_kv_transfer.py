from __future__ import annotations

from typing import Any

import pytest

from kvpool.config import NodeConfig, Timeouts
from kvpool.config.kv_transfer import TransferConfig, pairing_group
from kvpool.config.topology import Topology
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import MooncakeNodeConfig

GUIDE_EXTRA = {"prefill": {"dp_size": 4, "tp_size": 8}, "decode": {"dp_size": 8, "tp_size": 4}}


def build(
    role: str = "kv_producer",
    extra: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    port: object = "30000",
    engine_id: str | None = "g0",
    node: NodeConfig | MooncakeNodeConfig | None = None,
) -> TransferConfig:
    return TransferConfig.from_values(
        role=role,
        kv_port=port,
        engine_id=engine_id,
        extra=extra or {},
        env=env or {},
        node=node,
    )


def test_guide_json_on_prefill_reads_the_decode_topology() -> None:
    cfg = build("kv_producer", GUIDE_EXTRA)
    assert cfg.kv_port == 30000
    assert cfg.peer == Topology(8, 4)
    assert cfg.is_producer and not cfg.is_consumer


def test_guide_json_on_decode_reads_the_prefill_topology() -> None:
    cfg = build("kv_consumer", GUIDE_EXTRA, port="30100")
    assert cfg.peer == Topology(4, 8)
    assert cfg.is_consumer and not cfg.is_producer


def test_defaults() -> None:
    cfg = build()
    assert (cfg.connect_timeout_ms, cfg.transfer_timeout_ms, cfg.hold_timeout_ms) == (
        10000,
        10000,
        120000,
    )
    assert cfg.kv_host == "127.0.0.1"
    assert cfg.peer is None


def test_timeouts_from_the_guides_env_names_and_kvpool_twins() -> None:
    ascend = build(env={"ASCEND_CONNECT_TIMEOUT": "7000", "ASCEND_TRANSFER_TIMEOUT": "8000"})
    assert (ascend.connect_timeout_ms, ascend.transfer_timeout_ms) == (7000, 8000)
    ours = build(
        env={
            "ASCEND_CONNECT_TIMEOUT": "7000",
            "KVPOOL_CONNECT_TIMEOUT_MS": "300",
            "KVPOOL_TRANSFER_TIMEOUT_MS": "400",
            "KVPOOL_HOLD_TIMEOUT_MS": "500",
        }
    )
    assert (ours.connect_timeout_ms, ours.transfer_timeout_ms, ours.hold_timeout_ms) == (
        300,
        400,
        500,
    )
    explicit = build(extra={"connect_timeout_ms": 42}, env={"KVPOOL_CONNECT_TIMEOUT_MS": "300"})
    assert explicit.connect_timeout_ms == 42


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "producer"}, "kv_role"),
        ({"port": "thirty"}, "kv_port"),
        ({"port": 70000}, "kv_port"),
        ({"extra": {"kv_prot": 1}}, "kv_prot"),
        ({"extra": {"decode": {"tp": 4}}}, "tp"),
        ({"env": {"ASCEND_CONNECT_TIMEOUT": "ten"}}, "ASCEND_CONNECT_TIMEOUT"),
        ({"env": {"KVPOOL_TRANSFER_TIMEOUT_MS": "0"}}, "KVPOOL_TRANSFER_TIMEOUT_MS"),
        ({"extra": {"hold_timeout_ms": -5}}, "hold_timeout_ms"),
        ({"extra": {"idle_wait_ms": -1}}, "idle_wait_ms"),
        ({"env": {"KVPOOL_IDLE_WAIT_MS": "5000"}}, "KVPOOL_IDLE_WAIT_MS"),
        ({"env": {"KVPOOL_IDLE_WAIT_MS": "soon"}}, "KVPOOL_IDLE_WAIT_MS"),
        ({"extra": {"kv_host": 5}}, "kv_host"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(**kwargs)


def test_idle_wait_defaults_to_10_ms_and_0_turns_it_off() -> None:
    assert build().idle_wait_ms == 10
    assert build(extra={"idle_wait_ms": 0}).idle_wait_ms == 0
    assert build(env={"KVPOOL_IDLE_WAIT_MS": "3"}).idle_wait_ms == 3
    assert build(extra={"idle_wait_ms": 7}, env={"KVPOOL_IDLE_WAIT_MS": "3"}).idle_wait_ms == 7


def test_kv_host_from_config_or_env() -> None:
    assert build(extra={"kv_host": "10.0.0.5"}).kv_host == "10.0.0.5"
    assert (
        build(env={"KVPOOL_KV_HOST": "10.0.0.6", "VLLM_HOST_IP": "10.0.0.7"}).kv_host == "10.0.0.6"
    )
    assert build(env={"VLLM_HOST_IP": "10.0.0.7"}).kv_host == "10.0.0.7"


def test_pairing_group_ignores_generated_ids_and_dp_suffixes() -> None:
    assert pairing_group("glm-group-0") == "glm-group-0"
    assert pairing_group("glm-group-0_dp3") == "glm-group-0"
    assert pairing_group("eb936a3b-b9c7-4fe8-a829-51e4ea181170") is None
    assert pairing_group("eb936a3b-b9c7-4fe8-a829-51e4ea181170_dp1") is None
    assert build(engine_id="g7_dp2").group == "g7"


NODE = NodeConfig(local_hostname="10.0.0.8", master_host="10.0.0.1", timeouts=Timeouts(3000, 4000))


def test_node_config_host_sits_between_explicit_and_vllm_host_ip() -> None:
    assert build(env={"VLLM_HOST_IP": "10.0.0.7"}, node=NODE).kv_host == "10.0.0.8"
    assert build(env={"KVPOOL_KV_HOST": "10.0.0.6"}, node=NODE).kv_host == "10.0.0.6"


def test_node_config_timeouts_are_defaults_the_environment_overrides() -> None:
    cfg = build(node=NODE)
    assert (cfg.connect_timeout_ms, cfg.transfer_timeout_ms) == (3000, 4000)
    assert build(node=NODE, env={"ASCEND_CONNECT_TIMEOUT": "500"}).connect_timeout_ms == 500


def test_the_node_config_protocol_chooses_the_transport() -> None:
    assert build().protocol == "tcp"  # no node config: kvpool's TCP
    assert build(node=NodeConfig("10.0.0.8", "10.0.0.1", protocol="tcp")).protocol == "tcp"
    assert build(node=NodeConfig("10.0.0.8", "10.0.0.1", protocol="rdma")).protocol == "rdma"


def test_a_mooncake_node_config_gives_host_and_protocol_and_leaves_timeouts_default() -> None:
    # The guide's P and D on real Mooncake: one mooncake.json (vllm-ascend's) for both
    # MultiConnector children; it has no kvpool timeouts, so the defaults and env apply.
    node = MooncakeNodeConfig("10.0.0.8", "P2PHANDSHAKE", "10.0.0.1:50051", protocol="tcp")
    cfg = build(node=node)
    assert cfg.kv_host == "10.0.0.8" and cfg.protocol == "tcp"
    assert cfg.connect_timeout_ms == build().connect_timeout_ms
    assert cfg.transfer_timeout_ms == build().transfer_timeout_ms
    assert build(node=node, env={"ASCEND_CONNECT_TIMEOUT": "500"}).connect_timeout_ms == 500

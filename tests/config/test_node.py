from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.config import (
    DEFAULT_OFFLOAD_LIMIT,
    NodeConfig,
    config_path_from_env,
    load_node_config,
    parse_node_config,
)
from kvpool.errors import ConfigError

GUIDE_NODE = {
    "local_hostname": "10.0.0.2",
    "metadata_server": "10.0.0.1:50088",
    "protocol": "tcp",
    "device_name": "ibp8s0f0",
    "enable_ssd_offload": True,
    "ssd_offload_path": "/mnt/nvme/mooncake_ssd",
}


def test_the_seeds_mooncake_json_parses_with_tcp() -> None:
    cfg = parse_node_config(GUIDE_NODE, env={})
    assert cfg == NodeConfig(
        local_hostname="10.0.0.2",
        master_host="10.0.0.1",
        master_port=50088,
        protocol="tcp",
        device_name="ibp8s0f0",
        enable_ssd_offload=True,
        ssd_offload_path="/mnt/nvme/mooncake_ssd",
        ssd_offload_limit=DEFAULT_OFFLOAD_LIMIT,
    )
    assert cfg.master_address == "10.0.0.1:50088"
    assert DEFAULT_OFFLOAD_LIMIT == 2 * 2**40  # the production guide's "2TB" default


def test_rdma_without_an_rdma_transport_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config({**GUIDE_NODE, "protocol": "rdma"}, protocols=("tcp",))
    message = str(err.value)
    assert message.startswith("protocol")
    assert '"protocol": "tcp"' in message


def test_rdma_is_accepted_where_a_transport_serves_it() -> None:
    cfg = parse_node_config({**GUIDE_NODE, "protocol": "rdma"}, protocols=("tcp", "rdma"))
    assert cfg.protocol == "rdma"


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"local_hostnme": "x"}, "local_hostnme"),
        ({"local_buffer_size": "1GB"}, "local_buffer_size"),
        ({"protocol": "carrier-pigeon"}, "protocol"),
        ({"enable_ssd_offload": "yes please"}, "enable_ssd_offload"),
        ({"metadata_server": "10.0.0.1"}, "metadata_server"),
        ({"metadata_server": "10.0.0.1:99999"}, "metadata_server"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"ssd_offload_path": ""}, "ssd_offload_path"),
        ({"local_hostname": 17}, "local_hostname"),
        ({"transfer_timeout_ms": 0}, "transfer_timeout_ms"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors_naming_the_key(
    change: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config({**GUIDE_NODE, **change})
    assert key in str(err.value)


def test_missing_required_keys_are_named() -> None:
    for key in ("local_hostname", "metadata_server"):
        data = {k: v for k, v in GUIDE_NODE.items() if k != key}
        with pytest.raises(ConfigError, match=key):
            parse_node_config(data)


def test_env_offload_limit_kvpool_twin_wins_over_mooncake_and_the_file() -> None:
    data = {**GUIDE_NODE, "ssd_offload_limit": "3TB"}
    assert parse_node_config(data).ssd_offload_limit == 3 * 10**12
    env = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "1073741824000"}
    assert parse_node_config(data, env=env).ssd_offload_limit == 1073741824000
    env["KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] = "1TB"
    assert parse_node_config(data, env=env).ssd_offload_limit == 10**12
    with pytest.raises(ConfigError, match="KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"):
        parse_node_config(data, env={"KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "huge"})


def test_config_path_kvpool_variable_wins() -> None:
    assert config_path_from_env({}) is None
    env = {"MOONCAKE_CONFIG_PATH": "/a.json"}
    assert config_path_from_env(env) == ("MOONCAKE_CONFIG_PATH", Path("/a.json"))
    env["KVPOOL_CONFIG_PATH"] = "/b.json"
    assert config_path_from_env(env) == ("KVPOOL_CONFIG_PATH", Path("/b.json"))


def test_load_node_config_reads_the_file_named_by_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(GUIDE_NODE))
    cfg = load_node_config(env={"MOONCAKE_CONFIG_PATH": str(path)}, protocols=("tcp",))
    assert cfg.local_hostname == "10.0.0.2"
    assert cfg.source == str(path)


def test_load_node_config_errors_name_the_variable_and_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVPOOL_CONFIG_PATH: not set"):
        load_node_config(env={})
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH=.*cannot read"):
        load_node_config(env={"MOONCAKE_CONFIG_PATH": str(missing)})
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "local_hostname": "x",\n}')
    with pytest.raises(ConfigError, match="line 3"):
        load_node_config(broken, env={})

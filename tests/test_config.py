from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.config import (
    DEFAULT_OFFLOAD_LIMIT,
    MasterConfig,
    NodeConfig,
    Timeouts,
    config_path_from_env,
    load_node_config,
    parse_host_port,
    parse_node_config,
    parse_size,
    parse_timeouts,
)
from kvpool.errors import ConfigError

SEED_NODE = {
    "local_hostname": "10.0.0.2",
    "metadata_server": "10.0.0.1:50088",
    "protocol": "tcp",
    "device_name": "ibp8s0f0",
    "enable_ssd_offload": True,
    "ssd_offload_path": "/mnt/nvme/mooncake_ssd",
}


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1073741824000", 1073741824000),
        (1073741824000, 1073741824000),
        ("2TiB", 2 * 2**40),
        ("2tb", 2 * 10**12),
        ("0.5kB", 500),
        (" 7 B ", 7),
    ],
)
def test_parse_size_accepts_decimal_binary_and_plain_bytes(text: object, expected: int) -> None:
    assert parse_size(text, key="global_segment_size") == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("4G", "4GB"),  # ambiguous: the message offers 4GB and 4GiB
        ("4 bananas", "unknown size unit"),
        ("-4GB", "cannot read"),
        ("1.5", "whole number"),
        ("0.1 B", "whole number"),
        (True, "expected a size"),
        (-1, "negative"),
        (1.5, "expected a size"),
    ],
)
def test_parse_size_refuses_bad_values_naming_the_key(text: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(text, key="ssd_offload_limit")
    assert "ssd_offload_limit" in str(err.value)
    assert fragment in str(err.value)


@given(st.integers(min_value=0, max_value=2**50))
def test_parse_size_of_plain_bytes_round_trips(n: int) -> None:
    assert parse_size(str(n), key="k") == n
    assert parse_size(f"{n}B", key="k") == n


# ---------------------------------------------------------------- node config


def test_the_seeds_mooncake_json_parses_with_tcp() -> None:
    cfg = parse_node_config(SEED_NODE, env={})
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
    assert DEFAULT_OFFLOAD_LIMIT == 2 * 2**40  # the seed's "2TB" default


def test_rdma_without_an_rdma_transport_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config({**SEED_NODE, "protocol": "rdma"}, protocols=("tcp",))
    message = str(err.value)
    assert message.startswith("protocol")
    assert '"protocol": "tcp"' in message


def test_rdma_is_accepted_where_a_transport_serves_it() -> None:
    cfg = parse_node_config({**SEED_NODE, "protocol": "rdma"}, protocols=("tcp", "rdma"))
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
        parse_node_config({**SEED_NODE, **change})
    assert key in str(err.value)


def test_missing_required_keys_are_named() -> None:
    for key in ("local_hostname", "metadata_server"):
        data = {k: v for k, v in SEED_NODE.items() if k != key}
        with pytest.raises(ConfigError, match=key):
            parse_node_config(data)


def test_master_server_address_is_accepted_as_mooncake_spells_it() -> None:
    data = {"local_hostname": "h", "master_server_address": "m:1234"}
    assert parse_node_config(data).master_address == "m:1234"


def test_env_offload_limit_kvpool_twin_wins_over_mooncake_and_the_file() -> None:
    data = {**SEED_NODE, "ssd_offload_limit": "3TB"}
    assert parse_node_config(data).ssd_offload_limit == 3 * 10**12
    env = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "1073741824000"}
    assert parse_node_config(data, env=env).ssd_offload_limit == 1073741824000
    env["KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] = "1TB"
    assert parse_node_config(data, env=env).ssd_offload_limit == 10**12
    with pytest.raises(ConfigError, match="KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"):
        parse_node_config(data, env={"KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "huge"})


def test_timeouts_env_wins_and_kvpool_names_win_over_ascend() -> None:
    assert parse_timeouts({}) == Timeouts(10_000, 10_000)
    env = {"ASCEND_CONNECT_TIMEOUT": "20000", "ASCEND_TRANSFER_TIMEOUT": "15000"}
    assert parse_timeouts(env, connect_ms=5) == Timeouts(20_000, 15_000)
    env["KVPOOL_TRANSFER_TIMEOUT"] = "3000"
    assert parse_timeouts(env).transfer_timeout_ms == 3000
    assert parse_timeouts({}, connect_ms=7, transfer_ms="8") == Timeouts(7, 8)
    with pytest.raises(ConfigError, match="ASCEND_CONNECT_TIMEOUT"):
        parse_timeouts({"ASCEND_CONNECT_TIMEOUT": "soon"})


def test_config_path_kvpool_variable_wins() -> None:
    assert config_path_from_env({}) is None
    env = {"MOONCAKE_CONFIG_PATH": "/a.json"}
    assert config_path_from_env(env) == ("MOONCAKE_CONFIG_PATH", Path("/a.json"))
    env["KVPOOL_CONFIG_PATH"] = "/b.json"
    assert config_path_from_env(env) == ("KVPOOL_CONFIG_PATH", Path("/b.json"))


def test_load_node_config_reads_the_file_named_by_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(SEED_NODE))
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


# ---------------------------------------------------------------- master


def test_master_defaults_are_the_seeds() -> None:
    cfg = MasterConfig()
    assert (cfg.host, cfg.port) == ("127.0.0.1", 50088)
    assert (cfg.eviction_high_watermark_ratio, cfg.eviction_ratio) == (0.9, 0.1)
    assert (cfg.default_kv_lease_ttl, cfg.client_ttl, cfg.enable_offload) == (11000, 120, False)
    assert cfg.client_ttl_ms == 120_000 and cfg.lease_ttl_ms == 11_000


def test_master_parses_the_seeds_command_lines_as_written() -> None:
    line = (
        "mooncake_master --port 50088 --eviction_high_watermark_ratio 0.9 --eviction_ratio 0.1"
        " --default_kv_lease_ttl 11000 --enable_offload=true --client_ttl=120"
    )
    argv = shlex.split(line)
    cfg = MasterConfig.from_argv(argv)
    assert cfg.enable_offload is True and cfg.client_ttl == 120 and cfg.port == 50088
    dashed = MasterConfig.from_argv(
        ["kvpool", "master", "--eviction-ratio=0.2", "--segment-size", "4GiB", "--enable_offload"]
    )
    assert dashed.eviction_ratio == 0.2 and dashed.segment_size == 4 * 2**30
    assert dashed.enable_offload is True


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        ({"eviction_high_watermark_ratio": "1.5"}, "--eviction_high_watermark_ratio"),
        ({"eviction_ratio": "0"}, "--eviction_ratio"),
        ({"default_kv_lease_ttl": "-1"}, "--default_kv_lease_ttl"),
        ({"client_ttl": "0"}, "--client_ttl"),
        ({"port": "70000"}, "--port"),
        ({"enable_offload": "maybe"}, "--enable_offload"),
        ({"segment_size": "big"}, "--segment_size"),
        ({"eviction_policy": "random"}, "--eviction_policy"),
        ({"rpc_thread_num": "4"}, "--rpc_thread_num"),
    ],
)
def test_master_flags_out_of_range_name_the_flag(flags: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        MasterConfig.from_flags(flags)
    assert flag in str(err.value)


def test_master_typed_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="--eviction_ratio"):
        MasterConfig(eviction_ratio=2.0)


def test_parse_host_port_accepts_ipv6_brackets() -> None:
    assert parse_host_port("[::1]:50088", key="m") == ("::1", 50088)
    with pytest.raises(ConfigError, match="m: expected host:port"):
        parse_host_port(":50088", key="m")

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.config import NodeConfig, load_node_config
from kvpool.config.kv_transfer import StoreConfig, check_put_back, parse_store_config
from kvpool.errors import ConfigError


def no_node() -> NodeConfig:
    raise ConfigError("KVPOOL_CONFIG_PATH: not set (nor MOONCAKE_CONFIG_PATH)")


def node() -> NodeConfig:
    return NodeConfig(local_hostname="10.0.0.2", master_host="10.0.0.1", master_port=50088)


def parse(role: str, extra: dict[str, Any], env: dict[str, str] | None = None) -> StoreConfig:
    return parse_store_config(role, extra, env=env or {}, load_node=node)


def test_guide_producer_and_consumer_json() -> None:
    # §5.2 and §5.3: the store child's kv_connector_extra_config, verbatim.
    p = parse("kv_producer", {"lookup_rpc_port": "0", "backend": "mooncake"})
    assert (p.backend, p.master, p.load_async, p.saves) == (
        "mooncake",
        "10.0.0.1:50088",
        False,
        True,
    )
    d = parse("kv_consumer", {"lookup_rpc_port": "0", "load_async": True, "backend": "mooncake"})
    assert d.load_async and not d.saves
    # §6.2 decode write-back and §6.3 kv_both with lookup_rpc_port "1".
    assert parse(
        "kv_consumer", {"lookup_rpc_port": "0", "backend": "mooncake", "consumer_is_to_put": True}
    ).saves
    both = parse("kv_both", {"lookup_rpc_port": "1", "backend": "mooncake"})
    assert both.lookup_rpc_port == 1 and both.saves


def test_master_from_the_config_file_named_by_env(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "127.0.0.1:51234"})
    )
    env = {"MOONCAKE_CONFIG_PATH": str(path)}
    cfg = parse_store_config(
        "kv_both", {"backend": "mooncake"}, env=env, load_node=lambda: load_node_config(env=env)
    )
    assert cfg.master == "127.0.0.1:51234"


def test_missing_master_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH.*embedded"):
        parse_store_config("kv_both", {"backend": "kvpool"}, env={}, load_node=no_node)
    cfg = parse_store_config("kv_both", {"backend": "embedded"}, env={}, load_node=no_node)
    assert cfg.master == "" and not cfg.uses_master
    explicit = parse_store_config(
        "kv_both", {"master": "10.1.1.1:50088"}, env={}, load_node=no_node
    )
    assert explicit.master == "10.1.1.1:50088"


@pytest.mark.parametrize(
    ("role", "extra", "match"),
    [
        ("kv_both", {"backend": "redis"}, "backend: unknown 'redis'"),
        ("kv_both", {"lookup_rpc_port": "70000"}, "lookup_rpc_port: must be in 0..65535"),
        ("kv_both", {"lookup_rpc_port": "abc"}, "lookup_rpc_port: expected an integer"),
        ("kv_both", {"load_async": "yes please"}, "load_async: expected true or false"),
        ("kv_both", {"lokup_rpc_port": 0}, "lokup_rpc_port: unknown key.*known keys"),
        ("kv_both", {"prefill": {"tp": 8}}, r"prefill\.tp: unknown key"),
        ("kv_both", {"embedded_capacity": "4 bananas"}, "embedded_capacity"),
        ("kv_both", {"async_saves": "later"}, "async_saves: expected true or false"),
        ("kv_both", {"save_buffer_size": "lots"}, "save_buffer_size"),
        ("kv_both", {"use_layerwise": "per layer"}, "use_layerwise: expected true or false"),
        ("kv_sender", {}, "kv_role"),
    ],
)
def test_bad_values_name_the_key(role: str, extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse(role, extra)


def test_saves_run_off_the_step_unless_asked_to_stay_in_it() -> None:
    default = parse("kv_both", {"backend": "embedded"})
    assert default.async_saves and default.save_buffer_size == 256 << 20
    sync = parse("kv_both", {"backend": "embedded", "async_saves": "false"})
    assert not sync.async_saves
    sized = parse("kv_both", {"backend": "embedded", "save_buffer_size": "64MiB"})
    assert sized.save_buffer_size == 64 << 20


def test_layer_wise_objects_are_vllm_ascends_use_layerwise_and_off_by_default() -> None:
    assert not parse("kv_both", {"backend": "embedded"}).use_layerwise
    assert parse("kv_both", {"backend": "embedded", "use_layerwise": "true"}).use_layerwise


def test_timeout_from_env_and_extra() -> None:
    assert parse("kv_both", {}, {"ASCEND_TRANSFER_TIMEOUT": "2500"}).pool_timeout_ms == 2500
    assert (
        parse(
            "kv_both", {"pool_timeout_ms": 700}, {"ASCEND_TRANSFER_TIMEOUT": "2500"}
        ).pool_timeout_ms
        == 700
    )


def test_put_back_allowed_only_where_layouts_match() -> None:
    cfg = parse(
        "kv_consumer", {"consumer_is_to_put": True, "prefill": {"tp_size": 8, "dp_size": 4}}
    )
    check_put_back(cfg, is_mla=True, tp_size=4)  # MLA: every rank holds the whole latent KV
    with pytest.raises(ConfigError, match="prefill tp_size 8 != decode tp_size 4"):
        check_put_back(cfg, is_mla=False, tp_size=4)
    check_put_back(cfg, is_mla=False, tp_size=8)
    same = parse("kv_consumer", {"consumer_is_to_put": True})
    check_put_back(same, is_mla=False, tp_size=2)  # no prefill topology given: same layout


def test_replica_num_is_read_and_bounded() -> None:
    assert parse("kv_both", {"backend": "kvpool"}).replica_num == 0  # the pool's default
    assert parse("kv_both", {"backend": "kvpool", "replica_num": "2"}).replica_num == 2
    with pytest.raises(ConfigError, match="replica_num"):
        parse("kv_both", {"backend": "kvpool", "replica_num": 9})

"""The connectors' own settings validation, run by doctor before vLLM starts."""

from __future__ import annotations

from typing import Any

from kvpool.config import NodeConfig
from kvpool.errors import ConfigError
from kvpool.ops.doctor.checks import Status
from kvpool.ops.doctor.checks_connector import Side
from kvpool.ops.doctor.checks_settings import (
    check_kv_host,
    check_settings,
    settings_checks,
    transfer_settings,
)
from kvpool.ops.kvconfig import parse_kv_transfer_config
from tests.ops.helpers import children, guide_d, guide_p, guideify

NODE = NodeConfig(local_hostname="10.0.0.1", master_host="10.0.0.1")
LOCAL = NodeConfig(local_hostname="127.0.0.1", master_host="127.0.0.1")


def side(name: str, config: dict[str, Any]) -> Side:
    return Side(name, parse_kv_transfer_config(config))


def node() -> NodeConfig:
    return NODE


def no_node() -> NodeConfig:
    raise ConfigError("KVPOOL_CONFIG_PATH: not set")


def test_the_seeds_configs_with_kvpool_names_are_accepted_by_the_connectors() -> None:
    for s in (side("prefill", guide_p()), side("decode", guide_d())):
        check = check_settings(s, {}, node)
        assert check is not None and check.status is Status.PASS, check


def test_a_typo_in_the_transfer_extra_config_fails_as_the_connector_would() -> None:
    p = guide_p()
    children(p)[0]["kv_connector_extra_config"]["decodee"] = {"dp_size": 1, "tp_size": 1}
    check = check_settings(side("prefill", p), {}, node)
    assert check is not None and check.status is Status.FAIL
    assert "decodee" in check.message and "refuse to start" in check.message


def test_a_bad_store_backend_or_a_missing_master_fails() -> None:
    p = guide_p()
    children(p)[1]["kv_connector_extra_config"]["backend"] = "redis"
    check = check_settings(side("prefill", p), {}, node)
    assert check is not None and check.status is Status.FAIL and "redis" in check.message
    check = check_settings(side("prefill", guide_p()), {}, no_node)
    assert check is not None and check.status is Status.FAIL
    assert "KVPOOL_CONFIG_PATH" in check.message


def test_the_seeds_own_classes_are_not_validated_here() -> None:
    assert check_settings(side("prefill", guideify(guide_p())), {}, node) is None


# §8.3 row 1: "Decode cannot reach Prefill"
def test_prefill_told_to_listen_on_loopback_on_a_multi_host_node_fails() -> None:
    p = guide_p()
    children(p)[0]["kv_connector_extra_config"]["kv_host"] = "127.0.0.1"
    check = check_kv_host(side("prefill", p), {}, NODE)
    assert check is not None and check.status is Status.FAIL
    assert '"kv_host": "10.0.0.1"' in check.fix
    check = check_kv_host(side("prefill", guide_p()), {"KVPOOL_KV_HOST": "127.0.0.1"}, NODE)
    assert check is not None and check.status is Status.FAIL


def test_prefill_listens_on_local_hostname_or_the_given_kv_host() -> None:
    check = check_kv_host(side("prefill", guide_p()), {}, NODE)  # the connector's default
    assert check is not None and check.status is Status.PASS and "10.0.0.1" in check.message
    p = guide_p()
    children(p)[0]["kv_connector_extra_config"]["kv_host"] = "10.0.0.5"
    check = check_kv_host(side("prefill", p), {}, NODE)
    assert check is not None and check.status is Status.PASS and "10.0.0.5" in check.message


def test_loopback_is_fine_on_one_host_and_a_warning_when_the_node_is_unknown() -> None:
    local = check_kv_host(side("prefill", guide_p()), {}, LOCAL)
    assert local is not None and local.status is Status.PASS
    unknown = check_kv_host(side("prefill", guide_p()), {}, None)
    assert unknown is not None and unknown.status is Status.WARN
    assert check_kv_host(side("decode", guide_d()), {}, NODE) is None


def test_transfer_settings_follow_the_connectors_precedence() -> None:
    p = guide_p()
    children(p)[0]["kv_connector_extra_config"]["connect_timeout_ms"] = 1234
    settings = transfer_settings(side("prefill", p), {"KVPOOL_CONNECT_TIMEOUT_MS": "9999"})
    assert settings is not None and settings.connect_timeout_ms == 1234
    env = {"KVPOOL_TRANSFER_TIMEOUT_MS": "4321"}
    settings = transfer_settings(side("prefill", guide_p()), env)
    assert settings is not None and settings.transfer_timeout_ms == 4321


def test_settings_checks_run_per_side() -> None:
    sides = [side("prefill", guide_p()), side("decode", guide_d())]
    checks = settings_checks(sides, {}, LOCAL, None)
    assert [c.name for c in checks] == [
        "connector.settings[prefill]",
        "connector.kv_host[prefill]",
        "connector.settings[decode]",
    ]

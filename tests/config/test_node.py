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
from kvpool.config.fabrics import HostFabrics, host_fabrics, served_protocols
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


RDMA = {**GUIDE_NODE, "protocol": "rdma"}  # the guide's mooncake.json as it is written
ENGINE_AND_NIC = HostFabrics(engine=True, rdma_devices=("ibp8s0f0", "mlx5_1"))


def test_rdma_without_the_mooncake_extra_names_the_key_the_extra_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config(RDMA, fabrics=HostFabrics(engine=False, rdma_devices=("ibp8s0f0",)))
    message = str(err.value)
    assert message.startswith("protocol: ") and "\n" not in message
    assert "pip install 'kvpool[mooncake]'" in message
    assert '"protocol": "tcp"' in message


@pytest.mark.parametrize(("devices", "state"), [(None, "does not exist"), ((), "is empty")])
def test_rdma_without_an_rdma_device_names_the_directory_and_the_fix(
    devices: tuple[str, ...] | None, state: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config(RDMA, fabrics=HostFabrics(engine=True, rdma_devices=devices))
    message = str(err.value)
    assert message.startswith("protocol: 'rdma' needs an RDMA device")
    assert f"/sys/class/infiniband {state}" in message and '"protocol": "tcp"' in message


def test_rdma_with_a_device_name_the_host_lacks_names_the_device() -> None:
    fabrics = HostFabrics(engine=True, rdma_devices=("mlx5_0",))
    with pytest.raises(ConfigError) as err:
        parse_node_config(RDMA, fabrics=fabrics)
    assert str(err.value).startswith("device_name: no RDMA device ibp8s0f0")
    assert '"device_name": "mlx5_0"' in str(err.value)
    with pytest.raises(ConfigError, match=r'^device_name: not set .*"mlx5_0"'):
        parse_node_config({**RDMA, "device_name": ""}, fabrics=fabrics)


def test_the_guides_rdma_config_is_accepted_with_the_extra_and_its_device() -> None:
    cfg = parse_node_config(RDMA, fabrics=ENGINE_AND_NIC)
    assert (cfg.protocol, cfg.device_name, cfg.transport) == ("rdma", "ibp8s0f0", "transfer_engine")
    two = parse_node_config({**RDMA, "device_name": "ibp8s0f0, mlx5_1"}, fabrics=ENGINE_AND_NIC)
    assert two.transport == "transfer_engine"


def test_tcp_stays_on_kvpools_transport_unless_the_switch_names_the_engine() -> None:
    assert parse_node_config(GUIDE_NODE).transport == "kvpool"  # no probe needed for tcp
    forced = {**GUIDE_NODE, "transport": "transfer_engine"}
    assert parse_node_config(forced, fabrics=HostFabrics(engine=True)).transport == (
        "transfer_engine"
    )
    with pytest.raises(ConfigError, match=r"^protocol: .*kvpool\[mooncake\].*remove \"transport\""):
        parse_node_config(forced, fabrics=HostFabrics(engine=False))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"transport": "carrier"}, r'^transport: .*"kvpool".*"transfer_engine"'),
        ({"protocol": "rdma", "transport": "kvpool"}, r'^transport: .*tcp only.*"transfer_engine"'),
    ],
)
def test_a_bad_transport_names_the_key_and_the_fix(change: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_node_config({**GUIDE_NODE, **change}, fabrics=ENGINE_AND_NIC)


def test_host_fabrics_reads_the_rdma_devices_from_the_given_directory(tmp_path: Path) -> None:
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    found = host_fabrics(str(tmp_path))
    assert found.rdma_devices == ("mlx5_0", "mlx5_1")
    assert found.engine  # the mooncake extra is installed here (a missing wheel fails)
    assert host_fabrics(str(tmp_path / "absent")).rdma_devices is None
    assert not host_fabrics(str(tmp_path), find_spec=lambda name: None).engine  # no extra
    assert served_protocols(found) == ("tcp", "rdma")
    assert served_protocols(HostFabrics(engine=True, rdma_devices=None)) == ("tcp",)


def test_load_node_config_probes_this_machine_for_rdma(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(RDMA))
    nic = tmp_path / "infiniband"
    (nic / "ibp8s0f0").mkdir(parents=True)
    cfg = load_node_config(path, env={}, fabrics=host_fabrics(str(nic)))
    assert cfg.transport == "transfer_engine"
    with pytest.raises(ConfigError, match="does not exist"):
        load_node_config(path, env={}, fabrics=host_fabrics(str(tmp_path / "none")))


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
        ({"segment_warmup": "eager"}, "segment_warmup"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors_naming_the_key(
    change: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config({**GUIDE_NODE, **change})
    assert key in str(err.value)


def test_segment_warmup_defaults_to_background_and_takes_each_mode() -> None:
    assert parse_node_config(GUIDE_NODE).segment_warmup == "background"
    for mode in ("sync", "off"):
        assert parse_node_config({**GUIDE_NODE, "segment_warmup": mode}).segment_warmup == mode


def test_missing_required_keys_are_named() -> None:
    for key in ("local_hostname", "metadata_server"):
        data = {k: v for k, v in GUIDE_NODE.items() if k != key}
        with pytest.raises(ConfigError, match=key):
            parse_node_config(data)


def test_env_offload_limit_kvpool_twin_wins_over_mooncake_and_the_file() -> None:
    data = {**GUIDE_NODE, "ssd_offload_limit": "3TB"}
    assert parse_node_config(data).ssd_offload_limit == 3 * 2**40  # Mooncake's TB
    env = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "1073741824000"}
    assert parse_node_config(data, env=env).ssd_offload_limit == 1073741824000
    env["KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] = "1TB"
    assert parse_node_config(data, env=env).ssd_offload_limit == 2**40
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
    cfg = load_node_config(env={"MOONCAKE_CONFIG_PATH": str(path)}, fabrics=HostFabrics())
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

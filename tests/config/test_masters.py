"""Master addresses: one master, HA masters as a list, or etcd://."""

from __future__ import annotations

import pytest

from kvpool.config.masters import Masters, parse_masters
from kvpool.config.node import parse_node_config
from kvpool.errors import ConfigError


def test_one_master_is_not_ha() -> None:
    masters = parse_masters("10.0.0.1:50088", key="k")
    assert masters == Masters(addresses=("10.0.0.1:50088",)) and not masters.ha


def test_a_list_and_etcd_are_ha_and_print_back_as_written() -> None:
    listed = parse_masters(" 10.0.0.1:50088, 10.0.0.2:50088 ", key="k")
    assert listed.ha and str(listed) == "10.0.0.1:50088,10.0.0.2:50088"
    etcd = parse_masters("etcd://10.0.0.5:2379,10.0.0.6:2379/pool-a", key="k")
    assert etcd == Masters(etcd=("10.0.0.5:2379", "10.0.0.6:2379"), cluster_id="pool-a")
    assert str(parse_masters("etcd://10.0.0.5:2379", key="k")) == "etcd://10.0.0.5:2379/kvpool"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("10.0.0.1:50088,nohost", "'nohost' is not host:port"),
        ("http://10.0.0.1:50088", "the only scheme is etcd://"),
        ("etcd://", "empty"),
        ("etcd://10.0.0.5:2379/a/b", "has no '/'"),
    ],
)
def test_a_malformed_address_names_the_key_and_the_forms(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        parse_masters(text, key="master_server_address")
    assert str(caught.value).startswith("master_server_address: ")


def test_a_node_config_takes_ha_masters_and_dials_them_all() -> None:
    config = parse_node_config(
        {"local_hostname": "10.0.0.9", "metadata_server": "10.0.0.1:50088,10.0.0.2:50088"}
    )
    assert config.master_address == "10.0.0.1:50088,10.0.0.2:50088"
    one = parse_node_config({"local_hostname": "10.0.0.9", "metadata_server": "10.0.0.1:50088"})
    assert one.master_address == "10.0.0.1:50088"

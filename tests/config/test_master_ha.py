"""``kvpool master``'s HA flags: each misuse names its flag and the fix."""

from __future__ import annotations

import pytest

from kvpool.config import MasterConfig
from kvpool.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--enable_ha"], "--enable_ha: needs --etcd_endpoints"),
        (["--etcd_endpoints", "127.0.0.1:2379"], "--etcd_endpoints: set, but --enable_ha"),
        (["--enable_ha", "--etcd_endpoints", "e:2379", "--ha_lease_ttl", "1"], "at least 2"),
        (["--enable_ha", "--etcd_endpoints", "e:2379", "--cluster_id", "a/b"], "--cluster_id"),
        (["--enable_ha", "--etcd_endpoints", "e:2379", "--host", "0.0.0.0"], "--rpc_address"),
        (["--enable_ha", "--etcd_endpoints", "e:2379", "--rpc_address", "nohost"], "host:port"),
    ],
)
def test_a_misused_ha_flag_is_refused_by_name(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        MasterConfig.from_argv(["kvpool-master", *argv])


def test_an_ha_master_with_its_own_segment_is_warned_of_what_a_failover_loses() -> None:
    config = MasterConfig.from_argv(
        ["kvpool-master", "--enable_ha", "--etcd_endpoints", "e:2379", "--segment_size", "1GB"]
    )
    assert any("lost when the leadership moves" in w for w in config.warnings())
    assert config.advertised == "127.0.0.1:50088"
    bare = MasterConfig.from_argv(
        ["m", "--enable_ha", "--etcd_endpoints", "e:2379", "--segment_size", "0",
         "--host", "0.0.0.0", "--rpc_address", "10.0.0.1:50088"]
    )  # fmt: skip
    assert bare.warnings() == [] and bare.advertised == "10.0.0.1:50088"

"""Node-side checks, each fed the broken setup of one §8.3 row / §9 box / §5.1 rule."""

from __future__ import annotations

from kvpool.config import MasterConfig, NodeConfig
from kvpool.ops.doctor.checks import Status
from kvpool.ops.doctor.checks_node import (
    ConfigFileFacts,
    MasterFacts,
    check_config_file,
    check_cross_node,
    check_hashseed,
    check_key_agreement,
    check_local_hostname,
    check_master,
    check_master_address,
    check_master_flags,
    check_registered,
)
from tests.ops.helpers import METRICS

NODE = NodeConfig(local_hostname="10.0.0.2", master_host="10.0.0.1", source="/c/mooncake.json")


# §8.3 "AscendStore cannot reach the master": MOONCAKE_CONFIG_PATH unset or wrong
def test_no_config_variable_fails_with_the_export_fix() -> None:
    [check] = check_config_file(ConfigFileFacts(None, None, None, env_set=False))
    assert check.status is Status.FAIL
    assert "export KVPOOL_CONFIG_PATH=" in check.fix


def test_unreadable_or_invalid_config_fails_with_the_error() -> None:
    facts = ConfigFileFacts(
        "MOONCAKE_CONFIG_PATH=/x.json", None, "cannot read the config file (No such file)", True
    )
    [check] = check_config_file(facts)
    assert check.status is Status.FAIL and "/x.json" in check.message
    assert "create the file" in check.fix
    bad = ConfigFileFacts("KVPOOL_CONFIG_PATH=/y", None, "protocol: 'rdma' cannot be served", True)
    assert check_config_file(bad)[0].status is Status.FAIL


def test_both_variables_set_differently_warns_which_wins() -> None:
    facts = ConfigFileFacts("KVPOOL_CONFIG_PATH=/a", NODE, None, True, "MOONCAKE_CONFIG_PATH=/b")
    checks = check_config_file(facts)
    assert [c.status for c in checks] == [Status.WARN, Status.PASS]
    assert "KVPOOL_CONFIG_PATH wins" in checks[0].message


def test_config_given_by_flag_but_not_exported_warns() -> None:
    checks = check_config_file(ConfigFileFacts("--config /a", NODE, None, env_set=False))
    assert checks[0].status is Status.WARN and "export" in checks[0].fix


# §9 "mooncake.json generated and pointing at the master"
def test_config_pointing_at_another_master_fails() -> None:
    check = check_master_address(NODE, "10.0.0.9:50088")
    assert check.status is Status.FAIL
    assert '"metadata_server": "10.0.0.9:50088"' in check.fix
    assert check_master_address(NODE, "10.0.0.1:50088").status is Status.PASS
    local = NodeConfig(local_hostname="127.0.0.1", master_host="localhost")
    assert check_master_address(local, "127.0.0.1:50088").status is Status.PASS


def test_local_hostname_not_of_this_machine_fails() -> None:
    check = check_local_hostname(NODE, "Cannot assign requested address")
    assert check.status is Status.FAIL and "local_hostname" in check.fix
    assert check_local_hostname(NODE, None).status is Status.PASS


# §9 "Master started on p0 (port 50088)" and §8.1's curl
def test_master_unreachable_fails_with_the_start_command() -> None:
    [check] = check_master(MasterFacts("10.0.0.1:50088", "Connection refused"))
    assert check.status is Status.FAIL
    assert "kvpool master" in check.fix and "50088" in check.fix


def test_port_held_by_something_else_than_a_master_fails_health() -> None:
    checks = check_master(MasterFacts("h:50088", None, 404, "HTTP 404 Not Found"))
    assert [c.status for c in checks] == [Status.PASS, Status.FAIL]


def test_metrics_without_kv_cache_and_connected_fail() -> None:
    checks = check_master(MasterFacts("h:1", None, 200, None, "# nothing\nup 1\n"))
    assert checks[-1].name == "master.metrics" and checks[-1].status is Status.FAIL
    assert 'grep -E "kv_cache|connected"' in checks[-1].fix
    garbage = check_master(MasterFacts("h:1", None, 200, None, "{not prometheus"))
    assert garbage[-1].status is Status.FAIL


def test_healthy_master_passes_and_reports_the_guides_numbers() -> None:
    checks = check_master(MasterFacts("h:1", None, 200, None, METRICS))
    assert all(c.status is Status.PASS for c in checks)
    metrics = next(c for c in checks if c.name == "master.metrics")
    assert "kvpool_kv_cache_blocks_total 12345" in metrics.message
    assert "kvpool_connected_clients 8" in metrics.message
    ratio = next(c for c in checks if c.name == "master.hit_ratio")
    assert "42% (420 of 1000 blocks)" in ratio.message and "50% full" in ratio.message


def test_no_registered_clients_warns() -> None:
    text = "kvpool_kv_cache_blocks_total 0\nkvpool_connected_clients 0\n"
    checks = check_master(MasterFacts("h:1", None, 200, None, text))
    assert checks[-1].status is Status.WARN and checks[-1].name == "master.metrics"


# §8.3 "prefix hit rate stays 0: pool too full"
def test_lookups_without_hits_warn_about_the_watermark() -> None:
    text = METRICS.replace('{result="hit"} 420', '{result="hit"} 0')
    check = check_master(MasterFacts("h:1", None, 200, None, text))[-1]
    assert check.name == "master.hit_ratio" and check.status is Status.WARN
    assert "eviction_high_watermark_ratio" in check.fix and "0 of 1000" in check.message


def test_watermark_and_ratio_out_of_recommended_range_warn_and_bad_flags_fail() -> None:
    checks = check_master_flags(MasterConfig(eviction_high_watermark_ratio=0.99), None)
    assert [c.status for c in checks] == [Status.PASS, Status.WARN]
    checks = check_master_flags(MasterConfig(eviction_ratio=0.8), None)
    assert checks[-1].status is Status.WARN
    [bad] = check_master_flags(None, "--eviction_ratio: must be in (0, 1]")
    assert bad.status is Status.FAIL and "--eviction_ratio" in bad.message
    assert check_master_flags(None, None)[0].status is Status.SKIP


# §8.3 "KV hash mismatch between nodes: PYTHONHASHSEED differs" / §9 "PYTHONHASHSEED=0"
def test_pythonhashseed_is_not_needed_by_kvpool_keys() -> None:
    check = check_hashseed({}, guide_connectors=False)
    assert check.status is Status.PASS and "do not depend" in check.message


def test_pythonhashseed_unset_with_the_guides_connectors_fails() -> None:
    check = check_hashseed({"PYTHONHASHSEED": "42"}, guide_connectors=True)
    assert check.status is Status.FAIL and "PYTHONHASHSEED=0" in check.fix
    assert check_hashseed({"PYTHONHASHSEED": "0"}, guide_connectors=True).status is Status.PASS


def test_processes_disagreeing_on_keys_fail() -> None:
    checks = check_key_agreement({"this process": ["a", "b"], "PYTHONHASHSEED=1": ["a", "c"]})
    assert checks[0].status is Status.FAIL
    broken = check_key_agreement({"this process": ["a"], "PYTHONHASHSEED=1": "ImportError"})
    assert broken[0].status is Status.FAIL and "ImportError" in broken[0].message
    agree = check_key_agreement({"this process": ["a"], "PYTHONHASHSEED=1": ["a"]})
    assert [c.status for c in agree] == [Status.PASS]


def test_the_masters_view_of_registered_clients_includes_this_node() -> None:
    local = NodeConfig(local_hostname="10.0.0.2", master_host="10.0.0.1")
    status = {"clients": [{"address": "10.0.0.2:41000"}, {"address": "10.0.0.3:41000"}]}
    check = check_registered(MasterFacts("m:1", None, 200, None, METRICS, status), local)
    assert check is not None and check.status is Status.PASS
    other = NodeConfig(local_hostname="10.0.0.9", master_host="10.0.0.1")
    check = check_registered(MasterFacts("m:1", None, 200, None, METRICS, status), other)
    assert check is not None and check.status is Status.WARN and "2 clients" in check.message
    assert check_registered(MasterFacts("m:1", None, 200, None, METRICS), local) is None


def test_cross_node_key_comparison_through_the_pool() -> None:
    mine = ["aa", "bb"]
    same = check_cross_node(
        ({"host": "10.0.0.1", "version": "0.1.0", "keys": mine}, False, None), mine
    )
    assert same.status is Status.PASS and "10.0.0.1" in same.message
    other = {"host": "10.0.0.1", "version": "0.0.9", "keys": ["aa", "cc"]}
    differ = check_cross_node((other, False, None), mine)
    assert differ.status is Status.FAIL and "0.0.9" in differ.message
    assert check_cross_node((None, True, None), mine).status is Status.PASS
    assert check_cross_node((None, False, "PeerTimeout: no reply"), mine).status is Status.SKIP
    assert check_cross_node(None, mine).status is Status.SKIP


# ------------------------------------------------------------------------- HA masters
def test_ha_masters_pass_with_the_leader_its_epoch_and_standbys() -> None:
    from kvpool.ops.doctor.checks_node import check_leadership

    view = {"role": "leader", "epoch": 7, "standbys": ["10.0.0.2:50088"], "warming": 0}
    found = check_leadership(("10.0.0.1:50088,10.0.0.2:50088", "10.0.0.1:50088", view))
    assert found is not None and found.status is Status.PASS
    assert found.message == "10.0.0.1:50088 leads epoch 7; standbys: 10.0.0.2:50088"
    alone = check_leadership(("a:1,b:1", "a:1", {**view, "standbys": []}))
    assert alone is not None and "no standby" in alone.message


def test_ha_masters_fail_when_none_leads_or_one_runs_without_an_election() -> None:
    from kvpool.ops.doctor.checks_node import check_leadership

    none = check_leadership(("a:1,b:1", "", "no master of a:1,b:1 leads now"))
    assert none is not None and none.status is Status.FAIL and "--enable_ha" in none.fix
    single = check_leadership(("a:1,b:1", "a:1", {"role": "single", "epoch": 0}))
    assert (
        single is not None
        and single.status is Status.FAIL
        and "without an election" in single.message
    )
    assert check_leadership(None) is None


def test_the_config_and_the_flag_name_the_same_masters_in_any_order() -> None:
    from kvpool.config.node import parse_node_config
    from kvpool.ops.doctor.checks_node import check_master_address

    node = parse_node_config({"local_hostname": "10.0.0.9", "metadata_server": "a:1,b:1"})
    assert check_master_address(node, "b:1,a:1").status is Status.PASS
    assert check_master_address(node, "a:1,c:1").status is Status.FAIL

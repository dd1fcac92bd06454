"""``kvpool config render --engine mooncake``: the cluster's files for real Mooncake (pure).

Mooncake has ``mooncake_master`` and Mooncake Store inside every vLLM process instead of
kvpool's master and storage nodes, so ``master.sh`` runs ``mooncake_master``, each
``mooncake.json`` has Mooncake's keys, and there is no ``node.sh``.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Protocol

from kvpool.config import parse_size
from kvpool.config.master import MasterConfig

__all__ = ["env_sh", "master_argv", "node_json"]


# What is read here of kvpool.ops.render.inventory's Inventory and Host, which render
# passes in: described, not imported, since render imports this package.
class _Host(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def ssd_offload_path(self) -> str: ...
    @property
    def ssd_offload_limit(self) -> str | int | None: ...


class _Inventory(Protocol):
    @property
    def master(self) -> MasterConfig: ...
    @property
    def metrics_port(self) -> int: ...
    @property
    def protocol(self) -> str: ...
    @property
    def device_name(self) -> str: ...
    @property
    def global_segment_size(self) -> str | int: ...
    @property
    def local_buffer_size(self) -> str | int: ...


def master_argv(inv: _Inventory) -> list[str]:
    m = inv.master
    argv = [
        "mooncake_master",
        f"--rpc_address={m.host}",
        f"--rpc_port={m.port}",
        f"--metrics_port={inv.metrics_port}",
        f"--eviction_high_watermark_ratio={m.eviction_high_watermark_ratio}",
        f"--eviction_ratio={m.eviction_ratio}",
        f"--default_kv_lease_ttl={m.default_kv_lease_ttl}",
        f"--client_ttl={m.client_ttl}",
    ]
    if m.enable_offload:
        argv.append("--enable_offload=true")
    return argv


# Mooncake's keys (metadata_server: P2PHANDSHAKE, master_server_address,
# local_buffer_size, ...), as vllm-ascend's Mooncake backend reads them.
def node_json(inv: _Inventory, host: _Host) -> dict[str, Any]:
    node: dict[str, Any] = {
        "local_hostname": host.address,
        "metadata_server": "P2PHANDSHAKE",
        # plain bytes: Mooncake reads no IEC units (GiB), and bytes mean one thing to all
        "global_segment_size": parse_size(inv.global_segment_size, key="global_segment_size"),
        "local_buffer_size": parse_size(inv.local_buffer_size, key="local_buffer_size"),
        "protocol": inv.protocol,
        "master_server_address": inv.master.address,
    }
    if inv.device_name:
        node["device_name"] = inv.device_name
    if host.ssd_offload_path:
        node["enable_ssd_offload"] = True
        node["ssd_offload_path"] = host.ssd_offload_path
    return node


def env_sh(host: _Host, config_path: str, connect_ms: int, transfer_ms: int) -> str:
    lines = [
        f"# kvpool environment for {host.name} ({host.role}, {host.address}), on Mooncake",
        f"# copy {host.name}/mooncake.json to {config_path} on the host.",
        "# Mooncake's Transfer Engine listens on every interface: keep this host on a",
        "# private network.  PYTHONHASHSEED is not needed: kvpool's block keys are content",
        "# hashes.",
        f"export MOONCAKE_CONFIG_PATH={shlex.quote(config_path)}",
        f"export KVPOOL_CONFIG_PATH={shlex.quote(config_path)}",
        f"export KVPOOL_CONNECT_TIMEOUT_MS={connect_ms}",
        f"export KVPOOL_TRANSFER_TIMEOUT_MS={transfer_ms}",
    ]
    if host.ssd_offload_path and host.ssd_offload_limit is not None:
        limit = parse_size(host.ssd_offload_limit, key="ssd_offload_limit")
        lines.append(f"export MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES={limit}")
    return "\n".join(lines) + "\n"


def node_text(inv: _Inventory, host: _Host) -> str:
    return json.dumps(node_json(inv, host), indent=2) + "\n"

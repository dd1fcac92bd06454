"""A node's ``mooncake.json``: the pure parser and the edge that reads file and environment.

Precedence: ``KVPOOL_*`` environment variables win over their ``MOONCAKE_*``/``ASCEND_*``
twins (which exist for drop-in use of Mooncake's and vllm-ascend's deployments), and the
environment wins over the file.  An unknown key is an error, not a warning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config.values import (
    CONFIG_PATH_VARS,
    DEFAULT_MASTER_PORT,
    DEFAULT_OFFLOAD_LIMIT,
    DEFAULT_SEGMENT_SIZE,
    OFFLOAD_LIMIT_VARS,
    Timeouts,
    env_lookup,
    parse_bool_value,
    parse_host_port,
    parse_size,
    parse_timeouts,
)
from kvpool.errors import ConfigError

__all__ = [
    "NODE_KEYS",
    "SERVED_PROTOCOLS",
    "NodeConfig",
    "config_path_from_env",
    "load_node_config",
    "parse_node_config",
    "served_protocols",
]

# Transports this build of kvpool can serve.  RDMA is a planned plug-in: when a module
# ``kvpool.transfer.rdma`` exists, ``served_protocols()`` reports it.
SERVED_PROTOCOLS: tuple[str, ...] = ("tcp",)
_KNOWN_PROTOCOLS = ("tcp", "rdma")


def served_protocols() -> tuple[str, ...]:
    """Protocols this installation can serve (edge: looks for optional transports)."""
    import importlib.util

    extra = ("rdma",) if importlib.util.find_spec("kvpool.transfer.rdma") is not None else ()
    return SERVED_PROTOCOLS + extra


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node's ``mooncake.json``: where the node is, where the master is, its tiers."""

    local_hostname: str
    master_host: str
    master_port: int = DEFAULT_MASTER_PORT
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_SEGMENT_SIZE
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    ssd_offload_limit: int = DEFAULT_OFFLOAD_LIMIT
    timeouts: Timeouts = Timeouts()  # noqa: RUF009 - frozen, so one shared default is safe
    source: str = ""  # where it came from, for messages ("" when built in code)

    @property
    def master_address(self) -> str:
        return f"{self.master_host}:{self.master_port}"


# key -> one-line meaning; the reference in docs/configuration.md follows this table.
NODE_KEYS: dict[str, str] = {
    "local_hostname": "this node's address as peers reach it (required)",
    "metadata_server": "the master as host:port (required unless master_server_address)",
    "master_server_address": "the master as host:port (Mooncake's name; wins if both)",
    "protocol": "transport between nodes: tcp (rdma needs an RDMA transport)",
    "device_name": "RDMA NIC name; unused with tcp",
    "global_segment_size": "memory this node contributes to the pool (size)",
    "enable_ssd_offload": "keep evicted blocks on SSD under ssd_offload_path",
    "ssd_offload_path": "directory of the SSD tier (required with enable_ssd_offload)",
    "ssd_offload_limit": "SSD tier cap (size; env OFFLOAD_TOTAL_SIZE_LIMIT_BYTES wins)",
    "connect_timeout_ms": "connect timeout, ms (env KVPOOL_CONNECT_TIMEOUT_MS wins)",
    "transfer_timeout_ms": "transfer timeout, ms (env KVPOOL_TRANSFER_TIMEOUT_MS wins)",
}

# Mooncake keys kvpool deliberately does not take, with the reason shown to the operator.
_MOONCAKE_ONLY = {
    "local_buffer_size": "kvpool sizes its transfer buffers itself; remove the key",
    "metadata_backend": "kvpool's master is its own metadata service; remove the key",
}


def _str_key(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    if key not in data:
        if default is None:
            raise ConfigError(f'{key}: missing; add "{key}": ... ({NODE_KEYS[key]})')
        return default
    value = data[key]
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value.strip()


def parse_node_config(
    data: object,
    *,
    env: Mapping[str, str] | None = None,
    protocols: Sequence[str] = SERVED_PROTOCOLS,
    source: str = "",
) -> NodeConfig:
    """Validate a parsed ``mooncake.json`` object; ``env`` supplies the variable overrides."""
    env = env or {}
    where = f" in {source}" if source else ""
    if not isinstance(data, Mapping):
        raise ConfigError(f"node config{where}: expected a JSON object {{...}}, got {data!r}")
    for key in data:
        if key in _MOONCAKE_ONLY:
            raise ConfigError(f"{key}{where}: not a kvpool key: {_MOONCAKE_ONLY[key]}")
        if key not in NODE_KEYS:
            raise ConfigError(
                f"{key}{where}: unknown key; remove it or fix its spelling"
                f" (known keys: {', '.join(NODE_KEYS)})"
            )
    local = _str_key(data, "local_hostname")
    if not local:
        raise ConfigError(f"local_hostname{where}: empty; set it to this node's IP address")
    master_key = "master_server_address" if "master_server_address" in data else "metadata_server"
    host, port = parse_host_port(_str_key(data, master_key), key=master_key + where)
    protocol = _str_key(data, "protocol", "tcp").lower()
    if protocol not in _KNOWN_PROTOCOLS:
        raise ConfigError(
            f"protocol{where}: unknown protocol {protocol!r}; use one of {', '.join(protocols)}"
        )
    if protocol not in protocols:
        raise ConfigError(
            f"protocol{where}: {protocol!r} cannot be served here (no {protocol} transport is"
            f' installed; this machine serves: {", ".join(protocols)}); set "protocol": "tcp"'
        )
    enable_ssd = parse_bool_value(data.get("enable_ssd_offload", False), key="enable_ssd_offload")
    ssd_path = _str_key(data, "ssd_offload_path", "")
    if enable_ssd and not ssd_path:
        raise ConfigError(
            f"ssd_offload_path{where}: required when enable_ssd_offload is true;"
            ' add "ssd_offload_path": "/mnt/nvme/kvpool_ssd" or set enable_ssd_offload false'
        )
    limit_found = env_lookup(env, OFFLOAD_LIMIT_VARS)
    if limit_found is not None:
        limit = parse_size(limit_found[1], key=limit_found[0])
    else:
        limit = parse_size(
            data.get("ssd_offload_limit", DEFAULT_OFFLOAD_LIMIT), key="ssd_offload_limit"
        )
    if limit <= 0:
        raise ConfigError("ssd_offload_limit: must be positive (e.g. 1TB)")
    return NodeConfig(
        local_hostname=local,
        master_host=host,
        master_port=port,
        protocol=protocol,
        device_name=_str_key(data, "device_name", ""),
        global_segment_size=parse_size(
            data.get("global_segment_size", DEFAULT_SEGMENT_SIZE), key="global_segment_size"
        ),
        enable_ssd_offload=enable_ssd,
        ssd_offload_path=ssd_path,
        ssd_offload_limit=limit,
        timeouts=parse_timeouts(
            env,
            connect_ms=data.get("connect_timeout_ms"),
            transfer_ms=data.get("transfer_timeout_ms"),
        ),
        source=source,
    )


def config_path_from_env(env: Mapping[str, str]) -> tuple[str, Path] | None:
    """(variable, path) of the node config: KVPOOL_CONFIG_PATH wins over MOONCAKE_CONFIG_PATH."""
    found = env_lookup(env, CONFIG_PATH_VARS)
    return None if found is None else (found[0], Path(found[1]))


def load_node_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    protocols: Sequence[str] | None = None,
) -> NodeConfig:
    """Read and validate the node config (edge).  ``path`` defaults to the env variables."""
    env = dict(os.environ) if env is None else env
    if path is None:
        found = config_path_from_env(env)
        if found is None:
            raise ConfigError(
                "KVPOOL_CONFIG_PATH: not set (nor MOONCAKE_CONFIG_PATH); export"
                " KVPOOL_CONFIG_PATH=/path/to/mooncake.json"
            )
        label, path = f"{found[0]}={found[1]}", found[1]
    else:
        label = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the config file ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{label}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_node_config(
        data,
        env=env,
        protocols=served_protocols() if protocols is None else protocols,
        source=str(path),
    )

"""A ``mooncake.json`` for real Mooncake: its keys, sizes and master, as Mooncake reads them.

:func:`load_any_node_config` reads either engine's, the one ``node_engine`` names (edge).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config.masters import ETCD_SCHEME, parse_address_list
from kvpool.config.node import (
    NodeConfig,
    host_fabrics,
    node_engine,
    parse_node_config,
    read_node_json,
)
from kvpool.config.values import parse_host_port
from kvpool.errors import ConfigError

__all__ = [
    "MOONCAKE_KEYS",
    "MooncakeNodeConfig",
    "load_any_node_config",
    "parse_mooncake_config",
    "parse_mooncake_master",
]


# key -> one-line meaning, as Mooncake's own MooncakeConfig reads them
MOONCAKE_KEYS: dict[str, str] = {
    "local_hostname": "this process's address as peers reach it (required)",
    "metadata_server": "P2PHANDSHAKE, an HTTP metadata URL or etcd (required)",
    "master_server_address": (
        "mooncake_master's RPC address host:port, or etcd://host:port[;host:port] for"
        " masters run with --enable_ha (required)"
    ),
    "global_segment_size": "memory this process contributes to the pool (0: a pure client)",
    "local_buffer_size": "this process's registered transfer buffer",
    "protocol": "the Transfer Engine's protocol: tcp, rdma, ...",
    "device_name": "RDMA device(s), comma-separated; unused with tcp",
    "engine": 'which pool engine the config is for ("mooncake")',
    "metadata_backend": "Mooncake's metadata backend name (passed through)",
    "enable_ssd_offload": "Mooncake's SSD offload (passed through)",
    "ssd_offload_path": "Mooncake's SSD offload directory (passed through)",
}

# Mooncake's own defaults (mooncake_config.py, 0.3.13)
_MOONCAKE_SEGMENT = 3355443200
_MOONCAKE_BUFFER = 1 << 30
_MOONCAKE_UNITS = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


@dataclass(frozen=True, slots=True)
class MooncakeNodeConfig:
    """One process's ``mooncake.json`` for real Mooncake, in Mooncake's own terms."""

    local_hostname: str
    metadata_server: str
    master_server_address: str
    global_segment_size: int = _MOONCAKE_SEGMENT
    local_buffer_size: int = _MOONCAKE_BUFFER
    protocol: str = "tcp"
    device_name: str = ""
    source: str = ""

    engine = "mooncake"

    @property
    def master_address(self) -> str:
        return self.master_server_address


def _mooncake_size(value: object, key: str) -> int:
    """Mooncake's size spelling: an int, or "3.125GB" / "512MB" / "1g" in powers of 1024
    (as Mooncake reads it, so one file means the same bytes to both)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f'{key}: expected a size such as 4294967296 or "4GB", got {value!r}')
    if isinstance(value, int):
        number, unit = float(value), 1
    else:
        text = value.strip().lower()
        unit = 1
        for suffix in ("kb", "mb", "gb", "tb", "k", "m", "g", "t", "b"):
            if text.endswith(suffix):
                unit = _MOONCAKE_UNITS.get(suffix if len(suffix) == 2 else suffix + "b", 1)
                text = text[: -len(suffix)].strip()
                break
        try:
            number = float(text)
        except ValueError:
            raise ConfigError(f'{key}: {value!r} is not a size (e.g. "4GB")') from None
    if number < 0:
        raise ConfigError(f"{key}: must not be negative")
    return int(number * unit)


def parse_mooncake_config(data: Mapping[str, Any], *, source: str = "") -> MooncakeNodeConfig:
    """Validate a Mooncake ``mooncake.json`` (the keys of :data:`MOONCAKE_KEYS`)."""
    where = f" in {source}" if source else ""
    for key in data:
        if key not in MOONCAKE_KEYS:
            raise ConfigError(
                f"{key}{where}: not a key of a Mooncake config (known: {', '.join(MOONCAKE_KEYS)})"
            )
    fields: dict[str, str] = {}
    for key in ("local_hostname", "metadata_server", "master_server_address"):
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(
                f"{key}{where}: missing or empty; Mooncake needs it ({MOONCAKE_KEYS[key]})"
            )
        fields[key] = value.strip()
    parse_mooncake_master(fields["master_server_address"], key="master_server_address" + where)
    protocol = data.get("protocol", "tcp")
    device = data.get("device_name", "")
    if not isinstance(protocol, str) or not isinstance(device, str):
        raise ConfigError(f"protocol/device_name{where}: expected strings")
    return MooncakeNodeConfig(
        **fields,
        global_segment_size=_mooncake_size(
            data.get("global_segment_size", _MOONCAKE_SEGMENT), "global_segment_size"
        ),
        local_buffer_size=_mooncake_size(
            data.get("local_buffer_size", _MOONCAKE_BUFFER), "local_buffer_size"
        ),
        protocol=protocol.strip().lower() or "tcp",
        device_name=device.strip(),
        source=source,
    )


def load_any_node_config(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> NodeConfig | MooncakeNodeConfig:
    """The node config for whichever engine :func:`node_engine` names (edge): a Mooncake
    config as :class:`MooncakeNodeConfig`, any other through :func:`load_node_config`."""
    env = dict(os.environ) if env is None else env
    data, source = read_node_json(path, env=env)
    if isinstance(data, Mapping) and node_engine(data) == "mooncake":
        return parse_mooncake_config(data, source=source)
    return parse_node_config(data, env=env, fabrics=host_fabrics(), source=source)


def parse_mooncake_master(text: str, *, key: str) -> tuple[str, ...]:
    """A Mooncake ``master_server_address``: ``host:port`` → ``()``, or Mooncake's HA form
    ``etcd://host:port[;host:port...]`` (``,`` also separates, as Mooncake's etcd client
    reads it) → its etcd endpoints.  The address goes to Mooncake's client unchanged, so
    anything it would misread is refused here, naming ``key``."""
    text = text.strip()
    if not text.startswith(ETCD_SCHEME):
        if "://" in text:
            raise ConfigError(
                f"{key}: {text!r}: kvpool's Mooncake engine takes mooncake_master's RPC"
                " address host:port, or etcd://host:port[;host:port...] for masters started"
                " with --enable_ha --etcd_endpoints"
            )
        parse_host_port(text, key=key)
        return ()
    rest = text[len(ETCD_SCHEME) :]
    if "/" in rest:
        raise ConfigError(
            f"{key}: {text!r}: Mooncake's client takes no cluster id in the address; set"
            " MC_STORE_CLUSTER_ID to the masters' --cluster_id (default mooncake_cluster)"
        )
    return parse_address_list(rest.replace(";", ","), key, "etcd://10.0.0.5:2379;10.0.0.6:2379")

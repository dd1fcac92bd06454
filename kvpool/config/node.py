"""A node's ``mooncake.json``: the pure parser and the edge that reads file and environment.

One file name, two engines: :func:`node_engine` tells them apart (the rule is written there
and in docs/mooncake.md).  A Mooncake config is refused here, with the reason, and read in
Mooncake's terms by ``kvpool.mooncake.settings``; every other one runs on kvpool's engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpool.config.fabrics import (
    ENGINE_PROTOCOLS,
    INFINIBAND,
    SERVED_PROTOCOLS,
    TRANSPORT_ENGINE,
    TRANSPORT_KVPOOL,
    TRANSPORTS,
    HostFabrics,
    fabric_refusal,
    host_fabrics,
    served_protocols,
)
from kvpool.config.masters import parse_masters
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
    parse_warmup,
)
from kvpool.errors import ConfigError

__all__ = [
    "ENGINE_PROTOCOLS",
    "INFINIBAND",
    "NODE_KEYS",
    "SERVED_PROTOCOLS",
    "TRANSPORT_ENGINE",
    "TRANSPORT_KVPOOL",
    "AnyNodeConfig",
    "HostFabrics",
    "NodeConfig",
    "config_path_from_env",
    "fabric_refusal",
    "host_fabrics",
    "load_node_config",
    "node_engine",
    "parse_node_config",
    "read_node_json",
    "served_protocols",
]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One node's ``mooncake.json``: where the node is, where the master is, its tiers."""

    local_hostname: str
    master_host: str
    master_port: int = DEFAULT_MASTER_PORT
    protocol: str = "tcp"
    device_name: str = ""
    transport: str = TRANSPORT_KVPOOL  # who moves P→D pages: kvpool's TCP or the Transfer Engine
    global_segment_size: int = DEFAULT_SEGMENT_SIZE
    segment_warmup: str = "background"  # when its pages are faulted in (WARMUP_MODES)
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    ssd_offload_limit: int = DEFAULT_OFFLOAD_LIMIT
    timeouts: Timeouts = Timeouts()  # noqa: RUF009 - frozen, so one shared default is safe
    secret_file: str = ""  # the cluster secret or this node's credential ("": environment)
    tls_cert: str = ""  # TLS on the data port and to the master ("": off; docs/security.md)
    tls_key: str = ""
    tls_ca: str = ""
    source: str = ""  # where it came from, for messages ("" when built in code)
    #: HA masters (a list, or etcd://), as kvpool.config.masters reads them; "": one
    masters: str = ""

    @property
    def master_address(self) -> str:
        """What a client dials: the one master, or the HA masters' spec."""
        return self.masters or f"{self.master_host}:{self.master_port}"


class AnyNodeConfig(Protocol):
    """What a node config of either engine says: kvpool's :class:`NodeConfig` or Mooncake's
    (``kvpool.mooncake.settings.MooncakeNodeConfig``), for the settings that take either."""

    @property
    def local_hostname(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def device_name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def master_address(self) -> str: ...


# key -> one-line meaning; the reference in docs/configuration.md follows this table.
NODE_KEYS: dict[str, str] = {
    "local_hostname": "this node's address as peers reach it (required)",
    "metadata_server": (
        "the master as host:port; HA masters as host:port,host:port or etcd://host:port"
        " (required unless master_server_address)"
    ),
    "master_server_address": "the same as metadata_server (Mooncake's name; wins if both)",
    "protocol": "transport between nodes: tcp, or rdma (Mooncake's Transfer Engine)",
    "device_name": "RDMA NIC name(s), comma-separated, as /sys/class/infiniband lists them",
    "transport": "who moves P→D KV: kvpool (tcp only) or transfer_engine (default for rdma)",
    "global_segment_size": "memory this node contributes to the pool (size)",
    "segment_warmup": "fault the segment's pages in at start: background, sync or off",
    "enable_ssd_offload": "keep evicted blocks on SSD under ssd_offload_path",
    "ssd_offload_path": "directory of the SSD tier (required with enable_ssd_offload)",
    "ssd_offload_limit": "SSD tier cap (size; env OFFLOAD_TOTAL_SIZE_LIMIT_BYTES wins)",
    "engine": "which pool engine the config is for: kvpool or mooncake (else the rule)",
    "connect_timeout_ms": "connect timeout, ms (env KVPOOL_CONNECT_TIMEOUT_MS wins)",
    "transfer_timeout_ms": "transfer timeout, ms (env KVPOOL_TRANSFER_TIMEOUT_MS wins)",
    "secret_file": "file with the cluster secret or this node's credential (docs/security.md)",
    "tls_cert": "PEM certificate of this node's data port (TLS; env KVPOOL_TLS_CERT)",
    "tls_key": "PEM private key of tls_cert (env KVPOOL_TLS_KEY)",
    "tls_ca": "PEM CA bundle verifying the master and peers (env KVPOOL_TLS_CA)",
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
    fabrics: HostFabrics = HostFabrics(),  # noqa: B008 - frozen, so one shared default is safe
    source: str = "",
) -> NodeConfig:
    """Validate a parsed ``mooncake.json`` object; ``env`` supplies the variable overrides,
    ``fabrics`` what this machine offers beside kvpool's TCP (:func:`host_fabrics`)."""
    env = env or {}
    where = f" in {source}" if source else ""
    if not isinstance(data, Mapping):
        raise ConfigError(f"node config{where}: expected a JSON object {{...}}, got {data!r}")
    if node_engine(data) == "mooncake":
        raise ConfigError(
            f"node config{where}: this is a Mooncake config ({_mooncake_reason(data)}); it runs"
            " on real Mooncake (engine \"mooncake\"), not on kvpool's master; for kvpool's"
            ' engine write "metadata_server": "<master host>:50088" and drop Mooncake\'s keys'
        )
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
    masters = parse_masters(_str_key(data, master_key), key=master_key + where)
    host, port = parse_host_port(masters.first, key=master_key + where)
    protocol = _str_key(data, "protocol", "tcp").lower()
    known = ("tcp", *ENGINE_PROTOCOLS)
    if protocol not in known:
        raise ConfigError(
            f"protocol{where}: unknown protocol {protocol!r}; use one of {', '.join(known)}"
        )
    default = TRANSPORT_KVPOOL if protocol == "tcp" else TRANSPORT_ENGINE
    transport = _str_key(data, "transport", default).lower()
    if transport not in TRANSPORTS:
        raise ConfigError(
            f"transport{where}: {transport!r} is not a transport; use"
            f' "{TRANSPORT_KVPOOL}" (kvpool\'s TCP) or "{TRANSPORT_ENGINE}" (Mooncake\'s)'
        )
    if transport == TRANSPORT_KVPOOL and protocol != "tcp":
        raise ConfigError(
            f"transport{where}: kvpool's own transport moves KV over tcp only, not"
            f' {protocol!r}; set "transport": "{TRANSPORT_ENGINE}" or "protocol": "tcp"'
        )
    device_name = _str_key(data, "device_name", "")
    refusal = fabric_refusal(protocol, transport, device_name, fabrics)
    if refusal is not None:
        key, _, reason = refusal.partition(": ")
        raise ConfigError(f"{key}{where}: {reason}")
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
        masters=str(masters) if masters.ha else "",
        protocol=protocol,
        device_name=device_name,
        transport=transport,
        global_segment_size=parse_size(
            data.get("global_segment_size", DEFAULT_SEGMENT_SIZE), key="global_segment_size"
        ),
        segment_warmup=parse_warmup(
            data.get("segment_warmup", "background"), key="segment_warmup" + where
        ),
        enable_ssd_offload=enable_ssd,
        ssd_offload_path=ssd_path,
        ssd_offload_limit=limit,
        timeouts=parse_timeouts(
            env,
            connect_ms=data.get("connect_timeout_ms"),
            transfer_ms=data.get("transfer_timeout_ms"),
        ),
        secret_file=_str_key(data, "secret_file", ""),
        tls_cert=_str_key(data, "tls_cert", ""),
        tls_key=_str_key(data, "tls_key", ""),
        tls_ca=_str_key(data, "tls_ca", ""),
        source=source,
    )


# ------------------------------------------------------------------ the engine rule
# metadata_server values that only Mooncake understands: its peer-to-peer handshake and
# its external metadata services (kvpool's master is its own metadata service).
_MOONCAKE_METADATA = ("p2phandshake",)
_MOONCAKE_METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")


def _mooncake_reason(data: Mapping[str, Any]) -> str | None:
    """Why ``data`` is a Mooncake config, or None when it is kvpool's."""
    engine = data.get("engine")
    if engine is not None:
        return 'it says "engine": "mooncake"' if engine == "mooncake" else None
    metadata = data.get("metadata_server")
    if isinstance(metadata, str):
        text = metadata.strip().lower()
        if text in _MOONCAKE_METADATA:
            return f"metadata_server is {metadata.strip()}"
        # etcd:// alone is kvpool's HA masters found on etcd; Mooncake's metadata in etcd
        # comes with its master's own address (Mooncake requires master_server_address)
        kvpool_ha = text.startswith("etcd://") and "master_server_address" not in data
        if text.startswith(_MOONCAKE_METADATA_SCHEMES) and not kvpool_ha:
            return f"metadata_server is a {text.partition(':')[0]} metadata service URL"
    for key in _MOONCAKE_ONLY:
        if key in data:
            return f"it sets Mooncake's {key}"
    master = data.get("master_server_address")
    if isinstance(metadata, str) and isinstance(master, str) and metadata.strip() != master.strip():
        # kvpool's master is its own metadata service; Mooncake's are two services
        return "metadata_server and master_server_address name different services"
    return None


def node_engine(data: Mapping[str, Any]) -> str:
    """``"mooncake"`` or ``"kvpool"``: which engine a parsed ``mooncake.json`` is for.

    The rule, first match wins:
    1. an ``"engine"`` key says it (``"kvpool"`` or ``"mooncake"``);
    2. ``metadata_server`` is ``P2PHANDSHAKE`` or an ``http(s)://`` / ``etcd://`` /
       ``redis://`` URL → Mooncake (kvpool's master is its own metadata service), except
       ``etcd://`` with no ``master_server_address``: kvpool's HA masters, found on etcd;
    3. it sets a key only Mooncake takes (``local_buffer_size``, ``metadata_backend``) →
       Mooncake;
    4. ``metadata_server`` and ``master_server_address`` are both set and differ (Mooncake's
       metadata and master are two services; kvpool's are one) → Mooncake;
    5. anything else → kvpool (the production guide's JSON: ``"<p0_IP>:50088"``).
    """
    engine = data.get("engine")
    if engine is not None and engine not in ("kvpool", "mooncake"):
        raise ConfigError(f'engine: {engine!r} is not a pool engine; use "kvpool" or "mooncake"')
    return "mooncake" if _mooncake_reason(data) is not None else "kvpool"


# ---------------------------------------------------------------------------- the edge
def config_path_from_env(env: Mapping[str, str]) -> tuple[str, Path] | None:
    """(variable, path) of the node config: KVPOOL_CONFIG_PATH wins over MOONCAKE_CONFIG_PATH."""
    found = env_lookup(env, CONFIG_PATH_VARS)
    return None if found is None else (found[0], Path(found[1]))


# Precedence: ``KVPOOL_*`` environment variables win over their ``MOONCAKE_*``/``ASCEND_*``
# twins (which exist for drop-in use of Mooncake's and vllm-ascend's deployments), and the
# environment wins over the file.  An unknown key is an error, not a warning.
def load_node_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    fabrics: HostFabrics | None = None,
) -> NodeConfig:
    """Read and validate the node config (edge).  ``path`` defaults to the env variables;
    ``fabrics`` to what :func:`host_fabrics` finds on this machine."""
    env = dict(os.environ) if env is None else env
    data, source = read_node_json(path, env=env)
    return parse_node_config(
        data,
        env=env,
        fabrics=host_fabrics() if fabrics is None else fabrics,
        source=source,
    )


def read_node_json(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> tuple[object, str]:
    """The parsed JSON of the node config and where it came from (edge); ``path``
    defaults to the env variables.  Hand it to :func:`node_engine` and a parser."""
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
        return json.loads(text), str(path)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{label}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None

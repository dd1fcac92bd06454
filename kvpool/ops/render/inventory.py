"""The inventory of ``kvpool config render``: one TOML or JSON file describing the cluster,
validated purely (every mistake a ConfigError naming the key); see docs/configuration.md.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config import (
    DEFAULT_MASTER_PORT,
    SERVED_PROTOCOLS,
    MasterConfig,
    Topology,
    parse_bool_value,
    parse_size,
)
from kvpool.config.fabrics import ENGINE_PROTOCOLS
from kvpool.errors import ConfigError
from kvpool.mooncake.master_flags import MOONCAKE_MASTER_FIELDS
from kvpool.security.secret import is_loopback

__all__ = ["ENGINES", "Host", "Inventory", "load_inventory", "parse_inventory"]

_TOP_KEYS = {
    "engine": "the pool: kvpool (its master) or mooncake (mooncake_master + Mooncake Store)",
    "model": "model path on every node (required)",
    "config_dir": "where mooncake.json lives on each node (/workspace/config)",
    "protocol": "tcp, or rdma (Mooncake's Transfer Engine; each host's doctor checks its NIC)",
    "device_name": "RDMA NIC name, required with rdma (unused with tcp)",
    "master_port": f"the master's port ({DEFAULT_MASTER_PORT})",
    "global_segment_size": "memory each node contributes (size, e.g. 4GB)",
    "prefill_kv_port": "base kv_port of prefill instances (30000)",
    "decode_kv_port": "base kv_port of decode instances (30100)",
    "consumer_is_to_put": "decode writes its KV back to the pool (MLA models only)",
    "transfer_timeout_ms": "per-transfer timeout (10000)",
    "metrics_port": "mooncake_master's --metrics_port (9003; engine mooncake)",
    "local_buffer_size": "each process's Mooncake transfer buffer (1GB; engine mooncake)",
    "insecure": "true: no cluster secret; the master and nodes run open with --insecure",
    "master": "table of master flags (kvpool master's names; Mooncake's are the same)",
    "hosts": "list of hosts",
}
_HOST_KEYS = {
    "name": "folder name of the host's files (default: its address)",
    "address": "the host's IP as peers reach it (required)",
    "role": "prefill, decode, or storage (a storage node only: no vLLM) (required)",
    "dp_size": "data-parallel size of the instance (1)",
    "tp_size": "tensor-parallel size of the instance (1)",
    "http_port": "vLLM's HTTP port (8100 prefill, 8200 decode)",
    "kv_port": "this host's base kv_port (overrides the role's)",
    "ssd_offload_path": "SSD tier directory; enables SSD offload on this host",
    "ssd_offload_limit": "SSD tier cap (size; default 2 TiB)",
}
#: [master] keys render writes itself: what to write instead
_RENDERED_MASTER_KEYS = {
    "secret_file": "render writes the cluster secret and its path (config_dir/secret)",
    "insecure": "set insecure = true at the top of the inventory",
}
_PROTOCOLS = (*SERVED_PROTOCOLS, *ENGINE_PROTOCOLS)
_ROLES = ("prefill", "decode")  # the P/D roles: each needs at least one host
_HOST_ROLES = (*_ROLES, "storage")
ENGINES = ("kvpool", "mooncake")
_DEFAULT_HTTP = {"prefill": 8100, "decode": 8200}


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    address: str
    role: str
    topology: Topology
    http_port: int
    kv_port: int
    ssd_offload_path: str = ""
    ssd_offload_limit: str | int | None = None

    @property
    def runs_vllm(self) -> bool:
        """A P/D host (its vLLM is a client of the pool); a storage host runs a node only."""
        return self.role != "storage"

    @property
    def node_id(self) -> str:
        """The id of this host's storage node when it runs on its own credential."""
        return f"node-{self.name}"


@dataclass(frozen=True, slots=True)
class Inventory:
    model: str
    config_dir: str
    protocol: str
    device_name: str
    master_port: int
    global_segment_size: str | int
    consumer_is_to_put: bool
    transfer_timeout_ms: int
    master: MasterConfig
    hosts: tuple[Host, ...]
    engine: str = "kvpool"
    metrics_port: int = 9003
    local_buffer_size: str | int = "1GB"
    insecure: bool = False

    @property
    def credentials(self) -> bool:
        """Whether the cluster runs on a secret: on kvpool's engine, when any host is
        reachable from another (kvpool refuses to serve beyond loopback without one),
        unless the inventory says ``insecure``.  Mooncake has no credentials."""
        if self.engine != "kvpool" or self.insecure:
            return False
        return any(not is_loopback(h.address) for h in self.hosts)

    @property
    def open_beyond_loopback(self) -> bool:
        """kvpool's processes must be told --insecure: an open pool other hosts reach."""
        reachable = any(not is_loopback(h.address) for h in self.hosts)
        return self.engine == "kvpool" and self.insecure and reachable

    def role(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.role == role]

    def topology(self, role: str) -> Topology:
        return self.role(role)[0].topology


def _int(value: object, key: str, lo: int = 1, hi: int = 65535) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{key}: expected an integer in {lo}..{hi}, got {value!r}")
    return value


def _str(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value.strip()


def _unknown(data: Mapping[str, Any], known: Mapping[str, str], where: str) -> None:
    for key in data:
        if key not in known:
            raise ConfigError(f"{where}{key}: unknown inventory key; known: {', '.join(known)}")


def _host(i: int, data: object, ports: Mapping[str, int]) -> Host:
    where = f"hosts[{i}]."
    if not isinstance(data, Mapping):
        raise ConfigError(f"hosts[{i}]: expected a table with address and role")
    _unknown(data, _HOST_KEYS, where)
    address = _str(data.get("address"), where + "address")
    role = data.get("role")
    if role not in _HOST_ROLES:
        raise ConfigError(f"{where}role: must be prefill, decode or storage, got {role!r}")
    lo = 0 if role == "storage" else 1  # a storage host has no vLLM ports
    size = data.get("ssd_offload_limit")
    if size is not None:
        parse_size(size, key=where + "ssd_offload_limit")
    return Host(
        name=_str(data.get("name", address), where + "name"),
        address=address,
        role=role,
        topology=Topology(
            _int(data.get("dp_size", 1), where + "dp_size", hi=1024),
            _int(data.get("tp_size", 1), where + "tp_size", hi=1024),
        ),
        http_port=_int(data.get("http_port", _DEFAULT_HTTP.get(role, 0)), where + "http_port", lo),
        kv_port=_int(data.get("kv_port", ports.get(role, 0)), where + "kv_port", lo),
        ssd_offload_path=str(data.get("ssd_offload_path", "")),
        ssd_offload_limit=size,
    )


def parse_inventory(data: Mapping[str, Any], *, engine: str | None = None) -> Inventory:
    """Validate an inventory; every mistake is a ConfigError naming the key.  ``engine``
    (``--engine``) overrides the inventory's own ``engine``."""
    _unknown(data, _TOP_KEYS, "")
    engine = engine or data.get("engine", "kvpool")
    if engine not in ENGINES:
        raise ConfigError(f"engine: {engine!r} is not a pool engine; use kvpool or mooncake")
    local_buffer = data.get("local_buffer_size", "1GB")
    parse_size(local_buffer, key="local_buffer_size")
    ports = {
        "prefill": _int(data.get("prefill_kv_port", 30000), "prefill_kv_port"),
        "decode": _int(data.get("decode_kv_port", 30100), "decode_kv_port"),
    }
    raw_hosts = data.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise ConfigError("hosts: the inventory lists no hosts; add [[hosts]] tables")
    hosts = tuple(_host(i, h, ports) for i, h in enumerate(raw_hosts))
    for role in _ROLES:
        if not any(h.role == role for h in hosts):
            raise ConfigError(f"hosts: no {role} host; P/D needs at least one of each role")
    for role in _ROLES:
        group = [h for h in hosts if h.role == role]
        if len({h.topology for h in group}) > 1:
            raise ConfigError(
                f"hosts: {role} hosts differ in dp_size/tp_size"
                f" ({', '.join(f'{h.name} {h.topology}' for h in group)}); the peer side is told"
                " one layout, so give every host of a role the same one"
            )
    storage = [h.name for h in hosts if not h.runs_vllm]
    if storage and engine == "mooncake":
        raise ConfigError(
            f"hosts: {', '.join(storage)} have role storage, but on Mooncake every vLLM"
            " process contributes its own segment and there is no storage node; remove them"
            ' or use engine = "kvpool"'
        )
    if len({h.name for h in hosts}) != len(hosts):
        raise ConfigError("hosts: two hosts share a name; names are output folder names")
    _check_shared_addresses(hosts)
    segment = data.get("global_segment_size", "4GB")
    parse_size(segment, key="global_segment_size")
    master_flags = _master_table(data.get("master", {}), engine)
    first_prefill = next(h for h in hosts if h.role == "prefill")
    master_port = _int(data.get("master_port", DEFAULT_MASTER_PORT), "master_port")
    master = MasterConfig.from_flags(
        {
            "host": first_prefill.address,
            "port": master_port,
            **({"enable_offload": True} if any(h.ssd_offload_path for h in hosts) else {}),
            **master_flags,
        }
    )
    transfer_ms = _int(data.get("transfer_timeout_ms", 10_000), "transfer_timeout_ms", hi=10**7)
    if master.default_kv_lease_ttl <= transfer_ms:
        raise ConfigError(
            f"master.default_kv_lease_ttl: {master.default_kv_lease_ttl} ms must exceed"
            f" transfer_timeout_ms {transfer_ms} so a block outlives the transfer reading it"
        )
    protocol, device_name = _fabric(data)
    return Inventory(
        model=_str(data.get("model"), "model"),
        config_dir=_str(data.get("config_dir", "/workspace/config"), "config_dir"),
        protocol=protocol,
        device_name=device_name,
        master_port=master_port,
        global_segment_size=segment,
        consumer_is_to_put=parse_bool_value(
            data.get("consumer_is_to_put", False), key="consumer_is_to_put"
        ),
        transfer_timeout_ms=transfer_ms,
        master=master,
        hosts=hosts,
        engine=engine,
        metrics_port=_int(data.get("metrics_port", 9003), "metrics_port"),
        local_buffer_size=local_buffer,
        insecure=parse_bool_value(data.get("insecure", False), key="insecure"),
    )


def _master_table(table: object, engine: str) -> dict[str, Any]:
    """The ``[master]`` table: every key is a master flag that master.sh carries, or an
    error naming it (nothing is dropped without a word)."""
    if not isinstance(table, Mapping):
        raise ConfigError("master: expected a table of kvpool master flags")
    flags = {str(k).lstrip("-").replace("-", "_"): v for k, v in table.items()}
    for key in flags:
        if key in _RENDERED_MASTER_KEYS:
            raise ConfigError(f"master.{key}: remove it; {_RENDERED_MASTER_KEYS[key]}")
        if engine == "mooncake" and key not in MOONCAKE_MASTER_FIELDS:
            raise ConfigError(
                f"master.{key}: mooncake_master has no such flag (it takes"
                f" {', '.join(sorted(MOONCAKE_MASTER_FIELDS))}); remove it or use"
                ' engine = "kvpool"'
            )
    return flags


def _fabric(data: Mapping[str, Any]) -> tuple[str, str]:
    """``protocol`` and ``device_name``.  Whether a host has the NIC is that host's
    question (the node config refuses, ``kvpool doctor`` says why), never the machine's
    that renders: an operator's laptop has no InfiniBand."""
    protocol = _str(data.get("protocol", "tcp"), "protocol").lower()
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"protocol: unknown {protocol!r}; use one of {', '.join(_PROTOCOLS)}")
    device_name = str(data.get("device_name", "")).strip()
    if protocol != "tcp" and not device_name:
        raise ConfigError(
            f'device_name: protocol {protocol} needs the RDMA NIC\'s name, e.g. "ibp8s0f0"'
            " (`ibv_devices` on a host lists them)"
        )
    return protocol, device_name


def _check_shared_addresses(hosts: tuple[Host, ...]) -> None:
    """Instances sharing an address must not share HTTP ports or per-rank kv_ports."""
    for i, a in enumerate(hosts):
        for b in hosts[i + 1 :]:
            if a.address != b.address or not (a.runs_vllm and b.runs_vllm):
                continue
            ra = range(a.kv_port, a.kv_port + a.topology.ranks)
            rb = range(b.kv_port, b.kv_port + b.topology.ranks)
            if ra.start < rb.stop and rb.start < ra.stop:
                raise ConfigError(
                    f"hosts: {a.name} and {b.name} share {a.address} and their kv_port ranges"
                    f" {ra.start}..{ra.stop - 1} and {rb.start}..{rb.stop - 1} overlap; set"
                    " kv_port on one of them"
                )
            if a.http_port == b.http_port:
                raise ConfigError(
                    f"hosts: {a.name} and {b.name} share {a.address} and http_port"
                    f" {a.http_port}; set http_port on one of them"
                )


def load_inventory(path: str | Path) -> dict[str, Any]:
    """Read a .toml or .json inventory (edge)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the inventory ({exc.strerror})") from None
    try:
        data = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid {p.suffix.lstrip('.') or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table/object at the top")
    return data

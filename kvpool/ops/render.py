"""``kvpool config render``: per-node files from one inventory, as the production guide's §4 Ansible
template does — with the peer topologies filled in for you.

Inventory (TOML or JSON, same shape; docs/configuration.md has the reference)::

    model = "/workspace/GLM-5.2-w8a8"
    [[hosts]]
    name = "p0"   address = "10.0.0.1"   role = "prefill"   dp_size = 4   tp_size = 8
    [[hosts]]
    name = "d0"   address = "10.0.0.2"   role = "decode"    dp_size = 8   tp_size = 4

Output: ``master.sh`` (run on the first prefill host) and, per host, ``<name>/mooncake.json``,
``<name>/kv-transfer-config.json``, ``<name>/env.sh``, ``<name>/node.sh`` and
``<name>/serve.sh``.  :func:`render` is pure (inventory in, file texts out);
:func:`run` does the reading and writing.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config import (
    DEFAULT_MASTER_PORT,
    MasterConfig,
    Topology,
    load_node_config,
    parse_bool_value,
    parse_size,
    served_protocols,
)
from kvpool.errors import ConfigError
from kvpool.ops.doctor.checks_connector import model_info
from kvpool.ops.kvconfig import KVPOOL_CONNECTORS

__all__ = [
    "CheckOptions",
    "Host",
    "Inventory",
    "RenderOptions",
    "load_inventory",
    "parse_inventory",
    "render",
    "run",
    "run_check",
    "write_rendered",
]

_TOP_KEYS = {
    "model": "model path on every node (required)",
    "config_dir": "where mooncake.json lives on each node (/workspace/config)",
    "protocol": "tcp (rdma needs an RDMA transport)",
    "device_name": "RDMA NIC name (unused with tcp)",
    "master_port": f"the master's port ({DEFAULT_MASTER_PORT})",
    "global_segment_size": "memory each node contributes (size, e.g. 4GB)",
    "prefill_kv_port": "base kv_port of prefill instances (30000)",
    "decode_kv_port": "base kv_port of decode instances (30100)",
    "consumer_is_to_put": "decode writes its KV back to the pool (MLA models only)",
    "transfer_timeout_ms": "per-transfer timeout (10000)",
    "master": "table of kvpool master flags",
    "hosts": "list of hosts",
}
_HOST_KEYS = {
    "name": "folder name of the host's files (default: its address)",
    "address": "the host's IP as peers reach it (required)",
    "role": "prefill or decode (required)",
    "dp_size": "data-parallel size of the instance (1)",
    "tp_size": "tensor-parallel size of the instance (1)",
    "http_port": "vLLM's HTTP port (8100 prefill, 8200 decode)",
    "kv_port": "this host's base kv_port (overrides the role's)",
    "ssd_offload_path": "SSD tier directory; enables SSD offload on this host",
    "ssd_offload_limit": "SSD tier cap (size; default 2 TiB)",
}
_ROLES = ("prefill", "decode")
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
    if role not in _ROLES:
        raise ConfigError(f"{where}role: must be prefill or decode, got {role!r}")
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
        http_port=_int(data.get("http_port", _DEFAULT_HTTP[role]), where + "http_port"),
        kv_port=_int(data.get("kv_port", ports[role]), where + "kv_port"),
        ssd_offload_path=str(data.get("ssd_offload_path", "")),
        ssd_offload_limit=size,
    )


def parse_inventory(data: Mapping[str, Any]) -> Inventory:
    """Validate an inventory; every mistake is a ConfigError naming the key."""
    _unknown(data, _TOP_KEYS, "")
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
    if len({h.name for h in hosts}) != len(hosts):
        raise ConfigError("hosts: two hosts share a name; names are output folder names")
    _check_shared_addresses(hosts)
    segment = data.get("global_segment_size", "4GB")
    parse_size(segment, key="global_segment_size")
    master_flags = data.get("master", {})
    if not isinstance(master_flags, Mapping):
        raise ConfigError("master: expected a table of kvpool master flags")
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
    return Inventory(
        model=_str(data.get("model"), "model"),
        config_dir=_str(data.get("config_dir", "/workspace/config"), "config_dir"),
        protocol=_str(data.get("protocol", "tcp"), "protocol"),
        device_name=str(data.get("device_name", "")),
        master_port=master_port,
        global_segment_size=segment,
        consumer_is_to_put=parse_bool_value(
            data.get("consumer_is_to_put", False), key="consumer_is_to_put"
        ),
        transfer_timeout_ms=transfer_ms,
        master=master,
        hosts=hosts,
    )


def _check_shared_addresses(hosts: tuple[Host, ...]) -> None:
    """Instances sharing an address must not share HTTP ports or per-rank kv_ports."""
    for i, a in enumerate(hosts):
        for b in hosts[i + 1 :]:
            if a.address != b.address:
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


def _node_json(inv: Inventory, host: Host) -> dict[str, Any]:
    node: dict[str, Any] = {
        "local_hostname": host.address,
        "metadata_server": f"{inv.master.host}:{inv.master.port}",
        "protocol": inv.protocol,
        "global_segment_size": inv.global_segment_size,
    }
    if inv.device_name:
        node["device_name"] = inv.device_name
    if host.ssd_offload_path:
        node["enable_ssd_offload"] = True
        node["ssd_offload_path"] = host.ssd_offload_path
        if host.ssd_offload_limit is not None:
            node["ssd_offload_limit"] = host.ssd_offload_limit
    return node


def _kv_transfer_config(inv: Inventory, host: Host) -> dict[str, Any]:
    """The production guide's §5.2/§5.3 layout under kvpool's class names.  Both topology
    blocks are written, as in the guide; the one named after the peer is what the
    connector routes by."""
    role = "kv_producer" if host.role == "prefill" else "kv_consumer"
    transfer_name, store_name = "KVPoolTransferConnector", "KVPoolStoreConnector"
    store_extra: dict[str, Any] = {"lookup_rpc_port": "0", "backend": "kvpool"}
    if host.role == "decode":
        store_extra["load_async"] = True
        if inv.consumer_is_to_put:
            store_extra["consumer_is_to_put"] = True
            store_extra["prefill"] = _topology_json(inv.topology("prefill"))
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": transfer_name,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[transfer_name][1],
                    "kv_role": role,
                    "kv_port": str(host.kv_port),
                    "kv_connector_extra_config": {
                        "prefill": _topology_json(inv.topology("prefill")),
                        "decode": _topology_json(inv.topology("decode")),
                        "kv_host": host.address,
                    },
                },
                {
                    "kv_connector": store_name,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[store_name][1],
                    "kv_role": role,
                    "kv_connector_extra_config": store_extra,
                },
            ]
        },
    }


def _topology_json(t: Topology) -> dict[str, int]:
    return {"dp_size": t.dp_size, "tp_size": t.tp_size}


def render(inv: Inventory) -> dict[str, str]:
    """Relative path → file text for the whole cluster."""
    files: dict[str, str] = {}
    decode_ranks = inv.topology("decode").ranks
    connect_ms = max(10_000, 500 * decode_ranks)  # the guide's §5.1: ≥ 500 ms × decode ranks
    m = inv.master
    master_argv = [
        "kvpool", "master", "--host", m.host, "--port", str(m.port),
        "--eviction_high_watermark_ratio", str(m.eviction_high_watermark_ratio),
        "--eviction_ratio", str(m.eviction_ratio),
        "--default_kv_lease_ttl", str(m.default_kv_lease_ttl),
        f"--enable_offload={'true' if m.enable_offload else 'false'}",
        f"--client_ttl={m.client_ttl}",
    ]  # fmt: skip
    files["master.sh"] = _script(
        f"kvpool master: run on {inv.role('prefill')[0].name} ({m.host}); every node's"
        " metadata_server points here",
        master_argv,
    )
    config_path = f"{inv.config_dir.rstrip('/')}/mooncake.json"
    for host in inv.hosts:
        kv = _kv_transfer_config(inv, host)
        files[f"{host.name}/mooncake.json"] = json.dumps(_node_json(inv, host), indent=2) + "\n"
        files[f"{host.name}/kv-transfer-config.json"] = json.dumps(kv, indent=2) + "\n"
        files[f"{host.name}/env.sh"] = (
            f"# kvpool environment for {host.name} ({host.role}, {host.address})\n"
            f"# copy {host.name}/mooncake.json to {config_path} on the host.\n"
            "# PYTHONHASHSEED is not needed: kvpool's block keys are content hashes.\n"
            f"export KVPOOL_CONFIG_PATH={shlex.quote(config_path)}\n"
            f"export KVPOOL_CONNECT_TIMEOUT_MS={connect_ms}\n"
            f"export KVPOOL_TRANSFER_TIMEOUT_MS={inv.transfer_timeout_ms}\n"
        )
        files[f"{host.name}/node.sh"] = _script(
            f"storage node on {host.name}: contributes memory (and SSD) to the pool",
            ["kvpool", "node"],
            source_env=True,
        )
        serve = [
            "vllm", "serve", inv.model,
            "--port", str(host.http_port),
            "--tensor-parallel-size", str(host.topology.tp_size),
            "--data-parallel-size", str(host.topology.dp_size),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
        ]  # fmt: skip
        files[f"{host.name}/serve.sh"] = _script(
            f"{host.role} instance on {host.name} ({host.address})", serve, source_env=True
        )
    return files


def _script(comment: str, argv: list[str], *, source_env: bool = False) -> str:
    env = '. "$(dirname "$0")/env.sh"\n' if source_env else ""
    header = f"#!/bin/sh\n# {comment}\n# rendered by kvpool config render\nset -e\n"
    return f"{header}{env}exec {shlex.join(argv)}\n"


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


def write_rendered(files: Mapping[str, str], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    written = []
    for rel, text in sorted(files.items()):
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        if rel.endswith(".sh"):
            target.chmod(0o755)
        written.append(target)
    return written


def _check_model(inv: Inventory) -> None:
    """consumer_is_to_put needs an MLA model; check when the model is readable here."""
    if not inv.consumer_is_to_put:
        return
    config = Path(inv.model) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return  # the model lives on the nodes: doctor --model checks it there
    info = model_info(data)
    if not info.is_mla:
        raise ConfigError(
            f"consumer_is_to_put: {inv.model} is not an MLA model ({info.reason}); remove it"
        )


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """``kvpool config render INVENTORY --out DIR``."""

    inventory: str
    out: str


def run(options: RenderOptions) -> int:
    """``kvpool config render``: write every host's files, print what was written.  A bad
    inventory is a ConfigError naming the key (nothing is written then)."""
    inv = parse_inventory(load_inventory(options.inventory))
    if inv.protocol not in served_protocols():
        raise ConfigError(f'protocol: {inv.protocol!r} cannot be served here; set protocol = "tcp"')
    _check_model(inv)
    written = write_rendered(render(inv), options.out)
    for path in written:
        print(path)
    print(f"master: {inv.master.address} (run master.sh on {inv.role('prefill')[0].name})")
    return 0


@dataclass(frozen=True, slots=True)
class CheckOptions:
    """``kvpool config check [PATH]``: None reads KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH."""

    path: str | None = None


def run_check(options: CheckOptions) -> int:
    """``kvpool config check``: validate a node config and print it resolved (a bad one is
    a ConfigError naming the key)."""
    node = load_node_config(options.path)
    for name in node.__dataclass_fields__:
        print(f"{name} = {getattr(node, name)!r}")
    return 0

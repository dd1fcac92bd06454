"""Typed configuration: the node's ``mooncake.json`` keys, the master's flags, timeouts.

Two layers, as everywhere in kvpool:

- pure parsing — :func:`parse_size`, :func:`parse_host_port`, :func:`parse_node_config`,
  :meth:`MasterConfig.from_flags`, :func:`parse_timeouts` — take plain values and an
  environment *mapping*; they never touch the disk or ``os.environ``;
- the edge — :func:`load_node_config`, :func:`config_path_from_env` — reads the file and
  the real environment and hands both to the pure layer.

Every mistake is a :class:`~kvpool.errors.ConfigError` whose message names the key (or
flag, or environment variable) and says how to fix it.  Nothing is silently ignored: an
unknown key is an error, not a warning.

Precedence: ``KVPOOL_*`` environment variables win over their ``MOONCAKE_*``/``ASCEND_*``
twins (which exist for drop-in use of the seed's deployments), and the environment wins
over the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

__all__ = [
    "CONFIG_PATH_VARS",
    "CONNECT_TIMEOUT_VARS",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_OFFLOAD_LIMIT",
    "DEFAULT_SEGMENT_SIZE",
    "NODE_KEYS",
    "OFFLOAD_LIMIT_VARS",
    "SERVED_PROTOCOLS",
    "TRANSFER_TIMEOUT_VARS",
    "MasterConfig",
    "NodeConfig",
    "Timeouts",
    "config_path_from_env",
    "env_lookup",
    "load_node_config",
    "parse_bool_value",
    "parse_host_port",
    "parse_node_config",
    "parse_size",
    "parse_timeouts",
    "served_protocols",
]

KiB = 1024
GiB = 1024**3
TiB = 1024**4

DEFAULT_MASTER_PORT = 50088
DEFAULT_SEGMENT_SIZE = 1 * GiB
# The seed: "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES 默认 2TB" — Mooncake means 2 TiB.
DEFAULT_OFFLOAD_LIMIT = 2 * TiB

# Environment variables, most authoritative first.
CONFIG_PATH_VARS = ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")
OFFLOAD_LIMIT_VARS = (
    "KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
    "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
)
# Milliseconds.  Both kvpool spellings work; ``_MS`` first, as the connectors write it.
CONNECT_TIMEOUT_VARS = (
    "KVPOOL_CONNECT_TIMEOUT_MS",
    "KVPOOL_CONNECT_TIMEOUT",
    "ASCEND_CONNECT_TIMEOUT",
)
TRANSFER_TIMEOUT_VARS = (
    "KVPOOL_TRANSFER_TIMEOUT_MS",
    "KVPOOL_TRANSFER_TIMEOUT",
    "ASCEND_TRANSFER_TIMEOUT",
)

# Transports this build of kvpool can serve.  RDMA is a planned plug-in: when a module
# ``kvpool.transfer.rdma`` exists, ``served_protocols()`` reports it.
SERVED_PROTOCOLS: tuple[str, ...] = ("tcp",)
_KNOWN_PROTOCOLS = ("tcp", "rdma")

# --------------------------------------------------------------------------- sizes

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, *, key: str) -> int:
    """Bytes from ``4GB`` (10^9 each), ``512MiB`` (2^20 each), ``1.5 GiB`` or plain bytes.

    Decimal units (kB, MB, GB, TB, PB) are powers of 1000 and binary units (KiB, MiB, GiB,
    TiB, PiB) powers of 1024, as in SI/IEC; unit letters are case-insensitive.  A bare
    ``4G`` is refused because it is ambiguous.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{key}: expected a size such as 4GB, 512MiB or a number of bytes, got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: a size cannot be negative (got {value})")
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ConfigError(
            f"{key}: cannot read {value!r} as a size; write e.g. 4GB, 512MiB, 1.5GiB or 1073741824"
        )
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _UNITS:
        hint = f" (write {number}{unit.upper()}B for 10^n or {number}{unit.upper()}iB for 2^n)"
        ambiguous = unit in ("k", "m", "g", "t", "p")
        raise ConfigError(
            f"{key}: unknown size unit {match.group(2)!r} in {value!r}"
            + (hint if ambiguous else "; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB")
        )
    try:
        exact = Decimal(number) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ConfigError(f"{key}: cannot read {value!r} as a size") from None
    if exact != exact.to_integral_value():
        raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
    return int(exact)


def parse_bool_value(value: object, *, key: str) -> bool:
    """A JSON boolean, or the strings true/false (templates often render strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _parse_int(value: object, *, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum}, got {value}")
    return value


def _parse_ratio(value: object, *, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number in (0, 1], got {value!r}")
    try:
        ratio = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number in (0, 1], got {value!r}") from None
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"{key}: must be in (0, 1], got {ratio}")
    return ratio


def parse_host_port(value: object, *, key: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) → (host, port)."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(
            f"{key}: expected host:port such as 10.0.0.1:{DEFAULT_MASTER_PORT}, got {value!r}"
        )
    host, _, port_text = value.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"{key}: expected host:port such as 10.0.0.1:{DEFAULT_MASTER_PORT}, got {value!r}"
        )
    return host, int(port_text)


def env_lookup(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """The first of ``names`` set (non-empty) in ``env``, as (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


# --------------------------------------------------------------------------- timeouts


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Connect and transfer timeouts in milliseconds (the seed's §5.1 variables)."""

    connect_timeout_ms: int = 10_000
    transfer_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        for name in ("connect_timeout_ms", "transfer_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive number of milliseconds")


def parse_timeouts(
    env: Mapping[str, str], *, connect_ms: object = None, transfer_ms: object = None
) -> Timeouts:
    """Timeouts from the file values given, overridden by KVPOOL_/ASCEND_ variables (ms)."""
    values: dict[str, int] = {}
    for name, file_value, variables in (
        ("connect_timeout_ms", connect_ms, CONNECT_TIMEOUT_VARS),
        ("transfer_timeout_ms", transfer_ms, TRANSFER_TIMEOUT_VARS),
    ):
        found = env_lookup(env, variables)
        if found is not None:
            values[name] = _parse_int(found[1], key=found[0], minimum=1)
        elif file_value is not None:
            values[name] = _parse_int(file_value, key=name, minimum=1)
    return Timeouts(**values)


# --------------------------------------------------------------------------- node


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
    timeouts: Timeouts = Timeouts()
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


# --------------------------------------------------------------------------- master


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Everything ``kvpool master`` takes; field names are the seed's flag names.

    Units as in the seed: ``default_kv_lease_ttl`` in milliseconds, ``client_ttl`` in
    seconds.  ``port`` 0 asks the OS for a free port (tests).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_MASTER_PORT
    eviction_high_watermark_ratio: float = 0.9
    eviction_ratio: float = 0.1
    default_kv_lease_ttl: int = 11_000
    enable_offload: bool = False
    client_ttl: int = 120
    segment_size: int = DEFAULT_SEGMENT_SIZE
    ssd_offload_path: str = ""
    ssd_offload_limit: int = DEFAULT_OFFLOAD_LIMIT
    eviction_policy: str = "default"

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("--host: empty; use 127.0.0.1 or this host's address")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port: must be in 0..65535, got {self.port}")
        _parse_ratio(self.eviction_high_watermark_ratio, key="--eviction_high_watermark_ratio")
        _parse_ratio(self.eviction_ratio, key="--eviction_ratio")
        if self.default_kv_lease_ttl <= 0:
            raise ConfigError("--default_kv_lease_ttl: must be positive milliseconds (e.g. 11000)")
        if self.client_ttl <= 0:
            raise ConfigError("--client_ttl: must be positive seconds (e.g. 120)")
        if self.segment_size < 0 or self.ssd_offload_limit <= 0:
            raise ConfigError("--segment_size/--ssd_offload_limit: must be positive sizes")
        if self.eviction_policy not in ("default", "lru"):
            raise ConfigError(
                f"--eviction_policy: unknown {self.eviction_policy!r}; use default or lru"
            )

    @property
    def lease_ttl_ms(self) -> int:
        return self.default_kv_lease_ttl

    @property
    def client_ttl_ms(self) -> int:
        return self.client_ttl * 1000

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_flags(cls, values: Mapping[str, object]) -> MasterConfig:
        """Build from flag values (strings as typed, or already-typed values).

        Keys may use ``_`` or ``-``; an unknown key is a ConfigError naming the flag.
        """
        parsers: dict[str, Callable[[object, str], object]] = {
            "host": lambda v, k: _require_str(v, k),
            "port": lambda v, k: _parse_int(v, key=k),
            "eviction_high_watermark_ratio": lambda v, k: _parse_ratio(v, key=k),
            "eviction_ratio": lambda v, k: _parse_ratio(v, key=k),
            "default_kv_lease_ttl": lambda v, k: _parse_int(v, key=k, minimum=1),
            "enable_offload": lambda v, k: parse_bool_value(v, key=k),
            "client_ttl": lambda v, k: _parse_int(v, key=k, minimum=1),
            "segment_size": lambda v, k: parse_size(v, key=k),
            "ssd_offload_path": lambda v, k: _require_str(v, k),
            "ssd_offload_limit": lambda v, k: parse_size(v, key=k),
            "eviction_policy": lambda v, k: _require_str(v, k),
        }
        typed: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.lstrip("-").replace("-", "_")
            if key not in parsers:
                raise ConfigError(
                    f"--{key}: unknown master flag; known: "
                    + ", ".join(f"--{f.name}" for f in fields(cls))
                )
            typed[key] = parsers[key](value, f"--{key}")
        return cls(**typed)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> MasterConfig:
        """Parse a master command line as the seed writes it (``mooncake_master --port 50088
        --enable_offload=true ...`` or ``kvpool master ...``); the program name is skipped."""
        args = list(argv)
        while args and not args[0].startswith("-"):
            args.pop(0)  # mooncake_master / kvpool master
        values: dict[str, object] = {}
        i = 0
        while i < len(args):
            token = args[i]
            if not token.startswith("--"):
                raise ConfigError(f"master command: unexpected argument {token!r}")
            name, eq, value = token[2:].partition("=")
            if (
                not eq
                and name.replace("-", "_") == "enable_offload"
                and (i + 1 >= len(args) or args[i + 1].startswith("--"))
            ):
                value = "true"  # gflags style: a bare boolean flag means true
            elif not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"--{name}: missing its value (write --{name}=VALUE)")
                value = args[i + 1]
                i += 1
            values[name] = value
            i += 1
        return cls.from_flags(values)


def _require_str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value

"""``kvpool master``'s flags: the seed's names, units and command-line spellings."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvpool.config.values import (
    DEFAULT_MASTER_PORT,
    DEFAULT_OFFLOAD_LIMIT,
    DEFAULT_SEGMENT_SIZE,
    parse_bool_value,
    parse_int,
    parse_ratio,
    parse_size,
    require_str,
)
from kvpool.errors import ConfigError

__all__ = ["MasterConfig"]


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
    eviction_policy: str = "prefix_aware"  # "default" is its alias (kvpool.core.eviction)

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("--host: empty; use 127.0.0.1 or this host's address")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port: must be in 0..65535, got {self.port}")
        parse_ratio(self.eviction_high_watermark_ratio, key="--eviction_high_watermark_ratio")
        parse_ratio(self.eviction_ratio, key="--eviction_ratio")
        if self.default_kv_lease_ttl <= 0:
            raise ConfigError("--default_kv_lease_ttl: must be positive milliseconds (e.g. 11000)")
        if self.client_ttl <= 0:
            raise ConfigError("--client_ttl: must be positive seconds (e.g. 120)")
        if self.segment_size < 0 or self.ssd_offload_limit <= 0:
            raise ConfigError("--segment_size/--ssd_offload_limit: must be positive sizes")
        if self.eviction_policy not in ("prefix_aware", "default", "lru"):
            raise ConfigError(
                f"--eviction_policy: unknown {self.eviction_policy!r}; use prefix_aware "
                "(alias: default) or lru"
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
            "host": lambda v, k: require_str(v, k),
            "port": lambda v, k: parse_int(v, key=k),
            "eviction_high_watermark_ratio": lambda v, k: parse_ratio(v, key=k),
            "eviction_ratio": lambda v, k: parse_ratio(v, key=k),
            "default_kv_lease_ttl": lambda v, k: parse_int(v, key=k, minimum=1),
            "enable_offload": lambda v, k: parse_bool_value(v, key=k),
            "client_ttl": lambda v, k: parse_int(v, key=k, minimum=1),
            "segment_size": lambda v, k: parse_size(v, key=k),
            "ssd_offload_path": lambda v, k: require_str(v, k),
            "ssd_offload_limit": lambda v, k: parse_size(v, key=k),
            "eviction_policy": lambda v, k: require_str(v, k),
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

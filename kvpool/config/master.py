"""``kvpool master``'s flags: Mooncake's names, units and command-line spellings.

Each flag is declared once, as a field of :class:`MasterConfig` whose metadata holds its
parser and help text; :data:`MASTER_FLAGS` lists them.  Everything that reads a master's
flags reads that table: the ``kvpool master`` argparse builder (``kvpool.cli``),
:meth:`MasterConfig.from_flags` (values as typed or as a running master reports them) and
:meth:`MasterConfig.from_argv` (a whole command line as the production guide writes it,
which ``doctor --master-cmd`` and the deploy files use).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
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
from kvpool.core.eviction import EVICTION_POLICIES, EVICTION_POLICY_ALIASES
from kvpool.errors import ConfigError

__all__ = ["MASTER_FLAGS", "Flag", "MasterConfig"]

Parser = Callable[[object, str], object]  # (value as given, "--flag") -> typed value


def _string(value: object, key: str) -> str:
    return require_str(value, key)


def _integer(value: object, key: str) -> int:
    return parse_int(value, key=key)


def _positive(value: object, key: str) -> int:
    return parse_int(value, key=key, minimum=1)


def _ratio(value: object, key: str) -> float:
    return parse_ratio(value, key=key)


def _size(value: object, key: str) -> int:
    return parse_size(value, key=key)


def _bool(value: object, key: str) -> bool:
    return parse_bool_value(value, key=key)


def _flag(default: Any, parse: Parser, help: str) -> Any:
    """A MasterConfig field that is also a command-line flag."""
    return field(default=default, metadata={"parse": parse, "help": help})


@dataclass(frozen=True, slots=True)
class Flag:
    """One master flag: ``--name`` (or ``--kebab-name``), how its text is read, its
    default and its help line."""

    name: str
    parse: Parser
    default: object
    help: str

    @property
    def is_bool(self) -> bool:
        """A bare ``--name`` means true (gflags style, as Mooncake's master takes it)."""
        return self.parse is _bool

    @property
    def shown_default(self) -> str:
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if self.parse is _size and isinstance(self.default, int) and self.default:
            for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
                if self.default % size == 0:
                    return f"{self.default // size}{unit}"
        return str(self.default) if self.default != "" else "none"


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Everything ``kvpool master`` takes; field names are Mooncake's master flag names.

    Units as Mooncake's: ``default_kv_lease_ttl`` in milliseconds, ``client_ttl`` in
    seconds.  ``port`` 0 asks the OS for a free port (tests).
    """

    host: str = _flag("127.0.0.1", _string, "bind address")
    port: int = _flag(DEFAULT_MASTER_PORT, _integer, "RPC and HTTP (/metrics, /health) port")
    eviction_high_watermark_ratio: float = _flag(0.9, _ratio, "start evicting at this use")
    eviction_ratio: float = _flag(0.1, _ratio, "fraction of evictable objects per round")
    default_kv_lease_ttl: int = _flag(11_000, _positive, "read lease, milliseconds")
    enable_offload: bool = _flag(
        False, _bool, "demote evicted objects to the SSD tier (true/false)"
    )
    client_ttl: int = _flag(120, _positive, "seconds without heartbeat before a client is dropped")
    segment_size: int = _flag(
        DEFAULT_SEGMENT_SIZE, _size, "memory the master hosts itself, e.g. 4GB (0: none)"
    )
    ssd_offload_path: str = _flag("", _string, "directory of the master's SSD tier")
    ssd_offload_limit: int = _flag(DEFAULT_OFFLOAD_LIMIT, _size, "SSD tier cap, e.g. 100GB")
    eviction_policy: str = _flag(
        "prefix_aware", _string, "prefix_aware (alias: default) or lru"
    )

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
        if self.eviction_policy not in (*EVICTION_POLICIES, *EVICTION_POLICY_ALIASES):
            raise ConfigError(
                f"--eviction_policy: unknown {self.eviction_policy!r}; use prefix_aware "
                "(alias: default) or lru"
            )

    def warnings(self) -> list[str]:
        """Flags that are valid but do nothing as given: start-up logs each one, so a
        setting is never ignored without a word."""
        out: list[str] = []
        if self.ssd_offload_path and not self.enable_offload:
            out.append(
                "--ssd_offload_path is set but --enable_offload is false, so this master's "
                "SSD tier is not used; add --enable_offload=true"
            )
        if self.enable_offload and not self.ssd_offload_path:
            out.append(
                "--enable_offload=true but this master has no --ssd_offload_path: evicted "
                "objects go to SSD only on nodes whose mooncake.json sets "
                "enable_ssd_offload and ssd_offload_path, and are dropped otherwise; add "
                "--ssd_offload_path=DIR for an SSD tier here"
            )
        return out

    def as_argv(self) -> list[str]:
        """Every flag with its effective value, as ``--name=value`` (what
        :meth:`from_argv` reads back): the start-up log line, as ``mooncake_master``
        lists its flags."""
        return [f"--{flag.name}={_shown(getattr(self, flag.name))}" for flag in MASTER_FLAGS]

    def flags_line(self) -> str:
        """:meth:`as_argv` as one shell-quoted line."""
        return shlex.join(self.as_argv())

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
        typed: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.lstrip("-").replace("-", "_")
            flag = _BY_NAME.get(key)
            if flag is None:
                raise ConfigError(
                    f"--{key}: unknown master flag; known: "
                    + ", ".join(f"--{f.name}" for f in MASTER_FLAGS)
                )
            typed[key] = flag.parse(value, f"--{key}")
        return cls(**typed)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> MasterConfig:
        """Parse a master command line as the production guide writes it
        (``mooncake_master --port 50088 --enable_offload=true ...`` or ``kvpool master
        ...``); the program name is skipped."""
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
            flag = _BY_NAME.get(name.replace("-", "_"))
            bare = i + 1 >= len(args) or args[i + 1].startswith("--")
            if not eq and flag is not None and flag.is_bool and bare:
                value = "true"  # gflags style: a bare boolean flag means true
            elif not eq:
                if bare:
                    raise ConfigError(f"--{name}: missing its value (write --{name}=VALUE)")
                value = args[i + 1]
                i += 1
            values[name] = value
            i += 1
        return cls.from_flags(values)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


MASTER_FLAGS: tuple[Flag, ...] = tuple(
    Flag(f.name, f.metadata["parse"], f.default, f.metadata["help"]) for f in fields(MasterConfig)
)
_BY_NAME = {flag.name: flag for flag in MASTER_FLAGS}

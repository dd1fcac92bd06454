"""``kvpool master``'s flags: Mooncake's names, units and command-line spellings.

Each flag is declared once, as a field of :class:`MasterConfig` whose metadata holds its
parser and help text; :data:`MASTER_FLAGS` lists them, and everything that reads a
master's flags reads that table (the ``kvpool master`` argparse builder,
:meth:`MasterConfig.from_flags`, :meth:`MasterConfig.from_argv`).  A real
``mooncake_master`` line is read in Mooncake's own terms by
:mod:`kvpool.mooncake.master_flags`, over :func:`split_master_argv`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import PurePath
from types import MappingProxyType
from typing import Any

from kvpool.config.values import (
    DEFAULT_MASTER_PORT,
    DEFAULT_OFFLOAD_LIMIT,
    DEFAULT_SEGMENT_SIZE,
    parse_bool_value,
    parse_host_port,
    parse_int,
    parse_ratio,
    parse_size,
    parse_warmup,
    require_str,
)
from kvpool.errors import ConfigError

# What --eviction_policy and --replica_num accept.  Named here, not imported: config sits
# below core (docs/architecture.md), and tests/config/test_master.py holds these equal to
# the policies kvpool.core.eviction builds and kvpool.core.objects.MAX_REPLICAS.
#: the eviction policies, by the names --eviction_policy takes
POLICY_FLAG_VALUES = ("lru", "prefix_aware", "s3fifo", "s3fifo_tree", "arc", "arc_tree")
#: --eviction_policy values that are not a policy's own name, and the policy each means
POLICY_FLAG_ALIASES: Mapping[str, str] = MappingProxyType({"default": "prefix_aware"})
#: the most copies --replica_num may ask for
REPLICA_FLAG_MAX = 8

_ALIAS_OF = {policy: alias for alias, policy in POLICY_FLAG_ALIASES.items()}
# the --eviction_policy values, each alias beside the policy it means
_POLICY_CHOICES = ", ".join(
    f"{n} (alias: {_ALIAS_OF[n]})" if n in _ALIAS_OF else n for n in POLICY_FLAG_VALUES
)

__all__ = [
    "MASTER_BOOL_NAMES",
    "MASTER_FLAGS",
    "POLICY_FLAG_ALIASES",
    "POLICY_FLAG_VALUES",
    "REPLICA_FLAG_MAX",
    "Flag",
    "MasterConfig",
    "parse_duration_ms",
    "split_master_argv",
]

Parser = Callable[[object, str], object]  # (value as given, "--flag") -> typed value


def _string(value: object, key: str) -> str:
    return require_str(value, key)


def _integer(value: object, key: str) -> int:
    return parse_int(value, key=key)


def _positive(value: object, key: str) -> int:
    return parse_int(value, key=key, minimum=1)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_MS_PER = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(value: object, key: str) -> int:
    """Milliseconds, as Mooncake reads ``--default_kv_lease_ttl``: a bare number is
    milliseconds, or a duration with ``ms``, ``s``, ``m`` or ``h`` (``11s`` = 11000)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected milliseconds or a duration such as 11s, got {value!r}")
    if isinstance(value, int):
        ms = value
    else:
        found = _DURATION.match(str(value).lower())
        if found is None:
            raise ConfigError(f"{key}: {value!r} is not a duration (11000, 11s, 500ms, 2m, 1h)")
        ms = int(float(found.group(1)) * _MS_PER[found.group(2) or "ms"])
    if ms <= 0:
        raise ConfigError(f"{key}: must be a positive duration (e.g. 11s)")
    return ms


def _ratio(value: object, key: str) -> float:
    return parse_ratio(value, key=key)


def _size(value: object, key: str) -> int:
    return parse_size(value, key=key)


def _warmup(value: object, key: str) -> str:
    return parse_warmup(value, key=key)


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
    default_kv_lease_ttl: int = _flag(
        11_000, parse_duration_ms, "read lease, milliseconds or a duration (11s)"
    )
    enable_offload: bool = _flag(
        False, _bool, "demote evicted objects to the SSD tier (true/false)"
    )
    client_ttl: int = _flag(120, _positive, "seconds without heartbeat before a client is dropped")
    segment_size: int = _flag(
        DEFAULT_SEGMENT_SIZE, _size, "memory the master hosts itself, e.g. 4GB (0: none)"
    )
    segment_warmup: str = _flag(
        "background",
        _warmup,
        "fault the segment's pages in at start: background (serve at once), sync or off",
    )
    ssd_offload_path: str = _flag("", _string, "directory of the master's SSD tier")
    ssd_offload_limit: int = _flag(DEFAULT_OFFLOAD_LIMIT, _size, "SSD tier cap, e.g. 100GB")
    eviction_policy: str = _flag("prefix_aware", _string, f"one of {_POLICY_CHOICES}")
    replica_num: int = _flag(
        1, _positive, "copies of each object, on different nodes, when a put names none"
    )
    secret_file: str = _flag(
        "", _string, "file with the cluster secret (else KVPOOL_SECRET_FILE, KVPOOL_SECRET)"
    )
    insecure: bool = _flag(
        False, _bool, "serve a non-loopback --host without a credential (true/false)"
    )
    open_metrics: bool = _flag(
        False, _bool, "with a secret, let /metrics be read without the token (true/false)"
    )
    tenant_quota: str = _flag(
        "", _string, "per-tenant byte quotas, NAME=SIZE[,NAME=SIZE...] (e.g. teamA=8GB)"
    )
    kv_events_endpoint: str = _flag(
        "",
        _string,
        "ZMQ PUB endpoint for the pool's KV events (vLLM's format), e.g. tcp://*:5570; none: off",
    )
    kv_events_replay_endpoint: str = _flag(
        "", _string, "ZMQ ROUTER endpoint replaying missed KV event batches"
    )
    tls_cert: str = _flag("", _string, "PEM certificate: TLS on the RPC/HTTP port and segment")
    tls_key: str = _flag("", _string, "PEM private key of --tls_cert")
    tls_ca: str = _flag(
        "", _string, "PEM CA bundle: verifies nodes, and clients must present a cert it signed"
    )

    enable_ha: bool = _flag(
        False, _bool, "elect a leader among masters on etcd (true/false; needs --etcd_endpoints)"
    )
    etcd_endpoints: str = _flag("", _string, "etcd client URLs, host:port[,host:port...]")
    rpc_address: str = _flag(
        "", _string, "with --enable_ha: this master's address as clients reach it (host:port)"
    )
    cluster_id: str = _flag("kvpool", _string, "with --enable_ha: the masters' key space in etcd")
    ha_lease_ttl: int = _flag(
        3, _positive, "with --enable_ha: seconds the leader's etcd lease lasts unrenewed"
    )
    ha_warmup: int = _flag(
        8000, parse_duration_ms, "a new leader waits this long at most for nodes to re-announce"
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
        if not 1 <= self.replica_num <= REPLICA_FLAG_MAX:
            raise ConfigError(
                f"--replica_num: must be 1 to {REPLICA_FLAG_MAX} copies, got {self.replica_num}"
            )
        if self.segment_size < 0 or self.ssd_offload_limit <= 0:
            raise ConfigError("--segment_size/--ssd_offload_limit: must be positive sizes")
        parse_warmup(self.segment_warmup, key="--segment_warmup")
        self._check_ha()
        if self.eviction_policy not in (*POLICY_FLAG_VALUES, *POLICY_FLAG_ALIASES):
            raise ConfigError(
                f"--eviction_policy: unknown {self.eviction_policy!r}; use one of {_POLICY_CHOICES}"
            )

    def _check_ha(self) -> None:
        if not self.enable_ha:
            if self.etcd_endpoints:
                raise ConfigError(
                    "--etcd_endpoints: set, but --enable_ha is false; add --enable_ha=true "
                    "to elect a leader there, or drop --etcd_endpoints"
                )
            return
        if not self.etcd_endpoints.strip():
            raise ConfigError(
                "--enable_ha: needs --etcd_endpoints (etcd's client URLs, e.g. "
                "10.0.0.5:2379,10.0.0.6:2379)"
            )
        if self.ha_lease_ttl < 2:
            raise ConfigError("--ha_lease_ttl: at least 2 seconds (etcd's shortest lease)")
        if not self.cluster_id or "/" in self.cluster_id:
            raise ConfigError(f"--cluster_id: {self.cluster_id!r}: a non-empty name without '/'")
        if self.rpc_address:
            parse_host_port(self.rpc_address, key="--rpc_address")
        elif self.host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"--rpc_address: with --enable_ha and --host {self.host}, say how clients "
                "reach this master (e.g. --rpc_address 10.0.0.1:50051)"
            )

    @property
    def advertised(self) -> str:
        """This master's RPC address as clients reach it."""
        return self.rpc_address or self.address

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
        if self.enable_ha and self.segment_size:
            out.append(
                f"--enable_ha with --segment_size {self.segment_size}: what this master's own "
                "segment holds is lost when the leadership moves; keep the pool on kvpool "
                "node (--segment_size 0 here), whose catalogs the next leader takes over"
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
        _program, values = split_master_argv(argv)
        return cls.from_flags(values)


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not token.lstrip("-").replace(".", "", 1).isdigit()


def split_master_argv(
    argv: Sequence[str], *, bools: frozenset[str] | None = None
) -> tuple[str, dict[str, object]]:
    """The program name and ``{flag: value}`` of a master command line, in gflags'
    spellings: ``--flag=value``, ``--flag value``, one dash or two, a bare boolean (one of
    ``bools``, default :data:`MASTER_BOOL_NAMES`)."""
    bools = MASTER_BOOL_NAMES if bools is None else bools
    args = list(argv)
    program = ""
    while args and not args[0].startswith("-"):
        program = PurePath(args.pop(0)).name  # mooncake_master / kvpool master
    values: dict[str, object] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not _is_flag(token):
            raise ConfigError(f"master command: unexpected argument {token!r}")
        name, eq, value = token.lstrip("-").partition("=")
        key = name.replace("-", "_")
        bare = i + 1 >= len(args) or _is_flag(args[i + 1])
        if not eq and (key in bools) and bare:
            value = "true"  # gflags style: a bare boolean flag means true
        elif not eq:
            if bare:
                raise ConfigError(f"--{name}: missing its value (write --{name}=VALUE)")
            value = args[i + 1]
            i += 1
        values[key] = value
        i += 1
    return program, values


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


MASTER_FLAGS: tuple[Flag, ...] = tuple(
    Flag(f.name, f.metadata["parse"], f.default, f.metadata["help"]) for f in fields(MasterConfig)
)
_BY_NAME = {flag.name: flag for flag in MASTER_FLAGS}
# the flags a bare ``--name`` sets true (gflags style): kvpool master's booleans
MASTER_BOOL_NAMES = frozenset(f.name for f in MASTER_FLAGS if f.is_bool)

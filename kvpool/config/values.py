"""Plain values of kvpool's configuration: sizes, booleans, integers, ratios, host:port,
environment lookups and the connect/transfer timeouts.  Pure: values and an environment
*mapping* in; every mistake is a ConfigError naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from kvpool.errors import ConfigError
from kvpool.net import DEFAULT_MASTER_PORT

__all__ = [
    "CONFIG_PATH_VARS",
    "CONNECT_TIMEOUT_VARS",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_OFFLOAD_LIMIT",
    "DEFAULT_SEGMENT_SIZE",
    "OFFLOAD_LIMIT_VARS",
    "SIZE_CONVENTION",
    "TRANSFER_TIMEOUT_VARS",
    "WARMUP_MODES",
    "Timeouts",
    "env_lookup",
    "format_size",
    "parse_bool_value",
    "parse_host_port",
    "parse_int",
    "parse_ratio",
    "parse_size",
    "parse_timeouts",
    "parse_warmup",
    "require_str",
]

KiB = 1024
GiB = 1024**3
TiB = 1024**4

DEFAULT_SEGMENT_SIZE = 1 * GiB
# The production guide's §3.3: "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES 默认 2TB" — Mooncake
# means 2 TiB.
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
#: a connector's "insecure": true from the environment; kvpool.security.secret names it too
#: (config reads no security; tests/security/test_package.py holds both equal)
ENV_INSECURE = "KVPOOL_INSECURE"


# --------------------------------------------------------------------------- sizes

# Mooncake's convention (mooncake_config.py's _parse_segment_size, and vllm-ascend's
# _parse_global_segment_size): KB, MB, GB, TB and their one-letter forms are powers of
# 1024, so a mooncake.json copied from the production guide or a Mooncake deployment means
# the same bytes here.  The IEC spellings (KiB, ...) mean the same; Mooncake does not read
# them, so what kvpool writes for Mooncake is plain bytes.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{
        letter + suffix: 1024**power
        for power, letter in enumerate("kmgtp", start=1)
        for suffix in ("", "b", "ib")
    },
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
#: what docs, render and doctor say of the units
SIZE_CONVENTION = "sizes as Mooncake reads them: KB, MB, GB, TB = 1024, 1024², 1024³, 1024⁴ bytes"


def format_size(n: float) -> str:
    """Bytes as an operator reads them: ``512 B``, ``1.5 GiB`` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_size(value: object, *, key: str) -> int:
    """Bytes from ``4GB`` (4 × 2^30, as Mooncake reads it), ``512MiB``, ``1.5 GB``, ``4G``
    or plain bytes; unit letters are case-insensitive (:data:`SIZE_CONVENTION`)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{key}: expected a size such as 4GB, 512MB or a number of bytes, got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: a size cannot be negative (got {value})")
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ConfigError(
            f"{key}: cannot read {value!r} as a size; write e.g. 4GB, 512MB, 1.5GB or 1073741824"
        )
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _UNITS:
        raise ConfigError(
            f"{key}: unknown size unit {match.group(2)!r} in {value!r}; use B, KB, MB, GB or TB"
            " (powers of 1024, as Mooncake reads them)"
        )
    try:
        exact = Decimal(number) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ConfigError(f"{key}: cannot read {value!r} as a size") from None
    if exact != exact.to_integral_value():
        raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
    return int(exact)


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_bool_value(value: object, *, key: str) -> bool:
    """kvpool's one boolean parser, for JSON values and command-line flags alike: a JSON
    boolean, or one of true/false, 1/0, yes/no, on/off in any case (Mooncake's flags write
    ``--enable_offload=true``; templates often render booleans as strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


#: when a segment's pages are faulted in: in a background thread while the process
#: already serves (the default), before it serves, or never (each on its first touch)
WARMUP_MODES = ("background", "sync", "off")


def parse_warmup(value: object, *, key: str) -> str:
    """A warm-up mode; a boolean means background (true) or off (false)."""
    word = str(value).strip().lower()
    if word not in WARMUP_MODES and (isinstance(value, bool) or word in (*_TRUE, *_FALSE)):
        word = "background" if parse_bool_value(word, key=key) else "off"
    if word not in WARMUP_MODES:
        raise ConfigError(
            f"{key}: {value!r} is not a warm-up mode; use background (warm soon after "
            "start), sync (warm before serving) or off (each page faults on first touch)"
        )
    return word


def parse_int(value: object, *, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum}, got {value}")
    return value


def parse_ratio(value: object, *, key: str) -> float:
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
    """Connect and transfer timeouts in milliseconds (the production guide's §5.1 variables)."""

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
            values[name] = parse_int(found[1], key=found[0], minimum=1)
        elif file_value is not None:
            values[name] = parse_int(file_value, key=name, minimum=1)
    return Timeouts(**values)


def require_str(value: object, key: str) -> str:
    """``value`` if it is a string; a ConfigError naming ``key`` otherwise."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value

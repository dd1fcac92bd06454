"""A typed view of vLLM's ``--kv-transfer-config`` and of a ``vllm serve`` command line.

Pure: text in, dataclasses out.  It reads the guide's MultiConnector (transfer and store
children) and single store connector shapes, under kvpool's, Mooncake's and vllm-ascend's
class names.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.config import Topology, parse_topology
from kvpool.errors import ConfigError

__all__ = [
    "GUIDE_CONNECTORS",
    "KVPOOL_CONNECTORS",
    "ConnectorSpec",
    "KVTransferConfig",
    "VllmCommand",
    "command_argv",
    "parse_kv_transfer_config",
    "parse_kv_transfer_text",
    "parse_vllm_command",
]

# class name -> (kind, module path)
KVPOOL_CONNECTORS: dict[str, tuple[str, str]] = {
    "KVPoolStoreConnector": ("store", "kvpool.connectors.store"),
    "KVPoolTransferConnector": ("transfer", "kvpool.connectors.transfer"),
}
# Mooncake's and vllm-ascend's class names -> (kind, kvpool replacement)
GUIDE_CONNECTORS: dict[str, tuple[str, str]] = {
    "MooncakeConnectorV1": ("transfer", "KVPoolTransferConnector"),
    "MooncakeConnector": ("transfer", "KVPoolTransferConnector"),
    "AscendStoreConnector": ("store", "KVPoolStoreConnector"),
    "MooncakeStoreConnector": ("store", "KVPoolStoreConnector"),
}


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    """One connector entry (the top level or a MultiConnector child)."""

    name: str
    kind: str  # "multi" | "transfer" | "store" | "unknown"
    role: str | None
    module_path: str | None
    extra: Mapping[str, Any]
    raw: Mapping[str, Any]

    @property
    def is_guide_name(self) -> bool:
        """A Mooncake or vllm-ascend class name (kvpool has a replacement for it)."""
        return self.name in GUIDE_CONNECTORS

    def port(self, key: str) -> int | str | None:
        """An integer port from the entry or its extra config; the raw text when unreadable."""
        value = self.raw.get(key, self.extra.get(key))
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return repr(value)

    def topology(self, side: str) -> Topology | str | None:
        """The ``"prefill"``/``"decode"`` block of the extra config, read as the connectors
        read it; the reason as text when they would refuse it."""
        try:
            return parse_topology(self.extra, side)
        except ConfigError as exc:
            return str(exc)


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """The whole ``--kv-transfer-config``: the top entry and its children (if Multi)."""

    top: ConnectorSpec
    children: tuple[ConnectorSpec, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def entries(self) -> tuple[ConnectorSpec, ...]:
        return (self.top, *self.children) if self.children else (self.top,)

    def first(self, kind: str) -> ConnectorSpec | None:
        return next((e for e in self.entries if e.kind == kind), None)

    @property
    def transfer(self) -> ConnectorSpec | None:
        return self.first("transfer")

    @property
    def store(self) -> ConnectorSpec | None:
        return self.first("store")


def _spec(entry: object, where: str) -> ConnectorSpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {entry!r}")
    name = entry.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ConfigError(f'{where}: missing "kv_connector" (the connector class name)')
    extra = entry.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where}.kv_connector_extra_config: expected a JSON object")
    if name == "MultiConnector":
        kind = "multi"
    elif name in KVPOOL_CONNECTORS:
        kind = KVPOOL_CONNECTORS[name][0]
    elif name in GUIDE_CONNECTORS:
        kind = GUIDE_CONNECTORS[name][0]
    else:
        kind = "unknown"
    role = entry.get("kv_role")
    module = entry.get("kv_connector_module_path")
    return ConnectorSpec(
        name=name,
        kind=kind,
        role=role if isinstance(role, str) else None,
        module_path=module if isinstance(module, str) else None,
        extra=extra,
        raw=entry,
    )


def parse_kv_transfer_config(data: object) -> KVTransferConfig:
    """Validate the structure (not the values: those are doctor's checks)."""
    top = _spec(data, "kv-transfer-config")
    if top.kind != "multi":
        return KVTransferConfig(top, (), top.raw)
    children = top.extra.get("connectors")
    if not isinstance(children, list) or not children:
        raise ConfigError(
            "kv-transfer-config: MultiConnector needs kv_connector_extra_config.connectors,"
            " a list of child connectors"
        )
    specs = tuple(_spec(c, f"connectors[{i}]") for i, c in enumerate(children))
    return KVTransferConfig(top, specs, top.raw)


def parse_kv_transfer_text(text: str, *, where: str = "kv-transfer-config") -> KVTransferConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_kv_transfer_config(data)


@dataclass(frozen=True, slots=True)
class VllmCommand:
    """What doctor needs from ``vllm serve MODEL ...``."""

    model: str | None
    kv_transfer_config: str | None
    topology: Topology | None
    port: int | None
    # the switches among its flags that decide the KV cache's shape (hybrid models)
    switches: frozenset[str] = frozenset()


_OPTION_ALIASES = {
    "--kv-transfer-config": "kv",
    "--kv_transfer_config": "kv",
    "--tensor-parallel-size": "tp",
    "--tensor_parallel_size": "tp",
    "-tp": "tp",
    "--data-parallel-size": "dp",
    "--data_parallel_size": "dp",
    "-dp": "dp",
    "--port": "port",
    "--model": "model",
}


# vLLM's flags that turn its hybrid KV cache manager off, or decide whether a Mamba
# state is kept at block boundaries (what kvpool's store connector saves)
_SWITCHES = frozenset(
    {
        "--disable-hybrid-kv-cache-manager",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    }
)


def command_argv(text: str, programs: Sequence[str]) -> list[str]:
    """The arguments of the command in ``text`` — a pasted line or a whole shell script —
    from the last token naming one of ``programs`` (or a path to one) on (the whole text
    when none does).

    The text is split as a shell would (quotes may span lines; ``#`` starts a comment)."""
    try:
        argv = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ConfigError(f"command: cannot split it like a shell does: {exc}") from None
    # a program may be named by its path (the wheel's site-packages/mooncake/mooncake_master)
    hits = [i for i, token in enumerate(argv) if token.rpartition("/")[2] in programs]
    return argv[hits[-1] :] if hits else argv


def parse_vllm_command(command: str) -> VllmCommand:
    """Read a ``vllm serve`` command line as a shell would split it (``\\``-newlines too)."""
    argv = command_argv(command, ("serve",))
    found: dict[str, str] = {}
    positional: list[str] = []
    switches: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        alias = _OPTION_ALIASES.get(name if token.startswith("-") else "")
        if alias is not None:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"vLLM command: {name} has no value")
                value = argv[i + 1]
                i += 1
            found[alias] = value
        elif not token.startswith("-"):
            positional.append(token)
        elif name.replace("_", "-") in _SWITCHES:
            switches.add(name.replace("_", "-"))
        i += 1
    model = found.get("model")
    if model is None and "serve" in positional:
        after = positional[positional.index("serve") + 1 :]
        model = after[0] if after else None
    try:
        tp = int(found.get("tp", "1"))
        dp = int(found.get("dp", "1"))
        port = int(found["port"]) if "port" in found else None
    except ValueError as exc:
        raise ConfigError(f"vLLM command: a parallel size or port is not a number: {exc}") from None
    # No parallel flag: the layout is set elsewhere (a compose file, a wrapper), so unknown.
    topology = Topology(dp, tp) if ("tp" in found or "dp" in found) else None
    return VllmCommand(model, found.get("kv"), topology, port, frozenset(switches))

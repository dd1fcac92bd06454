"""Doctor checks that run the connectors' own settings validation on the configs given, so
doctor refuses exactly what the connectors would refuse at vLLM start-up, before any vLLM
is started (:mod:`kvpool.config.kv_transfer` imports no vLLM for this).  Also: where P listens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvpool.config import NodeConfig, TransferConfig, parse_store_config
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import MooncakeNodeConfig
from kvpool.ops.doctor.checks import Check, fail, pass_, warn
from kvpool.ops.doctor.checks_connector import Side
from kvpool.ops.kvconfig import KVPOOL_CONNECTORS, ConnectorSpec

__all__ = ["check_kv_host", "check_settings", "settings_checks", "transfer_settings"]

_LOOPBACK = ("127.", "localhost", "::1")


def transfer_settings(
    side: Side, env: Mapping[str, str], node: NodeConfig | None = None
) -> TransferConfig | None:
    """The transfer connector's settings as it would compute them (None if it would refuse)."""
    entry = side.config.transfer
    if entry is None or entry.name not in KVPOOL_CONNECTORS:
        return None
    try:
        return _transfer(side, entry, env, node)
    except ConfigError:
        return None


def _transfer(
    side: Side, entry: ConnectorSpec, env: Mapping[str, str], node: NodeConfig | None
) -> TransferConfig:
    engine_id = side.config.top.raw.get("engine_id") or entry.raw.get("engine_id")
    return TransferConfig.from_values(
        role=entry.role,
        kv_port=entry.raw.get("kv_port"),
        engine_id=engine_id if isinstance(engine_id, str) else None,
        extra=entry.extra,
        env=env,
        node=node,
    )


class NodeElsewhere(Exception):
    """The node config lives on the P and D hosts, not where a pair is checked from."""


def check_settings(
    side: Side,
    env: Mapping[str, str],
    load_node: Callable[[], NodeConfig | MooncakeNodeConfig],
    node: NodeConfig | None = None,
) -> Check | None:
    """Each kvpool child validated by the connector's own parser."""
    name = f"connector.settings[{side.side}]"
    problems: list[str] = []
    checked: list[str] = []
    elsewhere = False
    for entry in side.config.entries:
        if entry.name not in KVPOOL_CONNECTORS:
            continue
        try:
            if entry.kind == "transfer":
                _transfer(side, entry, env, node)
            else:
                parse_store_config(entry.role, entry.extra, env=env, load_node=load_node)
        except ConfigError as exc:
            problems.append(f"{entry.name}: {exc}")
        except NodeElsewhere:
            elsewhere = True
        checked.append(entry.name)
    if not checked:
        return None
    if problems:
        return fail(
            name,
            "the connector would refuse to start: " + "; ".join(problems),
            "fix the key named above in kv_connector_extra_config (docs/configuration.md)",
        )
    where = " (the master's address is read on each host: run doctor there)" if elsewhere else ""
    return pass_(name, f"{' and '.join(checked)} accept their settings{where}")


def check_kv_host(side: Side, env: Mapping[str, str], node: NodeConfig | None) -> Check | None:
    """P tells D where to pull from; a P listening on loopback is unreachable from another
    host (the production guide's §8.3 row 1, "Decode cannot reach Prefill")."""
    if side.side != "prefill":
        return None
    settings = transfer_settings(side, env, node)
    if settings is None:
        return None
    name = "connector.kv_host[prefill]"
    loopback = settings.kv_host.startswith(_LOOPBACK)
    remote = node is not None and not node.local_hostname.startswith(_LOOPBACK)
    if loopback and remote:
        assert node is not None
        return fail(
            name,
            f"P listens for D on {settings.kv_host}, but this node is {node.local_hostname}:"
            " a decode instance on another host cannot connect",
            f'set "kv_host": "{node.local_hostname}" in KVPoolTransferConnector\'s'
            " kv_connector_extra_config (or remove it, and KVPOOL_KV_HOST, so that P uses"
            " local_hostname)",
        )
    if loopback and node is None:
        return warn(
            name,
            f"P listens for D on {settings.kv_host}: only a decode instance on this host can"
            " pull its KV",
            "give the node config (KVPOOL_CONFIG_PATH): P then listens on its local_hostname",
        )
    where = " (P and D on this host)" if loopback else ""
    return pass_(
        name, f"P listens for D on {settings.kv_host}, ports from {settings.kv_port}{where}"
    )


def settings_checks(
    sides: Sequence[Side],
    env: Mapping[str, str],
    node: NodeConfig | None,
    node_error: str | None,
    mooncake: MooncakeNodeConfig | None = None,
    *,
    remote_pair: bool = False,
) -> list[Check]:
    """``mooncake``: the node's Mooncake config, if that is what it has; the store
    connector reads its master from it (``backend: "mooncake"``), the transfer connector
    does not read it at all.  ``remote_pair``: both sides run on other hosts, so a missing
    node config here is not theirs."""

    def load_node() -> NodeConfig | MooncakeNodeConfig:
        if node is None and mooncake is None:
            if remote_pair and node_error is None:
                raise NodeElsewhere
            raise ConfigError(node_error or "no node config (KVPOOL_CONFIG_PATH unset)")
        return node or mooncake  # type: ignore[return-value]

    results: list[Check] = []
    for side in sides:
        for check in (
            check_settings(side, env, load_node, node),
            check_kv_host(side, env, node),
        ):
            if check is not None:
                results.append(check)
    return results

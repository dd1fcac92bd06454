"""Settings of the P→D transfer connector, read once from vLLM's config and the environment.

Pure: the environment is passed in as a mapping, so tests need no monkeypatching.

Where each setting comes from (first match wins):

=====================  ========================================================================
setting                sources
=====================  ========================================================================
role                   ``kv_role``: ``kv_producer`` (P), ``kv_consumer`` (D), ``kv_both``
kv_port                ``kv_port`` (the seed's P 30000 / D 30100); a base, see ``rank_port``
engine_id              ``engine_id``; pairs a P with its D (see :func:`pairing_group`)
peer                   ``kv_connector_extra_config["decode"]`` on P, ``["prefill"]`` on D
kv_host                extra ``kv_host``, env ``KVPOOL_KV_HOST``, ``local_hostname`` of the
                       node config (``KVPOOL_CONFIG_PATH`` / ``MOONCAKE_CONFIG_PATH``), env
                       ``VLLM_HOST_IP``, ``127.0.0.1``: the address P listens on and tells D
                       to pull from
connect_timeout_ms     extra ``connect_timeout_ms``, env ``KVPOOL_CONNECT_TIMEOUT_MS``,
                       ``KVPOOL_CONNECT_TIMEOUT``, ``ASCEND_CONNECT_TIMEOUT`` (the seed's
                       name), the node config's ``connect_timeout_ms``, 10000
transfer_timeout_ms    extra ``transfer_timeout_ms``, env ``KVPOOL_TRANSFER_TIMEOUT_MS``,
                       ``KVPOOL_TRANSFER_TIMEOUT``, ``ASCEND_TRANSFER_TIMEOUT`` (the seed's
                       name), the node config's ``transfer_timeout_ms``, 10000
hold_timeout_ms        extra ``hold_timeout_ms``, env ``KVPOOL_HOLD_TIMEOUT_MS``, 120000:
                       how long P keeps a request's blocks for a D that never comes
=====================  ========================================================================

Unknown keys in the transfer connector's ``kv_connector_extra_config`` are errors that
list the known ones (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.config import CONNECT_TIMEOUT_VARS, TRANSFER_TIMEOUT_VARS, NodeConfig
from kvpool.connectors.topology import MAX_PORT, PeerTopology, parse_peer_topology
from kvpool.errors import ConfigError

__all__ = [
    "CONNECTOR_NAME",
    "EXTRA_KEYS",
    "ROLES",
    "TransferConfig",
    "pairing_group",
]

CONNECTOR_NAME = "KVPoolTransferConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
EXTRA_KEYS = (
    "prefill",
    "decode",
    "kv_host",
    "connect_timeout_ms",
    "transfer_timeout_ms",
    "hold_timeout_ms",
)
_DEFAULT_CONNECT_MS = 10_000
_DEFAULT_TRANSFER_MS = 10_000
_DEFAULT_HOLD_MS = 120_000
# vLLM fills an unset engine_id with uuid4() and appends "_dp<rank>" under data parallelism.
_GENERATED_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
_DP_SUFFIX = re.compile(r"_dp\d+$")


def pairing_group(engine_id: str) -> str | None:
    """The P/D pairing group of an engine id, or ``None`` when vLLM generated the id.

    The seed pairs a P with its D by giving both the same ``engine_id``.  vLLM adds
    ``_dp<rank>`` to it per data-parallel rank, so that suffix is not part of the group.
    An id vLLM made up (a random uuid4) pairs with anything: the seed's own JSON sets
    no engine_id, and it must still work.
    """
    group = _DP_SUFFIX.sub("", engine_id)
    return None if _GENERATED_ID.match(group) else group


def _timeout_ms(
    extra: Mapping[str, Any],
    env: Mapping[str, str],
    key: str,
    env_names: tuple[str, ...],
    default: int,
) -> int:
    sources: list[tuple[str, Any]] = []
    if key in extra:
        sources.append((f'kv_connector_extra_config["{key}"]', extra[key]))
    sources += [(name, env[name]) for name in env_names if env.get(name, "") != ""]
    if not sources:
        return default
    where, raw = sources[0]
    try:
        value = int(raw) if not isinstance(raw, bool) else -1
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a whole number of milliseconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{where} must be > 0 milliseconds, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Everything the transfer connector's two halves need to know, validated."""

    role: str
    kv_port: int
    engine_id: str
    peer: PeerTopology | None
    kv_host: str = "127.0.0.1"
    connect_timeout_ms: int = _DEFAULT_CONNECT_MS
    transfer_timeout_ms: int = _DEFAULT_TRANSFER_MS
    hold_timeout_ms: int = _DEFAULT_HOLD_MS

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def group(self) -> str | None:
        return pairing_group(self.engine_id)

    @classmethod
    def from_values(
        cls,
        *,
        role: str | None,
        kv_port: Any,
        engine_id: str | None,
        extra: Mapping[str, Any],
        env: Mapping[str, str],
        node: NodeConfig | None = None,
    ) -> TransferConfig:
        """Build from vLLM's ``KVTransferConfig`` fields, ``os.environ`` and the node config
        (``mooncake.json``: its ``local_hostname`` and timeouts) when there is one."""
        node_host = node.local_hostname if node is not None else None
        connect_default = node.timeouts.connect_timeout_ms if node else _DEFAULT_CONNECT_MS
        transfer_default = node.timeouts.transfer_timeout_ms if node else _DEFAULT_TRANSFER_MS
        if role not in ROLES:
            raise ConfigError(
                f"kv_role must be one of {list(ROLES)} for {CONNECTOR_NAME}, got {role!r}"
            )
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"{CONNECTOR_NAME}: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {list(EXTRA_KEYS)}"
            )
        try:
            port = int(kv_port)
        except (TypeError, ValueError):
            raise ConfigError(f"kv_port must be a TCP port number, got {kv_port!r}") from None
        if not 0 < port <= MAX_PORT:
            raise ConfigError(f"kv_port must be in 1..{MAX_PORT}, got {kv_port!r}")
        # On P the peer is the decode side, on D the prefill side (the seed's §5.4 trap:
        # these describe the OTHER side, not this one).  kv_both reads whichever is given.
        peer_key = "decode" if role == "kv_producer" else "prefill"
        peer = parse_peer_topology(extra, peer_key)
        if peer is None and role == "kv_both":
            peer = parse_peer_topology(extra, "decode")
        parse_peer_topology(extra, "decode" if peer_key == "prefill" else "prefill")  # validate
        host = (
            extra.get("kv_host")
            or env.get("KVPOOL_KV_HOST")
            or node_host
            or env.get("VLLM_HOST_IP")
        )
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise ConfigError(
                f'kv_connector_extra_config["kv_host"] must be a host name, got {host!r}'
            )
        return cls(
            role=role,
            kv_port=port,
            engine_id=engine_id or "",
            peer=peer,
            kv_host=(host or "127.0.0.1").strip(),
            connect_timeout_ms=_timeout_ms(
                extra,
                env,
                "connect_timeout_ms",
                CONNECT_TIMEOUT_VARS,
                connect_default,
            ),
            transfer_timeout_ms=_timeout_ms(
                extra,
                env,
                "transfer_timeout_ms",
                TRANSFER_TIMEOUT_VARS,
                transfer_default,
            ),
            hold_timeout_ms=_timeout_ms(
                extra, env, "hold_timeout_ms", ("KVPOOL_HOLD_TIMEOUT_MS",), _DEFAULT_HOLD_MS
            ),
        )

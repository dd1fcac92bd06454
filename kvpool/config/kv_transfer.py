"""The two connectors' settings, as vLLM's ``--kv-transfer-config`` gives them (pure, no vLLM).

``kvpool doctor`` runs the same validation, so it refuses exactly what the connectors would
refuse at vLLM start-up; an unknown key is an error listing the known ones.  Every key and
its default: docs/connectors.md, "Settings reference".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.config.node import AnyNodeConfig, NodeConfig
from kvpool.config.topology import MAX_PORT, Topology, parse_topology
from kvpool.config.values import (
    CONNECT_TIMEOUT_VARS,
    ENV_INSECURE,
    TRANSFER_TIMEOUT_VARS,
    env_lookup,
    parse_bool_value,
    parse_host_port,
    parse_size,
)
from kvpool.errors import ConfigError

__all__ = [
    "BACKENDS",
    "ROLES",
    "STORE_CONNECTOR",
    "STORE_EXTRA_KEYS",
    "TRANSFER_CONNECTOR",
    "TRANSFER_EXTRA_KEYS",
    "StoreConfig",
    "TransferConfig",
    "check_put_back",
    "pairing_group",
    "parse_store_config",
]

STORE_CONNECTOR = "KVPoolStoreConnector"
TRANSFER_CONNECTOR = "KVPoolTransferConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")

# -- the store connector ----------------------------------------------------------------

# "mooncake" is the production guide's spelling of "the shared pool behind a master".
BACKENDS = ("mooncake", "kvpool", "embedded")
STORE_EXTRA_KEYS = (
    "backend",
    "master",
    "load_async",
    "consumer_is_to_put",
    "lookup_rpc_port",
    "prefill",
    "model_id",
    "tenant",
    "pool_timeout_ms",
    "lookup_timeout_ms",
    "reconnect_interval_ms",
    "embedded_capacity",
    "head_group_size",
    "async_saves",
    "save_buffer_size",
    "read_your_writes",
    "replica_num",
    "use_layerwise",
)
_DEFAULT_POOL_MS = 10_000
_DEFAULT_LOOKUP_MS = 2_000
_DEFAULT_RECONNECT_MS = 5_000
_DEFAULT_EMBEDDED = 1 << 30
_DEFAULT_SAVE_BUFFER = 256 << 20


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Validated settings; ``master`` is empty for the embedded backend."""

    role: str
    backend: str
    master: str = ""
    load_async: bool = False
    consumer_is_to_put: bool = False
    lookup_rpc_port: int = 0
    prefill_tp_size: int | None = None
    model_id: str = ""
    tenant: str = ""
    pool_timeout_ms: int = _DEFAULT_POOL_MS
    lookup_timeout_ms: int = _DEFAULT_LOOKUP_MS
    reconnect_interval_ms: int = _DEFAULT_RECONNECT_MS
    embedded_capacity: int = _DEFAULT_EMBEDDED
    head_group_size: int = 0  # 0: the backend's default (see the table above)
    async_saves: bool = True  # saves off the engine step (False: in the step)
    save_buffer_size: int = _DEFAULT_SAVE_BUFFER  # staging for saves off the step
    read_your_writes: bool = True  # an answer leaves once its saves are in the pool
    replica_num: int = 0  # copies of each saved block (0: the pool's default)
    use_layerwise: bool = False  # one object per layer; sync loads hand vLLM layer by layer

    @property
    def saves(self) -> bool:
        """Whether this instance writes the KV it computes into the pool."""
        return self.role != "kv_consumer" or self.consumer_is_to_put

    @property
    def uses_master(self) -> bool:
        return self.backend != "embedded"


def _int(value: object, key: str, *, minimum: int, maximum: int | None = None) -> int:
    # The guide writes ports as strings ("lookup_rpc_port": "0"), so digits in a string count.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f"..{maximum}"
        raise ConfigError(f"{key}: must be in {minimum}{upper}, got {value}")
    return value


def _str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value.strip()


def _prefill_tp(value: object) -> int | None:
    key = "kv_connector_extra_config.prefill"
    if not isinstance(value, Mapping):
        raise ConfigError(f'{key}: expected an object like {{"tp_size": 8, "dp_size": 4}}')
    for sub in value:
        if sub not in ("tp_size", "dp_size"):
            raise ConfigError(f"{key}.{sub}: unknown key; use tp_size and dp_size")
    if "dp_size" in value:
        _int(value["dp_size"], f"{key}.dp_size", minimum=1)
    return None if "tp_size" not in value else _int(value["tp_size"], f"{key}.tp_size", minimum=1)


def parse_store_config(
    kv_role: str | None,
    extra: Mapping[str, Any] | None,
    *,
    env: Mapping[str, str],
    load_node: Callable[[], AnyNodeConfig],
) -> StoreConfig:
    """Validate the connector's settings.  ``load_node`` reads the node config (mooncake.json)
    and is called only when the backend needs a master and none is given explicitly."""
    if kv_role not in ROLES:
        raise ConfigError(
            f"kv_role: {STORE_CONNECTOR} needs one of {', '.join(ROLES)}, got {kv_role!r}"
        )
    extra = dict(extra or {})
    for key in extra:
        if key not in STORE_EXTRA_KEYS:
            raise ConfigError(
                f"kv_connector_extra_config.{key}: unknown key for {STORE_CONNECTOR};"
                f" known keys: {', '.join(STORE_EXTRA_KEYS)}"
            )
    backend = _str(extra.get("backend", "mooncake"), "backend").lower()
    if backend not in BACKENDS:
        raise ConfigError(f"backend: unknown {backend!r}; use one of {', '.join(BACKENDS)}")
    found = env_lookup(env, TRANSFER_TIMEOUT_VARS)
    timeout_ms = (
        _int(extra["pool_timeout_ms"], "pool_timeout_ms", minimum=1)
        if "pool_timeout_ms" in extra
        else _int(found[1], found[0], minimum=1)
        if found is not None
        else _DEFAULT_POOL_MS
    )
    master = ""
    if backend != "embedded":
        if "master" in extra:
            host, port = parse_host_port(_str(extra["master"], "master"), key="master")
            master = f"{host}:{port}"
        else:
            try:
                master = load_node().master_address
            except ConfigError as exc:
                raise ConfigError(
                    f"backend {backend!r} needs the master's address: {exc}; or give"
                    ' kv_connector_extra_config "master": "host:50088", or use'
                    ' "backend": "embedded" for a single node without a master'
                ) from None
    consumer_is_to_put = parse_bool_value(
        extra.get("consumer_is_to_put", False), key="consumer_is_to_put"
    )
    return StoreConfig(
        role=kv_role,
        backend=backend,
        master=master,
        load_async=parse_bool_value(extra.get("load_async", False), key="load_async"),
        consumer_is_to_put=consumer_is_to_put,
        lookup_rpc_port=_int(
            extra.get("lookup_rpc_port", 0), "lookup_rpc_port", minimum=0, maximum=65535
        ),
        prefill_tp_size=_prefill_tp(extra["prefill"]) if "prefill" in extra else None,
        model_id=_str(extra.get("model_id", ""), "model_id"),
        tenant=_str(extra.get("tenant", ""), "tenant"),
        pool_timeout_ms=timeout_ms,
        lookup_timeout_ms=_int(
            extra.get("lookup_timeout_ms", _DEFAULT_LOOKUP_MS), "lookup_timeout_ms", minimum=1
        ),
        reconnect_interval_ms=_int(
            extra.get("reconnect_interval_ms", _DEFAULT_RECONNECT_MS),
            "reconnect_interval_ms",
            minimum=0,
        ),
        embedded_capacity=parse_size(
            extra.get("embedded_capacity", _DEFAULT_EMBEDDED), key="embedded_capacity"
        ),
        head_group_size=_int(extra.get("head_group_size", 0), "head_group_size", minimum=0),
        async_saves=parse_bool_value(extra.get("async_saves", True), key="async_saves"),
        replica_num=_int(extra.get("replica_num", 0), "replica_num", minimum=0, maximum=8),
        use_layerwise=parse_bool_value(extra.get("use_layerwise", False), key="use_layerwise"),
        save_buffer_size=parse_size(
            extra.get("save_buffer_size", _DEFAULT_SAVE_BUFFER), key="save_buffer_size"
        ),
        read_your_writes=parse_bool_value(
            extra.get("read_your_writes", True), key="read_your_writes"
        ),
    )


def check_put_back(config: StoreConfig, *, is_mla: bool, tp_size: int) -> None:
    """Refuse ``consumer_is_to_put`` where decode-side KV would not fit prefill-side readers.

    A block written by the decode side is read back by prefill instances under the same key,
    so its bytes must be laid out as the prefill side lays them out.  Model, dtype, block
    size and device are in the key's namespace anyway; what can still differ is how KV heads
    are split across tensor-parallel ranks.  MLA models keep one latent KV per token that
    every rank holds whole (so vllm-ascend allows write-back only for MLA); other models match
    only when both sides use the same tp_size.
    """
    if not config.consumer_is_to_put or config.role != "kv_consumer" or is_mla:
        return
    if config.prefill_tp_size is not None and config.prefill_tp_size != tp_size:
        raise ConfigError(
            "consumer_is_to_put: the decode side's KV layout differs from the prefill side's"
            f" (the model is not MLA and prefill tp_size {config.prefill_tp_size} !="
            f" decode tp_size {tp_size}), so prefill could never read what decode writes;"
            " set consumer_is_to_put false or run both sides with the same tp_size"
        )


# -- the transfer connector -------------------------------------------------------------

TRANSFER_EXTRA_KEYS = (
    "prefill",
    "decode",
    "kv_host",
    "connect_timeout_ms",
    "transfer_timeout_ms",
    "hold_timeout_ms",
    "idle_wait_ms",
    "insecure",
)
_DEFAULT_CONNECT_MS = 10_000
_DEFAULT_TRANSFER_MS = 10_000
_DEFAULT_HOLD_MS = 120_000
_DEFAULT_IDLE_WAIT_MS = 10
_DEFAULT_PROTOCOL = "tcp"
# vLLM fills an unset engine_id with uuid4() and appends "_dp<rank>" under data parallelism.
_GENERATED_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
_DP_SUFFIX = re.compile(r"_dp\d+$")


def pairing_group(engine_id: str) -> str | None:
    """The P/D pairing group of an engine id, or ``None`` when vLLM generated the id.

    MooncakeConnectorV1 pairs a P with its D by giving both the same ``engine_id``.  vLLM adds
    ``_dp<rank>`` to it per data-parallel rank, so that suffix is not part of the group.
    An id vLLM made up (a random uuid4) pairs with anything: the production guide's JSON
    sets no engine_id, and it must still work.
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
    peer: Topology | None
    kv_host: str = "127.0.0.1"
    protocol: str = _DEFAULT_PROTOCOL  # the fabric that moves the pages
    # who drives it: "kvpool" (TCP) or "transfer_engine"; None: by protocol, as the node
    # config decides (kvpool's for tcp, the Transfer Engine for the others)
    transport: str | None = None
    device_name: str = ""  # the Transfer Engine's RDMA device(s), from the node config
    connect_timeout_ms: int = _DEFAULT_CONNECT_MS
    transfer_timeout_ms: int = _DEFAULT_TRANSFER_MS
    hold_timeout_ms: int = _DEFAULT_HOLD_MS
    idle_wait_ms: int = _DEFAULT_IDLE_WAIT_MS  # 0: an idle step never waits
    secret_file: str = ""  # the node config's; "": the environment's (connector_credential)
    insecure: bool = False  # a non-loopback P may serve without a credential

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
        node: AnyNodeConfig | None = None,
    ) -> TransferConfig:
        """Build from vLLM's ``KVTransferConfig`` fields, ``os.environ`` and the node config
        (``mooncake.json``: its ``local_hostname``, ``protocol`` and timeouts) if given.
        A Mooncake config (the guide's P and D on real Mooncake) has no timeouts of
        kvpool's: the defaults and the environment apply."""
        node_host = node.local_hostname if node is not None else None
        timeouts = node.timeouts if isinstance(node, NodeConfig) else None
        connect_default = timeouts.connect_timeout_ms if timeouts else _DEFAULT_CONNECT_MS
        transfer_default = timeouts.transfer_timeout_ms if timeouts else _DEFAULT_TRANSFER_MS
        if role not in ROLES:
            raise ConfigError(
                f"kv_role must be one of {list(ROLES)} for {TRANSFER_CONNECTOR}, got {role!r}"
            )
        unknown = sorted(set(extra) - set(TRANSFER_EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"{TRANSFER_CONNECTOR}: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {list(TRANSFER_EXTRA_KEYS)}"
            )
        try:
            port = int(kv_port)
        except (TypeError, ValueError):
            raise ConfigError(f"kv_port must be a TCP port number, got {kv_port!r}") from None
        if not 0 < port <= MAX_PORT:
            raise ConfigError(f"kv_port must be in 1..{MAX_PORT}, got {kv_port!r}")
        # On P the peer is the decode side, on D the prefill side (the guide's §5.4 trap:
        # these describe the OTHER side, not this one).  kv_both reads whichever is given.
        peer_key = "decode" if role == "kv_producer" else "prefill"
        peer = parse_topology(extra, peer_key)
        if peer is None and role == "kv_both":
            peer = parse_topology(extra, "decode")
        parse_topology(extra, "decode" if peer_key == "prefill" else "prefill")  # validate
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
            protocol=node.protocol if node is not None else _DEFAULT_PROTOCOL,
            # a Mooncake config has no ``transport``: its protocol decides (rdma: the engine)
            transport=node.transport if isinstance(node, NodeConfig) else None,
            device_name=node.device_name if node is not None else "",
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
            idle_wait_ms=_idle_wait_ms(extra, env),
            secret_file=node.secret_file if isinstance(node, NodeConfig) else "",
            insecure=_insecure(extra, env),
        )


def _idle_wait_ms(extra: Mapping[str, Any], env: Mapping[str, str]) -> int:
    """Like the timeouts, but 0 is allowed (no wait) and the value is capped: an idle step
    that waits delays a request that arrives meanwhile by as much."""
    key, var = "idle_wait_ms", "KVPOOL_IDLE_WAIT_MS"
    if key in extra:
        where, raw = f'kv_connector_extra_config["{key}"]', extra[key]
    elif env.get(var, "") != "":
        where, raw = var, env[var]
    else:
        return _DEFAULT_IDLE_WAIT_MS
    try:
        value = int(raw) if not isinstance(raw, bool) else -1
    except (TypeError, ValueError):
        value = -1
    if not 0 <= value <= 1000:
        raise ConfigError(f"{where} must be 0..1000 milliseconds (0: off), got {raw!r}")
    return value


def _insecure(extra: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    if "insecure" in extra:
        return parse_bool_value(extra["insecure"], key='kv_connector_extra_config["insecure"]')
    if env.get(ENV_INSECURE, "") != "":
        return parse_bool_value(env[ENV_INSECURE], key=ENV_INSECURE)
    return False

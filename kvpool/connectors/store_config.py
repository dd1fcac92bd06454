"""Settings of the store connector (the seed's AscendStoreConnector, §6), read once.

Pure: the environment and the node config loader are passed in, so tests need no
monkeypatching.  Keys of ``kv_connector_extra_config``:

=====================  =======================================================================
key                    meaning (default)
=====================  =======================================================================
backend                ``mooncake`` or ``kvpool``: the shared pool through its master
                       (the seed's default, ``mooncake``); ``embedded``: an in-process pool
                       with no master, for one node with tensor_parallel_size 1
master                 the master as host:port; default: ``metadata_server`` of the node
                       config named by ``KVPOOL_CONFIG_PATH`` / ``MOONCAKE_CONFIG_PATH``
load_async             load hits in the background without stalling the engine (false)
consumer_is_to_put     a ``kv_consumer`` also writes the KV it computes (false); allowed
                       only where the decode side's KV layout equals the prefill side's
lookup_rpc_port        accepted as in the seed (0..65535) and validated; see below
prefill                optional ``{"tp_size": N, "dp_size": M}`` of the prefill side, so that
                       ``consumer_is_to_put`` can check the layouts really match
model_id               the model's name in block keys (default: vLLM's served model name)
tenant                 isolates one tenant's keys from another's ("")
pool_timeout_ms        every load's and save's pool call timeout (env KVPOOL_TRANSFER_TIMEOUT /
                       ASCEND_TRANSFER_TIMEOUT, else 10000)
lookup_timeout_ms      a scheduler lookup's timeout (2000): the scheduler waits for it, so a
                       hung pool must cost little; a timed-out lookup is a miss
reconnect_interval_ms  after a pool failure, how long lookups miss before reconnecting (5000)
embedded_capacity      size of the embedded pool (e.g. "1GiB"; default 1GiB)
=====================  =======================================================================

``lookup_rpc_port``: in the seed the scheduler asks its worker, which owns the store
client, whether a prefix is cached.  With a master, kvpool's scheduler half holds its own
client and asks the master directly (``prefix_lookup`` takes no lease), so no channel is
needed.  With ``backend: embedded`` the pool lives in the worker process and the scheduler
asks it over a Unix socket named after the instance and this value (see
:mod:`kvpool.connectors.store_lookup`), so two instances on one host never collide, whatever
the value; ``0`` is the usual choice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.config import (
    TRANSFER_TIMEOUT_VARS,
    NodeConfig,
    env_lookup,
    parse_bool_value,
    parse_host_port,
    parse_size,
)
from kvpool.errors import ConfigError

__all__ = [
    "BACKENDS",
    "CONNECTOR_NAME",
    "EXTRA_KEYS",
    "ROLES",
    "StoreConfig",
    "check_put_back",
    "parse_store_config",
]

CONNECTOR_NAME = "KVPoolStoreConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# "mooncake" is the seed's spelling of "the shared pool behind a master".
BACKENDS = ("mooncake", "kvpool", "embedded")
EXTRA_KEYS = (
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
)
_DEFAULT_TIMEOUT_MS = 10_000
_DEFAULT_LOOKUP_MS = 2_000
_DEFAULT_RECONNECT_MS = 5_000
_DEFAULT_EMBEDDED = 1 << 30


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
    pool_timeout_ms: int = _DEFAULT_TIMEOUT_MS
    lookup_timeout_ms: int = _DEFAULT_LOOKUP_MS
    reconnect_interval_ms: int = _DEFAULT_RECONNECT_MS
    embedded_capacity: int = _DEFAULT_EMBEDDED

    @property
    def saves(self) -> bool:
        """Whether this instance writes the KV it computes into the pool."""
        return self.role != "kv_consumer" or self.consumer_is_to_put

    @property
    def uses_master(self) -> bool:
        return self.backend != "embedded"


def _int(value: object, key: str, *, minimum: int, maximum: int | None = None) -> int:
    # The seed writes ports as strings ("lookup_rpc_port": "0"), so digits in a string count.
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
    load_node: Callable[[], NodeConfig],
) -> StoreConfig:
    """Validate the connector's settings.  ``load_node`` reads the node config (mooncake.json)
    and is called only when the backend needs a master and none is given explicitly."""
    if kv_role not in ROLES:
        raise ConfigError(
            f"kv_role: {CONNECTOR_NAME} needs one of {', '.join(ROLES)}, got {kv_role!r}"
        )
    extra = dict(extra or {})
    for key in extra:
        if key not in EXTRA_KEYS:
            raise ConfigError(
                f"kv_connector_extra_config.{key}: unknown key for {CONNECTOR_NAME};"
                f" known keys: {', '.join(EXTRA_KEYS)}"
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
        else _DEFAULT_TIMEOUT_MS
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
    )


def check_put_back(config: StoreConfig, *, is_mla: bool, tp_size: int) -> None:
    """Refuse ``consumer_is_to_put`` where decode-side KV would not fit prefill-side readers.

    A block written by the decode side is read back by prefill instances under the same key,
    so its bytes must be laid out as the prefill side lays them out.  Model, dtype, block
    size and device are in the key's namespace anyway; what can still differ is how KV heads
    are split across tensor-parallel ranks.  MLA models keep one latent KV per token that
    every rank holds whole (so the seed allows write-back only for MLA); other models match
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

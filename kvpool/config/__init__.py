"""Typed configuration: the node's ``mooncake.json`` keys, the master's flags, timeouts.

Pure parsing takes plain values and an environment *mapping*; only the edge reads the file
and ``os.environ``.  None of it imports vLLM (``kvpool doctor`` validates connector
settings on hosts without it), and every mistake is a ConfigError naming the key and fix.
"""

from __future__ import annotations

from kvpool.config.kv_transfer import (
    STORE_CONNECTOR,
    TRANSFER_CONNECTOR,
    StoreConfig,
    TransferConfig,
    check_put_back,
    pairing_group,
    parse_store_config,
)
from kvpool.config.master import MasterConfig
from kvpool.config.node import (
    NODE_KEYS,
    SERVED_PROTOCOLS,
    NodeConfig,
    config_path_from_env,
    load_node_config,
    parse_node_config,
    served_protocols,
)
from kvpool.config.topology import Topology, parse_topology
from kvpool.config.values import (
    CONFIG_PATH_VARS,
    CONNECT_TIMEOUT_VARS,
    DEFAULT_MASTER_PORT,
    DEFAULT_OFFLOAD_LIMIT,
    DEFAULT_SEGMENT_SIZE,
    OFFLOAD_LIMIT_VARS,
    TRANSFER_TIMEOUT_VARS,
    Timeouts,
    env_lookup,
    parse_bool_value,
    parse_host_port,
    parse_size,
    parse_timeouts,
)

__all__ = [
    "CONFIG_PATH_VARS",
    "CONNECT_TIMEOUT_VARS",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_OFFLOAD_LIMIT",
    "DEFAULT_SEGMENT_SIZE",
    "NODE_KEYS",
    "OFFLOAD_LIMIT_VARS",
    "SERVED_PROTOCOLS",
    "STORE_CONNECTOR",
    "TRANSFER_CONNECTOR",
    "TRANSFER_TIMEOUT_VARS",
    "MasterConfig",
    "NodeConfig",
    "StoreConfig",
    "Timeouts",
    "Topology",
    "TransferConfig",
    "check_put_back",
    "config_path_from_env",
    "env_lookup",
    "load_node_config",
    "pairing_group",
    "parse_bool_value",
    "parse_host_port",
    "parse_node_config",
    "parse_size",
    "parse_store_config",
    "parse_timeouts",
    "parse_topology",
    "served_protocols",
]

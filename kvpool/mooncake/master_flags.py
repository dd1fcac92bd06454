"""A ``mooncake_master`` command line, read in Mooncake's own terms (pure).

The flags kvpool's master shares are read as its own, with mooncake_master's defaults; the
rest are kept aside as given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpool.config.master import (
    MASTER_BOOL_NAMES,
    MASTER_FLAGS,
    MasterConfig,
    split_master_argv,
)
from kvpool.config.values import parse_int
from kvpool.errors import ConfigError

__all__ = [
    "MOONCAKE_MASTER_DEFAULTS",
    "MOONCAKE_MASTER_FIELDS",
    "MasterCommand",
    "parse_master_command",
]

_BY_NAME = {flag.name: flag for flag in MASTER_FLAGS}

#: mooncake_master's defaults where they differ from kvpool master's (master.cpp, 0.3.13);
#: it hosts no memory itself (segment_size 0): the clients mount theirs
MOONCAKE_MASTER_DEFAULTS: dict[str, Any] = {
    "host": "0.0.0.0",
    "port": 50051,
    "default_kv_lease_ttl": 10_000,
    "client_ttl": 10,
    "eviction_ratio": 0.05,
    "segment_size": 0,
}
# mooncake_master's flags that mean a MasterConfig field (--port is its deprecated alias
# of --rpc_port; a --rpc_port of 0 means "use --port")
_MOONCAKE_SHARED = (
    "port",
    "eviction_high_watermark_ratio",
    "eviction_ratio",
    "default_kv_lease_ttl",
    "enable_offload",
    "client_ttl",
)
_MOONCAKE_ALIASES = {"rpc_port": "port", "rpc_address": "host"}
#: MasterConfig fields a mooncake_master line can carry (host as --rpc_address)
MOONCAKE_MASTER_FIELDS = frozenset((*_MOONCAKE_SHARED, "host"))
# the rest of mooncake_master's flags (0.3.13's --helpfull, master.cpp and gflags' own):
# valid in its command line, nothing kvpool's checks read
_MOONCAKE_OTHER_NAMES = """
    allocation_strategy allow_evict_soft_pinned_objects batch_oplog_retry_timeout_sec
    cluster_id config_path cxl_path cxl_size default_kv_soft_pin_ttl
    dynamic_replication_admission_qps_threshold dynamic_replication_heat_window_seconds
    dynamic_replication_max_memory_replicas dynamic_replication_mode enable_cxl
    enable_disk_eviction enable_ha enable_http_metadata_server enable_kv_events
    enable_metadata_cleanup_on_timeout enable_metric_reporting enable_multi_tenants
    enable_oplog enable_snapshot enable_snapshot_restore etcd_endpoints
    global_file_segment_size ha_backend_connstring ha_backend_type http_metadata_server_host
    http_metadata_server_port kv_events_bind_endpoint kv_events_backend_id
    kv_events_queue_capacity max_kv_soft_pin_ttl max_retry_attempts max_threads
    max_total_finished_tasks max_total_pending_tasks max_total_processing_tasks
    memory_allocator metrics_host metrics_port offload_cap_ratio offload_force_evict
    offload_on_evict offloading_queue_limit pending_task_timeout_sec pod_name pod_namespace
    processing_task_timeout_sec put_start_discard_timeout_sec put_start_release_timeout_sec
    quota_bytes root_fs_dir rpc_conn_timeout_seconds rpc_enable_tcp_no_delay rpc_interface
    rpc_thread_num snapshot_backup_dir snapshot_interval_seconds snapshot_retention_count
    flagfile logtostderr alsologtostderr log_dir minloglevel stderrthreshold v"""
_MOONCAKE_OTHER = frozenset(_MOONCAKE_OTHER_NAMES.split())
# a flag only Mooncake has makes a line without a program name Mooncake's
_MOONCAKE_ONLY = frozenset(_MOONCAKE_ALIASES) | _MOONCAKE_OTHER
_BOOL_NAMES = (
    MASTER_BOOL_NAMES
    | frozenset(
        name for name in _MOONCAKE_OTHER if name.startswith(("enable_", "allow_", "offload_"))
    )
    | {"logtostderr", "alsologtostderr", "rpc_enable_tcp_no_delay"}
)


@dataclass(frozen=True, slots=True)
class MasterCommand:
    """A master's command line as kvpool reads it: whose master it starts, the settings
    kvpool checks (with that engine's defaults), and the rest."""

    engine: str  # "kvpool" or "mooncake"
    config: MasterConfig
    #: mooncake_master's HTTP port (/metrics, /health); kvpool's master serves both on --port
    metrics_port: int | None = None
    #: Mooncake's flags with no kvpool counterpart, as given
    other: tuple[tuple[str, str], ...] = ()


# A real mooncake_master line is read in Mooncake's own terms: gflags spellings
# (`-port 50051`, `--rpc_port=50051`), durations for the lease (`11s`, `500ms`), its flags
# that kvpool's master has no counterpart of (`--metrics_port`,
# `--enable_http_metadata_server`, ...) accepted and kept aside, and its defaults where
# they differ from kvpool master's (lease 10 s, client_ttl 10 s, eviction_ratio 0.05:
# master.cpp of 0.3.13).  The program name decides nothing: the production guide writes
# `mooncake_master --port 50088 ...` for the master kvpool implements.  A line is
# Mooncake's when it uses a flag only Mooncake has (`--rpc_port`, `--metrics_port`, ...),
# or when the caller knows (a Mooncake master answered there).
def parse_master_command(argv: Sequence[str], *, engine: str | None = None) -> MasterCommand:
    """``kvpool master ...`` or ``mooncake_master ...`` (ConfigError naming a bad flag).
    ``engine`` "mooncake" reads it as a real mooncake_master's (its defaults); None: as
    Mooncake's when it uses a flag only Mooncake has, else as kvpool master's."""
    program, values = split_master_argv(argv, bools=_BOOL_NAMES)
    if program == "master":  # `kvpool master ...`
        mooncake = False
    elif engine is not None:
        mooncake = engine == "mooncake"
    else:
        mooncake = any(key in _MOONCAKE_ONLY for key in values)
    if not mooncake:
        for key in values:
            if key in _MOONCAKE_ONLY and key not in _BY_NAME:
                raise ConfigError(
                    f"--{key}: a mooncake_master flag; kvpool master does not take it"
                    + (
                        f" (its --{_MOONCAKE_ALIASES[key]} does)"
                        if key in _MOONCAKE_ALIASES
                        else ""
                    )
                )
        return MasterCommand("kvpool", MasterConfig.from_flags(values))
    shared: dict[str, object] = {}
    other: list[tuple[str, str]] = []
    for key, value in values.items():
        if key in _MOONCAKE_SHARED:
            shared.setdefault(key, value)
        elif key in _MOONCAKE_ALIASES:
            if not (key == "rpc_port" and str(value).strip() == "0"):
                shared[_MOONCAKE_ALIASES[key]] = value  # --rpc_port wins over --port
        elif key in _MOONCAKE_OTHER:
            other.append((key, str(value)))
        else:
            raise ConfigError(
                f"--{key}: not a mooncake_master flag"
                + (" (kvpool master's only)" if key in _BY_NAME else "")
                + "; `mooncake_master --helpfull` lists them"
            )
    typed: dict[str, Any] = {k: _BY_NAME[k].parse(v, f"--{k}") for k, v in shared.items()}
    config = replace(MasterConfig(**MOONCAKE_MASTER_DEFAULTS), **typed)
    metrics = dict(other).get("metrics_port", "9003")
    return MasterCommand(
        "mooncake",
        config,
        metrics_port=parse_int(metrics, key="--metrics_port", minimum=1),
        other=tuple(other),
    )

"""``kvpool up --engine mooncake``: the parts of the plan that differ on real Mooncake (pure).

There the pool is the C++ ``mooncake_master`` (metadata, leases, eviction; no memory) and
Mooncake Store inside every vLLM process, each contributing ``global_segment_size``.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = [
    "EVERY_INTERFACE",
    "GUIDE_FLAGS",
    "master_argv",
    "metrics_grep",
    "node_config",
]


class _UpOptions(Protocol):
    """What is read here of :class:`kvpool.ops.up.options.UpOptions`, which the plan
    passes in: described, not imported, since ``kvpool up`` imports this package."""

    @property
    def mooncake_master(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def master_port(self) -> int: ...
    @property
    def metrics_port(self) -> int: ...
    @property
    def segment_size(self) -> int: ...
    @property
    def local_buffer_size(self) -> int: ...


#: the production guide's §3 master flags, as mooncake_master spells them
# So the stack is:
#
# - the wheel's ``mooncake_master`` with the production guide's flags (§3: lease 11000 ms,
#   eviction at 90 % taking 10 %, client_ttl 120 s), bound to the stack's host; its HTTP
#   side (``/health``, ``/metrics``) is the metrics port, its RPC port has no HTTP;
# - one Mooncake ``mooncake.json`` for the P and D instances (Mooncake's keys:
#   ``P2PHANDSHAKE``, ``master_server_address``, ...), which the store connector's
#   ``backend: "mooncake"`` reads as a Mooncake config and so runs on Mooncake Store;
# - the same MultiConnector, transfer connector and proxy as on kvpool's engine.
GUIDE_FLAGS = (
    "--eviction_high_watermark_ratio=0.9",
    "--eviction_ratio=0.1",
    "--default_kv_lease_ttl=11000",
    "--client_ttl=120",
)

# Mooncake's Transfer Engine listens on every interface, whatever the host given: the P and
# D instances' store ports are reachable from any network the machine is on (see
# :data:`EVERY_INTERFACE`).
#: said before anything starts, and in the docs
EVERY_INTERFACE = (
    "Mooncake's Transfer Engine ports (in the prefill and decode instances) listen on every"
    " interface, not only {host}: run this on a host whose networks you trust, or inside a"
    " private network namespace"
)


def master_argv(opts: _UpOptions) -> tuple[str, ...]:
    """``mooncake_master`` on the stack's host: RPC on ``--master-port``, metrics and
    ``/health`` on ``--metrics-port``."""
    return (
        opts.mooncake_master,
        f"--rpc_address={opts.host}",
        f"--rpc_port={opts.master_port}",
        f"--metrics_host={opts.host}",
        f"--metrics_port={opts.metrics_port}",
        *GUIDE_FLAGS,
    )


def node_config(opts: _UpOptions) -> dict[str, Any]:
    """The P and D instances' Mooncake ``mooncake.json`` (one host, one file)."""
    return {
        "local_hostname": opts.host,
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": opts.segment_size,
        "local_buffer_size": opts.local_buffer_size,
        "protocol": "tcp",
        "master_server_address": f"{opts.host}:{opts.master_port}",
    }


def metrics_grep(metrics_url: str) -> str:
    """The guide's §8.1 check, with the metric names mooncake_master really exports."""
    return f'curl -s {metrics_url}/metrics | grep -E "master_key_count|master_active_clients"'

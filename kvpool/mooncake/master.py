"""A real ``mooncake_master`` as ``kvpool status`` and ``kvpool doctor --master`` see it.

It speaks coro_rpc on its RPC port and HTTP only on its metrics port (9003): ``/health``
with a ``role``, and ``/metrics`` named ``master_*`` (which gives what: docs/mooncake.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpool.config.values import format_size
from kvpool.errors import ProtocolError
from kvpool.net import http_get, split_address

__all__ = [
    "MOONCAKE_METRICS_PORT",
    "MooncakeMasterFacts",
    "find_mooncake_master",
    "looks_like_mooncake_health",
    "mooncake_at",
    "parse_mooncake_metrics",
    "render_mooncake",
]

#: mooncake_master's default --metrics_port
MOONCAKE_METRICS_PORT = 9003


@dataclass(frozen=True, slots=True)
class MooncakeMasterFacts:
    """The §8.1 facts of a Mooncake master, from its metrics port."""

    metrics_address: str
    keys: int
    active_clients: int
    allocated_bytes: int
    capacity_bytes: int
    evictions: int
    evicted_keys: int
    alloc_failures: int
    put_failures: int
    role: str = ""
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)  # allocated, capacity
    engine: str = "mooncake"

    @property
    def fraction(self) -> float | None:
        return self.allocated_bytes / self.capacity_bytes if self.capacity_bytes else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def looks_like_mooncake_health(body: str) -> str | None:
    """The role a Mooncake master's /health names ("leader"), else None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict) and "role" in data and "service_ready" in data:
        return str(data["role"])
    return None


# The production guide's §8.1 command (``curl http://<master>:50088/metrics | grep -E
# "kv_cache|connected"``) has no answer on a real Mooncake master:
# ``mooncake_kv_cache_blocks_total`` and ``mooncake_connected_clients`` do not exist.  The
# §8.1 facts are read from these instead:
#
# =====================  =================================================
# keys                   ``master_key_count``
# active clients         ``master_active_clients``
# allocated / capacity   ``master_allocated_bytes`` / ``master_total_capacity_bytes``
# evictions              ``master_successful_evictions_total`` (keys: ``master_evicted_key_count``)
# allocation failures    ``master_put_start_alloc_failures_total``
# =====================  =================================================
def parse_mooncake_metrics(address: str, text: str, role: str = "") -> MooncakeMasterFacts:
    """``/metrics`` of a Mooncake master as facts; ProtocolError when it is not one."""
    values: dict[str, float] = {}
    segments: dict[str, list[int]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("segment_") and "segment" in s.labels:
                    pair = segments.setdefault(s.labels["segment"], [0, 0])
                    pair[0 if "allocated" in s.name else 1] = int(s.value)
                elif not s.labels:
                    values[s.name] = float(s.value)
    except ValueError as exc:
        raise ProtocolError(f"{address}/metrics is not Prometheus text: {exc}") from exc
    if "master_key_count" not in values:
        raise ProtocolError(f"{address}/metrics has no master_key_count: not a Mooncake master")

    def count(name: str) -> int:
        # prometheus_client names every counter's sample NAME_total, even where Mooncake
        # wrote no _total (master_evicted_key_count)
        return int(values.get(name, values.get(name + "_total", 0)))

    return MooncakeMasterFacts(
        metrics_address=address,
        keys=count("master_key_count"),
        active_clients=count("master_active_clients"),
        allocated_bytes=count("master_allocated_bytes"),
        capacity_bytes=count("master_total_capacity_bytes"),
        evictions=count("master_successful_evictions_total"),
        evicted_keys=count("master_evicted_key_count"),
        alloc_failures=count("master_put_start_alloc_failures_total"),
        put_failures=count("master_batch_put_start_failed_items_total")
        + count("master_put_start_failures_total"),
        role=role,
        segments={k: (v[0], v[1]) for k, v in segments.items()},
    )


def _candidates(address: str) -> list[str]:
    """Where a Mooncake master's metrics may be, given the address a user typed: that
    address itself (they named the metrics port), then its host on 9003 (they named the
    RPC port, as a mooncake.json's master_server_address does)."""
    host, port = split_address(address)
    same = f"{host}:{port}"
    default = f"{host}:{MOONCAKE_METRICS_PORT}"
    return [same] if same == default else [same, default]


def find_mooncake_master(
    address: str, timeout_s: float = 3.0
) -> tuple[MooncakeMasterFacts | None, str]:
    """The Mooncake master at (or beside) ``address``: its facts, or None and why not."""
    why = "no Mooncake metrics port answered"
    for candidate in _candidates(address):
        health = http_get(f"http://{candidate}/health", timeout_s)
        role = looks_like_mooncake_health(health.text) if health.ok else None
        if role is None:
            why = f"{candidate}/health: {health.error or 'not a Mooncake master'}"
            continue
        metrics = http_get(f"http://{candidate}/metrics", timeout_s, max_bytes=16 << 20)
        if not metrics.ok:
            why = f"{candidate}/metrics: {metrics.error}"
            continue
        try:
            return parse_mooncake_metrics(candidate, metrics.text, role), ""
        except ProtocolError as exc:
            why = str(exc)
    return None, why


def mooncake_at(address: str, timeout_s: float = 2.0) -> str | None:
    """A line naming the Mooncake master that holds ``address`` (a kvpool client's
    master), else None.  Only when the address itself speaks no HTTP (as Mooncake's RPC
    port: it closes an HTTP request without an answer; kvpool's master answers HTTP on its
    one port) is Mooncake's metrics port looked for, so a kvpool master beside a Mooncake
    one on the same host is never mistaken for it; nothing listening is None too (a
    master may start later)."""
    reply = http_get(f"http://{address}/health", timeout_s)
    if reply.status is not None and looks_like_mooncake_health(reply.text) is None:
        return None  # an HTTP server that is not Mooncake's: kvpool's master, or a stranger
    if reply.status is None and "refused" in (reply.error or "").lower():
        return None
    facts, _ = find_mooncake_master(address, timeout_s)
    if facts is None:
        return None
    return (
        f"{address} looks like a Mooncake master (mooncake_master, {facts.role or 'running'};"
        f" its metrics at http://{facts.metrics_address}/metrics), not kvpool's master:"
        " kvpool's engine needs `kvpool master` there, or write a Mooncake config"
        ' ("master_server_address": "' + address + '", "metadata_server": "P2PHANDSHAKE")'
        " for the Mooncake engine (docs/mooncake.md)"
    )


def render_mooncake(facts: MooncakeMasterFacts) -> RenderableType:
    """``kvpool status`` for a Mooncake master (pure)."""
    f = facts
    use = f"{100 * f.fraction:.1f}%" if f.fraction is not None else "no capacity mounted"
    head = Text.assemble(
        ("Mooncake master ", "bold"),
        (f.metrics_address, "bold cyan"),
        f"  ({f.role or 'role unknown'})  ·  {f.keys:,} keys  ·  {f.active_clients} active"
        f" client{'' if f.active_clients == 1 else 's'}",
    )
    table = Table(title="Pool (from master_* metrics)", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("keys", f"{f.keys:,}")
    table.add_row("active clients", f"{f.active_clients}")
    held = f"{format_size(f.allocated_bytes)} of {format_size(f.capacity_bytes)}"
    table.add_row("allocated", f"{held} ({use})")
    table.add_row("evictions", f"{f.evictions:,} rounds, {f.evicted_keys:,} keys")
    table.add_row("allocation failures", f"{f.alloc_failures:,}")
    table.add_row("failed puts", f"{f.put_failures:,}")
    segments = Table(title=f"Segments ({len(f.segments)})", title_justify="left")
    for col in ("segment", "allocated", "capacity"):
        segments.add_column(col, justify="left" if col == "segment" else "right")
    for name, (allocated, capacity) in sorted(f.segments.items()):
        segments.add_row(name, format_size(allocated), format_size(capacity))
    if not f.segments:
        segments.add_row(Text("no segment mounted", style="yellow"), "", "")
    note = Text(
        "real Mooncake: the guide's kv_cache/connected metrics do not exist; these are"
        f" master_* on http://{f.metrics_address}/metrics",
        style="dim",
    )
    return Group(head, table, segments, note)

"""``kvpool status``: the pool at a glance in a terminal.

It reads the master's ``/api/status`` snapshot and the counters only ``/metrics`` has;
parsing and rendering are pure, so the picture is unit-tested without a master.  A real
``mooncake_master`` is recognised too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvpool.config import config_path_from_env, load_node_config
from kvpool.config.masters import ETCD_SCHEME, parse_masters
from kvpool.config.node import node_engine, read_node_json
from kvpool.config.values import format_size
from kvpool.errors import (
    AuthError,
    ConfigError,
    KVPoolError,
    PeerTimeout,
    ProtocolError,
    TransferError,
)
from kvpool.ha.campaign import ClusterKeys
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.mooncake.ha import MooncakeHA, leadership_or_none, render_leadership
from kvpool.mooncake.master import MooncakeMasterFacts, find_mooncake_master, render_mooncake
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.net import DEFAULT_MASTER_PORT, http_get, master_scheme
from kvpool.security.secret import operator_headers

__all__ = [
    "ClientInfo",
    "PoolSnapshot",
    "Rates",
    "Ratio",
    "SegmentInfo",
    "StatusOptions",
    "TierUse",
    "default_master",
    "fetch_any",
    "fetch_snapshot",
    "parse_snapshot",
    "rates",
    "render",
    "run",
]


# ------------------------------------------------------------------------------- model
# Every ratio is shown with its denominator ("hit 37.5% (300 of 800 blocks)"): a ratio of
# nothing is printed as such, never as 0 %.
@dataclass(frozen=True, slots=True)
class Ratio:
    """``hits`` out of ``total`` ``unit`` (e.g. 300 of 800 blocks)."""

    hits: float
    total: float
    unit: str

    @property
    def value(self) -> float | None:
        return self.hits / self.total if self.total else None

    def text(self) -> str:
        if not self.total:
            return f"— (no {self.unit} asked yet)"
        pct = 100 * self.hits / self.total
        return f"{pct:.1f}% ({self.hits:,.0f} of {self.total:,.0f} {self.unit})"


@dataclass(frozen=True, slots=True)
class TierUse:
    name: str
    capacity: int
    used: int
    objects: int

    @property
    def fraction(self) -> float | None:
        return self.used / self.capacity if self.capacity else None


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A memory segment and how far its pages are faulted in (``warm``: off, warming,
    warm, failed, or unknown when its owner does not say)."""

    segment_id: str
    client_id: str
    capacity: int
    used: int
    warm: str
    warmed_bytes: int

    def pages(self) -> str:
        """The warmth in words, with its progress while warming."""
        if self.warm == "warming":
            pct = 100 * self.warmed_bytes / self.capacity if self.capacity else 100.0
            return (
                f"warming {pct:.0f}% ({format_size(self.warmed_bytes)} of "
                f"{format_size(self.capacity)})"
            )
        return {
            "warm": "warm",
            "off": "off (each page faults on first touch)",
            "failed": "failed (pages fault on first touch; see the owner's log)",
        }.get(self.warm, self.warm)


@dataclass(frozen=True, slots=True)
class ClientInfo:
    client_id: str
    address: str
    last_heartbeat_ms_ago: int
    segments: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """What ``kvpool status`` shows; built by :func:`parse_snapshot`."""

    master: str
    uptime_s: float
    tiers: tuple[TierUse, ...]
    objects: int
    pending: int
    active_leases: int
    clients: tuple[ClientInfo, ...]
    get_hits: Ratio
    prefix_blocks: Ratio
    prefix_tokens: Ratio
    gets: float
    puts: float
    put_failures: dict[str, float] = field(default_factory=dict)  # reason -> count
    evictions: dict[str, float] = field(default_factory=dict)  # tier -> count
    offloads: float = 0.0
    offload_failures: float = 0.0
    expired_leases: int = 0
    revoked_writes: int = 0
    errors: dict[str, float] = field(default_factory=dict)  # error code -> replies
    recent_errors: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)  # the flags the master runs with
    segments: tuple[SegmentInfo, ...] = ()  # memory segments, with their warmth
    #: role, epoch, leader, standbys (kvpool.ha): role "single" without an election
    leadership: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("get_hits", "prefix_blocks", "prefix_tokens"):
            out[name]["ratio"] = getattr(self, name).value
        return out


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-second rates between two snapshots of the same master."""

    puts_per_s: float
    gets_per_s: float
    evictions_per_s: float
    offloads_per_s: float


# ------------------------------------------------------------------------------- parse
def _samples(metrics_text: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(metrics_text)
            for s in family.samples
        ]
    except ValueError as exc:
        raise ProtocolError(f"/metrics is not Prometheus text: {exc}") from exc


def _by_label(
    samples: Iterable[tuple[str, dict[str, str], float]], name: str, label: str
) -> dict[str, float]:
    out: dict[str, float] = {}
    for sample_name, labels, value in samples:
        if sample_name == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def parse_snapshot(master: str, status: Mapping[str, Any], metrics_text: str) -> PoolSnapshot:
    """The master's ``/api/status`` JSON plus its ``/metrics`` text as one snapshot.

    Raises ProtocolError when the answers are not a kvpool master's.
    """
    try:
        tiers = tuple(
            TierUse(name, int(t["capacity"]), int(t["used"]), int(t["objects"]))
            for name, t in status["tiers"].items()
        )
        clients = tuple(
            ClientInfo(
                str(c["client_id"]),
                str(c.get("address", "")),
                int(c["last_heartbeat_ms_ago"]),
                tuple(c.get("segments", ())),
            )
            for c in status["clients"]
        )
        segments = tuple(
            SegmentInfo(
                str(seg["segment_id"]),
                str(seg["client_id"]),
                int(seg["capacity"]),
                int(seg.get("used", 0)),
                str(seg.get("warm", "unknown")),
                int(seg.get("warmed_bytes", 0)),
            )
            for seg in status.get("segments", ())
        )
        lookups = status["lookups"]
        stats = status["stats"]
        uptime_s = float(status["uptime_s"])
        objects = int(status["objects"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"/api/status is not a kvpool master's snapshot: {exc!r}") from exc
    samples = _samples(metrics_text)
    total = {name: v for name, labels, v in samples if not labels}
    return PoolSnapshot(
        master=master,
        uptime_s=uptime_s,
        tiers=tiers,
        objects=objects,
        pending=int(status.get("pending", 0)),
        active_leases=int(status.get("active_leases", 0)),
        clients=clients,
        get_hits=Ratio(lookups["get_hits"], lookups["gets"], "gets"),
        prefix_blocks=Ratio(
            lookups["prefix_blocks_hit"], lookups["prefix_blocks_queried"], "blocks"
        ),
        prefix_tokens=Ratio(
            lookups["prefix_tokens_hit"], lookups["prefix_tokens_queried"], "tokens"
        ),
        gets=float(lookups["gets"]),
        puts=total.get("kvpool_puts_total", 0.0),
        put_failures=_by_label(samples, "kvpool_put_failures_total", "reason"),
        evictions=_by_label(samples, "kvpool_evictions_total", "tier"),
        offloads=float(stats.get("offloads", total.get("kvpool_offloads_total", 0.0))),
        offload_failures=float(stats.get("demote_failures", 0)),
        expired_leases=int(stats.get("expired_leases", 0)),
        revoked_writes=int(stats.get("revoked_writes", 0)),
        errors=_by_label(samples, "kvpool_request_errors_total", "code"),
        recent_errors=tuple(str(e) for e in status.get("recent_errors", ())),
        config=dict(status.get("config") or {}),
        segments=segments,
        leadership=dict(status.get("leadership") or {}),
    )


def rates(previous: PoolSnapshot, current: PoolSnapshot) -> Rates | None:
    """Rates over the time between two snapshots; None if no time passed (or a restart)."""
    dt = current.uptime_s - previous.uptime_s
    if dt <= 0:
        return None
    return Rates(
        puts_per_s=(current.puts - previous.puts) / dt,
        gets_per_s=(current.gets - previous.gets) / dt,
        evictions_per_s=(sum(current.evictions.values()) - sum(previous.evictions.values())) / dt,
        offloads_per_s=(current.offloads - previous.offloads) / dt,
    )


# ------------------------------------------------------------------------------ render
def _bar(fraction: float | None, width: int = 20) -> Text:
    if fraction is None:
        return Text("no capacity", style="dim")
    filled = round(max(0.0, min(1.0, fraction)) * width)
    style = "red" if fraction >= 0.9 else "yellow" if fraction >= 0.75 else "green"
    return Text("█" * filled, style=style) + Text("░" * (width - filled), style="dim")


def _counts(d: Mapping[str, float]) -> str:
    if not d:
        return "0"
    parts = ", ".join(f"{k or '-'} {v:,.0f}" for k, v in sorted(d.items()))
    return f"{sum(d.values()):,.0f} ({parts})"


def render(snapshot: PoolSnapshot, rate: Rates | None = None) -> RenderableType:
    """The whole screen as rich renderables: a pure function of the snapshot."""
    s = snapshot
    head = Text.assemble(
        ("kvpool ", "bold"),
        (s.master, "bold cyan"),
        f"  up {s.uptime_s:,.0f} s  ·  {s.objects:,} objects",
        f" ({s.pending} being written)" if s.pending else "",
        f"  ·  {s.active_leases} leases",
    )
    ha = s.leadership
    if ha.get("role") not in (None, "single"):
        head.append_text(
            Text.assemble(
                "\n",
                (f"{ha['role']}", "bold green" if ha["role"] == "leader" else "bold yellow"),
                f"  epoch {ha.get('epoch', 0)}  ·  leader {ha.get('leader') or 'none'}",
                f"  ·  standbys {', '.join(ha.get('standbys') or []) or 'none'}",
                f"  ·  waiting for {ha['warming']} node(s)" if ha.get("warming") else "",
            )
        )

    tiers = Table(title="Tiers", title_justify="left", expand=False)
    for col in ("tier", "used", "capacity", "use", "objects"):
        tiers.add_column(col, justify="left" if col in ("tier", "use") else "right")
    for t in s.tiers:
        pct = f" {100 * t.fraction:.1f}%" if t.fraction is not None else ""
        tiers.add_row(
            t.name,
            format_size(t.used),
            format_size(t.capacity),
            _bar(t.fraction) + Text(pct),
            f"{t.objects:,}",
        )

    pool = Table(title="Traffic", title_justify="left", show_header=False)
    pool.add_column("what", style="bold")
    pool.add_column("value")
    pool.add_row("get hit", s.get_hits.text())
    pool.add_row("prefix hit", s.prefix_blocks.text())
    if s.prefix_tokens.total:
        pool.add_row("prefix hit (tokens)", s.prefix_tokens.text())
    pool.add_row("puts", f"{s.puts:,.0f}")
    pool.add_row("put failures", _counts(s.put_failures))
    pool.add_row("evictions", _counts(s.evictions))
    pool.add_row("offloads to SSD", f"{s.offloads:,.0f} ({s.offload_failures:,.0f} failed)")
    pool.add_row("expired leases", f"{s.expired_leases:,}")
    pool.add_row("revoked writes", f"{s.revoked_writes:,}")
    pool.add_row("error replies", _counts(s.errors))
    if rate is not None:
        pool.add_row(
            "rates",
            f"{rate.puts_per_s:,.1f} puts/s · {rate.gets_per_s:,.1f} gets/s · "
            f"{rate.evictions_per_s:,.1f} evictions/s · {rate.offloads_per_s:,.1f} offloads/s",
        )

    segments = Table(title="Memory segments", title_justify="left")
    for col in ("segment", "owner", "size", "pages"):
        segments.add_column(col, justify="right" if col == "size" else "left")
    for seg in s.segments:
        style = {"warm": "green", "warming": "yellow", "failed": "red"}.get(seg.warm, "dim")
        segments.add_row(
            seg.segment_id,
            seg.client_id,
            format_size(seg.capacity),
            Text(seg.pages(), style=style),
        )

    clients = Table(title=f"Clients ({len(s.clients)})", title_justify="left")
    for col in ("client", "address", "last heartbeat", "segments"):
        clients.add_column(col, justify="right" if col == "last heartbeat" else "left")
    for c in s.clients:
        age = c.last_heartbeat_ms_ago / 1000
        clients.add_row(
            c.client_id,
            c.address or "-",
            Text(f"{age:.1f} s ago", style="yellow" if age > 10 else ""),
            ", ".join(c.segments) or "-",
        )
    if not s.clients:
        clients.add_row(Text("no client registered", style="yellow"), "", "", "")

    errors: RenderableType
    if s.recent_errors:
        errors = Group(
            Text("Recent errors", style="bold red"),
            *(Text(f"  {e}") for e in s.recent_errors[-10:]),
        )
    else:
        errors = Text("No recent errors", style="green")
    shown = {k: v for k, v in s.config.items() if k not in ("host", "port")}
    flags = Text("flags: " + "  ".join(f"{k}={v}" for k, v in shown.items()), style="dim")
    return Group(
        head,
        *([flags] if shown else []),
        tiers,
        *([segments] if s.segments else []),
        pool,
        clients,
        errors,
    )


# --------------------------------------------------------------------------------- I/O
def _get(url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> bytes:
    """The body of a 2xx answer; anything else is the typed error the CLI reports.
    ``headers``: the operator's (default: from the environment's secret)."""
    if headers is None:
        headers = operator_headers(os.environ)
    reply = http_get(url, timeout_s, max_bytes=64 << 20, headers=dict(headers))
    if reply.ok:
        return reply.body
    if reply.status == 401:
        raise AuthError(
            f"GET {url}: the master wants the operator's token; set KVPOOL_SECRET_FILE "
            "to the cluster's secret"
        )
    if reply.status is not None:
        raise ProtocolError(f"GET {url}: HTTP {reply.status} (is this a kvpool master?)")
    if reply.error is not None and reply.error.startswith("no answer in"):
        raise PeerTimeout(f"GET {url}: no answer in {timeout_s} s")
    raise TransferError(f"GET {url}: {reply.error}")


def fetch_snapshot(master: str, timeout_s: float = 5.0) -> PoolSnapshot:
    """GET the master's /api/status and /metrics (raises KVPoolError subclasses)."""
    base = f"{master_scheme()}://{master}"  # https with KVPOOL_TLS_CA (a TLS master)
    body = _get(f"{base}/api/status", timeout_s)
    try:
        status = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"{base}/api/status is not JSON (is this a kvpool master?)") from exc
    if not isinstance(status, dict):
        raise ProtocolError(f"{base}/api/status is not a JSON object")
    metrics = _get(f"{base}/metrics", timeout_s).decode("utf-8", "replace")
    return parse_snapshot(master, status, metrics)


# A real ``mooncake_master`` is recognised too (:mod:`kvpool.mooncake.master`): when the
# address answers no kvpool snapshot, status looks for Mooncake's metrics port there (or on
# 9003 beside its RPC port) and shows the §8.1 facts from its ``master_*`` metrics.
def fetch_any(
    master: str, timeout_s: float = 5.0
) -> PoolSnapshot | MooncakeMasterFacts | MooncakeHA:
    """kvpool's snapshot, or, when no kvpool master answers there, a Mooncake master's
    facts (its metrics port, or 9003 beside its RPC port); raises kvpool's error then.
    HA masters (a list, or ``etcd://``): the leader's snapshot, or, when no kvpool master
    leads there, who leads Mooncake's own HA masters (:mod:`kvpool.mooncake.ha`)."""
    if "," in master or master.startswith(ETCD_SCHEME):
        try:
            return fetch_snapshot(find_leader(master, timeout_s), timeout_s)
        except KVPoolError as exc:
            ha, why = leadership_or_none(master, min(timeout_s, 3.0))
            if ha is None:
                raise TransferError(f"{exc}; nor do Mooncake's HA masters: {why}") from None
            return ha
    try:
        return fetch_snapshot(master, timeout_s)
    except KVPoolError as exc:
        facts, _ = find_mooncake_master(master, min(timeout_s, 3.0))
        if facts is None:
            raise exc from None
        return facts


def find_leader(spec: str, timeout_s: float = 5.0) -> str:
    """The address of the master that leads among ``spec``'s (kvpool.config.masters):
    etcd's leader key, or each master's own word (a standby names the leader)."""
    masters = parse_masters(spec, key="--master")
    candidates = list(masters.addresses)
    if masters.etcd:
        kv = Etcd(parse_endpoints(",".join(masters.etcd)), timeout_s).get(
            ClusterKeys(masters.cluster_id).leader
        )
        if kv is None:
            raise TransferError(f"no master leads in etcd {spec} now (its leader key is absent)")
        candidates = [json.loads(kv.value).get("address", "")]
    why: list[str] = []
    asked: set[str] = set()
    while candidates:
        address = candidates.pop(0)
        if address in asked:
            continue
        asked.add(address)
        try:
            view = json.loads(_get(f"{master_scheme()}://{address}/api/status", timeout_s))
        except (KVPoolError, ValueError) as exc:
            why.append(f"{address}: {exc}")
            continue
        ha = view.get("leadership") or {}
        if ha.get("role") in ("leader", "single", None):
            return address
        if ha.get("leader") and ha["leader"] not in candidates:
            candidates.insert(0, ha["leader"])
        why.append(f"{address}: {ha.get('role')}")
    raise TransferError(f"no master of {spec} leads now ({'; '.join(why)})")


def default_master(env: Mapping[str, str]) -> str:
    """The master named by the node config (KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH) when
    one is set and valid, else the local default: status on a node needs no flag."""
    if config_path_from_env(env) is not None:
        try:
            data, source = read_node_json(env=env)
            if isinstance(data, dict) and node_engine(data) == "mooncake":
                return parse_mooncake_config(data, source=source).master_address
            return load_node_config(env=env).master_address
        except ConfigError:
            pass  # doctor explains a broken config; status just falls back
    return f"127.0.0.1:{DEFAULT_MASTER_PORT}"


@dataclass(frozen=True, slots=True)
class StatusOptions:
    """``kvpool status``: ``master`` None means the node config's, else the local default."""

    master: str | None = None
    watch_s: float | None = None  # refresh every so many seconds until Ctrl-C
    as_json: bool = False  # one JSON line per update
    max_updates: int | None = None  # stop after so many updates (scripts, tests)

    def __post_init__(self) -> None:
        if self.watch_s is not None and self.watch_s <= 0:
            raise ConfigError("--watch: SECONDS must be positive")


def run(
    options: StatusOptions,
    *,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print the status once, or every ``watch_s`` seconds until Ctrl-C (or
    ``max_updates``).  Exit status 1 when the master cannot be read."""
    master = options.master or default_master(os.environ)
    stream = out or sys.stdout
    console = Console(file=stream, highlight=False)
    previous: PoolSnapshot | None = None
    updates = 0
    try:
        while True:
            try:
                snap = fetch_any(master)
            except KVPoolError as exc:
                print(
                    f"kvpool status: cannot read the master at {master}: {exc}\n"
                    "  is `kvpool master` running there?  (or mooncake_master, whose"
                    " metrics port 9003 status reads; address: --master HOST:PORT)",
                    file=sys.stderr,
                )
                return 1
            if options.as_json:
                print(json.dumps(snap.to_json()), file=stream, flush=True)
            else:
                if options.watch_s is not None and stream.isatty():
                    console.clear()
                if isinstance(snap, MooncakeHA):
                    console.print(render_leadership(snap))
                elif isinstance(snap, MooncakeMasterFacts):
                    console.print(render_mooncake(snap))
                else:
                    console.print(render(snap, rates(previous, snap) if previous else None))
            updates += 1
            if options.watch_s is None or (
                options.max_updates is not None and updates >= options.max_updates
            ):
                return 0
            previous = snap if isinstance(snap, PoolSnapshot) else None
            sleep(options.watch_s)
    except KeyboardInterrupt:
        return 0

"""Mooncake's own HA (``mooncake_master --enable_ha``): which master leads, as Mooncake
records it, for ``kvpool status``, ``kvpool doctor`` and the Mooncake engine.  What
Mooncake does is below the imports; the operator's view is docs/ha.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from kvpool.config.masters import ETCD_SCHEME
from kvpool.errors import ConfigError, KVPoolError, TransferError
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.mooncake.master import (
    MOONCAKE_METRICS_PORT,
    MooncakeMasterFacts,
    find_mooncake_master,
    render_mooncake,
)
from kvpool.mooncake.settings import parse_mooncake_master
from kvpool.net import http_get, split_address

__all__ = [
    "CLUSTER_ENV",
    "DEFAULT_CLUSTER_ID",
    "MasterHealth",
    "MasterView",
    "MooncakeHA",
    "ask_master",
    "cluster_id",
    "describe",
    "find_leadership",
    "leadership_or_none",
    "master_view_key",
    "read_master_view",
    "render_leadership",
]

# What Mooncake does (mooncake-store's EtcdLeaderCoordinator, 0.3.13):
# - Every master started with --enable_ha --etcd_endpoints=E [--cluster_id=C] tries to
#   create mooncake-store/<C>/master_view in etcd under a 5 s lease; the one that does
#   leads.  The value is the leader's RPC address (--rpc_address:--rpc_port); the key's
#   create revision is the *view version*, larger for every later leader.
# - A new leader serves only after one more lease TTL (leader_warmup), so a killed
#   leader leaves the pool without one for about two TTLs.
# - Standbys write nothing to etcd.  Only each master's own /health, on its metrics port,
#   says "role": "standby" and names the leader it sees: the standbys can be listed only
#   when the masters' metrics addresses are given.
# - A Store client whose master address is etcd://E reads the key, dials the leader and
#   watches the key to follow the next one.  Its cluster id is MC_STORE_CLUSTER_ID
#   (default mooncake_cluster), never part of the address.
# - With the op-log off (Mooncake's default) a new leader starts with no metadata:
#   objects put before the failover are misses, and clients re-mount their segments.

#: where Mooncake's client (and so kvpool) reads the masters' --cluster_id
CLUSTER_ENV = "MC_STORE_CLUSTER_ID"
#: mooncake_master's default --cluster_id
DEFAULT_CLUSTER_ID = "mooncake_cluster"


def cluster_id(env: Mapping[str, str]) -> str:
    return env.get(CLUSTER_ENV, "").strip() or DEFAULT_CLUSTER_ID


def master_view_key(cluster: str) -> str:
    return f"mooncake-store/{cluster.rstrip('/')}/master_view"


@dataclass(frozen=True, slots=True)
class MasterView:
    """The leader as etcd records it: its RPC address and the view version."""

    leader: str
    view_version: int


def read_master_view(
    endpoints: Sequence[str], cluster: str, timeout_s: float = 2.0
) -> MasterView | None:
    """The master view in etcd at ``endpoints`` (host:port); None while no master leads.
    Raises TransferError / PeerTimeout when etcd does not answer."""
    kv = Etcd(parse_endpoints(",".join(endpoints)), timeout_s).get(master_view_key(cluster))
    return None if kv is None else MasterView(kv.value, kv.create_revision)


@dataclass(frozen=True, slots=True)
class MasterHealth:
    """One master's word on itself, from ``/health`` on its metrics port."""

    metrics_address: str
    role: str = ""  # "leader" / "standby"; "" when it did not answer
    ha_state: str = ""  # standby, leader_warmup, serving, ...
    service_ready: bool = False
    leader: str = ""  # the leader's RPC address, as this master sees it
    view_version: int = 0
    error: str = ""


def ask_master(metrics_address: str, timeout_s: float = 2.0) -> MasterHealth:
    """``/health`` of the master whose metrics port is ``metrics_address`` (never raises)."""
    reply = http_get(f"http://{metrics_address}/health", timeout_s)
    if not reply.ok:
        return MasterHealth(metrics_address, error=reply.error or f"HTTP {reply.status}")
    try:
        data = json.loads(reply.text)
        return MasterHealth(
            metrics_address,
            role=str(data["role"]),
            ha_state=str(data.get("ha_state", "")),
            service_ready=bool(data.get("service_ready")),
            leader=str(data.get("leader_address") or ""),
            view_version=int(data.get("view_version") or 0),
        )
    except (ValueError, KeyError, TypeError):
        return MasterHealth(metrics_address, error="its /health is not a Mooncake master's")


@dataclass(frozen=True, slots=True)
class MooncakeHA:
    """Who leads among Mooncake's HA masters, and the leader's §8.1 facts when found."""

    spec: str  # what the user gave: etcd://... or the masters' metrics addresses
    leader: str  # the leader's RPC address
    view_version: int
    ha_state: str = ""  # the leader's: leader_warmup (not serving yet) or serving
    #: the masters' metrics addresses that said "standby" (from etcd: unknown, see below)
    standbys: tuple[str, ...] = ()
    down: tuple[str, ...] = ()  # named masters that did not answer
    #: False when the leader came from etcd, where Mooncake records no standby
    standbys_known: bool = True
    facts: MooncakeMasterFacts | None = None
    engine: str = "mooncake"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["facts"] = self.facts.to_json() if self.facts else None
        return out


def find_leadership(
    spec: str, timeout_s: float = 2.0, env: Mapping[str, str] | None = None
) -> MooncakeHA:
    """The leader of Mooncake's HA masters named by ``spec``: ``etcd://host:port[;...]``
    (etcd's master view; ``/cluster_id`` may follow, else MC_STORE_CLUSTER_ID's) or the
    masters' metrics addresses ``host:port,host:port`` (each one's /health).  Raises
    TransferError when none leads, ConfigError for a malformed spec."""
    spec = spec.strip()
    if spec.startswith(ETCD_SCHEME):
        return _from_etcd(spec, timeout_s, os.environ if env is None else env)
    return _from_masters(spec, timeout_s)


def _from_etcd(spec: str, timeout_s: float, env: Mapping[str, str]) -> MooncakeHA:
    hosts, _, cluster = spec[len(ETCD_SCHEME) :].partition("/")
    endpoints = parse_mooncake_master(ETCD_SCHEME + hosts, key="--master")
    cluster = cluster.strip("/") or cluster_id(env)
    view = read_master_view(endpoints, cluster, timeout_s)
    if view is None:
        raise TransferError(
            f"no Mooncake master leads in etcd {','.join(endpoints)}: {master_view_key(cluster)}"
            " is absent (masters down, or between leaders: a new one takes about two lease"
            " TTLs, 5 s each)"
        )
    facts, state = _leader_facts(view.leader, timeout_s)
    return MooncakeHA(
        spec, view.leader, view.view_version, state, standbys_known=False, facts=facts
    )


def _leader_facts(leader: str, timeout_s: float) -> tuple[MooncakeMasterFacts | None, str]:
    """The leader's facts from its metrics port, looked for beside its RPC address (9003),
    and used only when that port's /health says it is this leader (two masters on one
    host: 9003 may be another one's, a standby's)."""
    host, _ = split_address(leader)
    health = ask_master(f"{host}:{MOONCAKE_METRICS_PORT}", timeout_s)
    if health.role != "leader" or health.leader != leader:
        return None, ""
    facts, _ = find_mooncake_master(health.metrics_address, timeout_s)
    return facts, health.ha_state


def _from_masters(spec: str, timeout_s: float) -> MooncakeHA:
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ConfigError("--master: empty; expected the masters' metrics host:port list")
    answers = [ask_master(a, timeout_s) for a in addresses]
    leaders = sorted(
        (h for h in answers if h.role == "leader" and h.leader), key=lambda h: h.view_version
    )
    if not leaders:
        said = "; ".join(f"{h.metrics_address}: {h.role or h.error}" for h in answers)
        raise TransferError(f"no Mooncake master of {spec} leads now ({said})")
    leader = leaders[-1]  # a stale one still claiming a past view has the smaller version
    facts, _ = find_mooncake_master(leader.metrics_address, timeout_s)
    return MooncakeHA(
        spec,
        leader.leader,
        leader.view_version,
        leader.ha_state,
        standbys=tuple(h.metrics_address for h in answers if h.role == "standby"),
        down=tuple(h.metrics_address for h in answers if not h.role),
        facts=facts,
    )


def describe(ha: MooncakeHA) -> str:
    """One line: the leader, its view, and the standbys (or why they are not known)."""
    state = f", {ha.ha_state}" if ha.ha_state else ""
    if not ha.standbys_known:
        standbys = (
            "not recorded (Mooncake keeps only its leader in etcd; give the masters' metrics"
            " addresses, --master HOST:PORT,HOST:PORT, to list them)"
        )
    else:
        standbys = ", ".join(ha.standbys) or "none (a failover has nowhere to go)"
    down = f"; not answering: {', '.join(ha.down)}" if ha.down else ""
    return f"{ha.leader} leads (Mooncake view {ha.view_version}{state}); standbys: {standbys}{down}"


def render_leadership(ha: MooncakeHA) -> RenderableType:
    """``kvpool status`` for Mooncake's HA masters (pure)."""
    head = Text.assemble(("Mooncake HA: ", "bold"), describe(ha))
    if ha.facts is not None:
        return Group(head, render_mooncake(ha.facts))
    note = Text(
        f"the leader's metrics port was not found beside {ha.leader} (9003): name the masters'"
        " metrics addresses to read its §8.1 facts",
        style="dim",
    )
    return Group(head, note)


def leadership_or_none(spec: str, timeout_s: float = 2.0) -> tuple[MooncakeHA | None, str]:
    """:func:`find_leadership`, or None and why not (for callers that try kvpool's first)."""
    try:
        return find_leadership(spec, timeout_s), ""
    except KVPoolError as exc:
        return None, str(exc)

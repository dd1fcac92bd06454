"""Doctor checks over a node's config file, its master, the environment and block keys (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpool.config import (
    CONFIG_PATH_VARS,
    DEFAULT_MASTER_PORT,
    MasterConfig,
    NodeConfig,
)
from kvpool.mooncake import doctor as mooncake_doctor
from kvpool.mooncake.doctor import MOONCAKE_RPC_PORT
from kvpool.mooncake.master import MooncakeMasterFacts
from kvpool.mooncake.settings import MooncakeNodeConfig
from kvpool.net import split_address
from kvpool.ops.doctor.checks import Check, as_checks, fail, pass_, skip, warn

__all__ = [
    "ConfigFileFacts",
    "MasterFacts",
    "check_config_file",
    "check_cross_node",
    "check_hashseed",
    "check_key_agreement",
    "check_local_hostname",
    "check_master",
    "check_master_address",
    "check_master_flags",
    "check_registered",
]

_EXPORT = f"export KVPOOL_CONFIG_PATH=/path/to/mooncake.json (or {CONFIG_PATH_VARS[1]})"


@dataclass(frozen=True, slots=True)
class ConfigFileFacts:
    source: str | None  # "KVPOOL_CONFIG_PATH=/x", "--config /x", or None when none given
    node: NodeConfig | None
    error: str | None  # the ConfigError message when the file is missing or wrong
    env_set: bool  # whether KVPOOL_/MOONCAKE_CONFIG_PATH is set for the serving processes
    shadowed: str | None = None  # "MOONCAKE_CONFIG_PATH=/y" when KVPOOL_CONFIG_PATH wins
    mooncake: MooncakeNodeConfig | None = None  # a Mooncake config (node is None then)
    rdma_devices: tuple[str, ...] | None = None  # /sys/class/infiniband (None: absent)


@dataclass(frozen=True, slots=True)
class MasterFacts:
    address: str
    connect_error: str | None
    health_status: int | None = None
    health_error: str | None = None
    metrics_text: str | None = None
    # GET /api/status as JSON (None when absent): "clients" and, when the master reports
    # it, "config" (its flags, so doctor judges the running master without --master-cmd).
    status: Mapping[str, Any] | None = None
    # a real mooncake_master answered instead (kvpool.mooncake.master)
    mooncake: MooncakeMasterFacts | None = None
    #: the port answers coro_rpc (a Mooncake master's RPC port) but no metrics port was found
    mooncake_rpc: bool = False
    #: /metrics answered 401: it needs the operator's token, which this host does not hold
    metrics_locked: bool = False


def check_config_file(facts: ConfigFileFacts) -> list[Check]:
    """The production guide's §8.3 row 4 ("AscendStore cannot reach the master") and §9 box 2."""
    results: list[Check] = []
    if facts.source is None:
        return [
            fail(
                "config.file",
                "no node config: KVPOOL_CONFIG_PATH and MOONCAKE_CONFIG_PATH are unset, so the"
                " connectors cannot find the master",
                _EXPORT + "; kvpool config render writes the file",
            )
        ]
    if not facts.env_set:
        results.append(
            warn(
                "config.env",
                f"checked {facts.source}, but neither KVPOOL_CONFIG_PATH nor MOONCAKE_CONFIG_PATH"
                " is set here; the serving processes read the variable",
                _EXPORT + " in the environment of every vLLM process",
            )
        )
    if facts.shadowed:
        results.append(
            warn(
                "config.env",
                f"{facts.shadowed} is ignored: KVPOOL_CONFIG_PATH wins when both are set",
                "unset one of them, or point both at the same file",
            )
        )
    if facts.mooncake is not None and facts.error is None:
        judged = mooncake_doctor.config_findings(facts.source, facts.mooncake, facts.rdma_devices)
        return results + as_checks(judged)
    if facts.error is not None or facts.node is None:
        results.append(fail("config.file", f"{facts.source}: {facts.error}", _fix_for(facts)))
        return results
    node = facts.node
    results.append(
        pass_(
            "config.file",
            f"{facts.source}: local_hostname {node.local_hostname}, master {node.master_address},"
            f" protocol {node.protocol}",
        )
    )
    return results


def _fix_for(facts: ConfigFileFacts) -> str:
    error = facts.error or ""
    if "cannot read" in error:
        return "create the file (kvpool config render writes it) or fix the path: " + _EXPORT
    return "fix the key named above; docs/configuration.md lists every key"


def check_master_address(node: NodeConfig | MooncakeNodeConfig | None, master: str | None) -> Check:
    if node is None:
        return skip("config.master", "no valid node config to compare with the master")
    mooncake = isinstance(node, MooncakeNodeConfig)
    if master is not None and not _same_masters(node.master_address, master):
        key = "master_server_address" if mooncake else "metadata_server"
        return fail(
            "config.master",
            f"{node.source or 'the config'} points at {node.master_address}, but the master is"
            f" {master}",
            f'set "{key}": "{master}" in every node\'s config (kvpool config render)',
        )
    if "," in node.master_address or node.master_address.startswith("etcd://"):
        return pass_("config.master", f"the config points at the HA masters {node.master_address}")
    if isinstance(node, MooncakeNodeConfig):
        port = _split(node.master_address)[1]
        note = "" if port == MOONCAKE_RPC_PORT else f" (not mooncake_master's {MOONCAKE_RPC_PORT})"
    else:
        note = (
            ""
            if node.master_port == DEFAULT_MASTER_PORT
            else f" (not Mooncake's {DEFAULT_MASTER_PORT})"
        )
    return pass_("config.master", f"the config points at the master {node.master_address}{note}")


def _split(address: str) -> tuple[str, int | None]:
    """(host, port) of ``address``; the port is None when it is not a number."""
    try:
        return split_address(address)
    except ValueError:
        return address, None


def _same_masters(a: str, b: str) -> bool:
    """One master, or the same HA masters (in any order)."""
    if "," in a or "," in b or a.startswith("etcd://") or b.startswith("etcd://"):
        return sorted(a.split(",")) == sorted(b.split(","))
    return _same_address(a, b)


def _same_address(a: str, b: str) -> bool:
    local = {"127.0.0.1", "localhost", "::1"}
    (ha, pa), (hb, pb) = _split(a), _split(b)
    return pa == pb and (ha == hb or (ha in local and hb in local))


def check_local_hostname(
    node: NodeConfig | MooncakeNodeConfig | None, bind_error: str | None
) -> Check:
    if node is None:
        return skip("config.local_hostname", "no valid node config")
    if bind_error is not None:
        return fail(
            "config.local_hostname",
            f"local_hostname {node.local_hostname} is not an address of this machine"
            f" ({bind_error}): peers would connect to another host",
            'set "local_hostname" to this node\'s own IP (see `ip -br addr`)',
        )
    return pass_("config.local_hostname", f"{node.local_hostname} is an address of this machine")


def check_leadership(
    found: tuple[str, str, Mapping[str, object] | str] | None,
) -> Check | None:
    """HA masters (docs/ha.md): one of them leads, and which are its standbys."""
    if found is None:
        return None
    spec, leader, view = found
    if not leader or isinstance(view, str):
        return fail(
            "master.leader",
            f"no master of {spec} leads: {view}" if spec not in str(view) else str(view),
            "start the masters with --enable_ha --etcd_endpoints (docs/ha.md) and check etcd"
            " answers; kvpool status --master " + spec,
        )
    standbys = ", ".join(str(s) for s in view.get("standbys") or []) or "none"  # type: ignore[attr-defined]
    role = view.get("role")
    if role == "single":
        return fail(
            "master.leader",
            f"{leader} runs without an election (no --enable_ha), but {spec} names several masters",
            "start every master with --enable_ha --etcd_endpoints (docs/ha.md)",
        )
    warming = (
        f"; waiting for {view['warming']} node(s) to re-announce" if view.get("warming") else ""
    )
    note = "" if standbys != "none" else " (no standby: a failover has nowhere to go)"
    return pass_(
        "master.leader",
        f"{leader} leads epoch {view.get('epoch')}; standbys: {standbys}{note}{warming}",
    )


def check_master(facts: MasterFacts | None) -> list[Check]:
    """The production guide's §9 box 1 and §8.1: the master answers on its port, /health
    and /metrics."""
    if facts is None:
        return [skip("master.reachable", "no --master and no node config to find it")]
    addr = facts.address
    if facts.connect_error is not None:
        return [
            fail(
                "master.reachable",
                f"cannot connect to the master at {addr}: {facts.connect_error}",
                "start it on that host: kvpool master --host 0.0.0.0 --port"
                f" {_split(addr)[1] or DEFAULT_MASTER_PORT} --secret_file PATH (the rendered"
                " master.sh; and open the port in the firewall to the cluster's hosts)",
            )
        ]
    results = [pass_("master.reachable", f"TCP connect to {addr} succeeded")]
    if facts.mooncake is not None:
        return results + as_checks(mooncake_doctor.master_findings(addr, facts.mooncake))
    if facts.mooncake_rpc:
        results.append(
            fail(
                "master.health",
                f"{addr} is a Mooncake master's RPC port (it answers coro_rpc), but its metrics"
                f" port was not found: {facts.health_error}",
                "give doctor the master's command line (--master-cmd 'mooncake_master ..."
                " --metrics_port=N') or --master HOST:METRICS_PORT",
            )
        )
        return results
    if facts.health_status != 200:
        got = facts.health_error or f"HTTP {facts.health_status}"
        results.append(
            fail(
                "master.health",
                f"GET http://{addr}/health failed: {got}; something other than a healthy"
                " kvpool master holds the port",
                "check `curl -s http://" + addr + "/health`; restart kvpool master",
            )
        )
        return results
    results.append(pass_("master.health", f"http://{addr}/health answers 200"))
    if facts.metrics_locked:
        results.append(
            skip(
                "master.metrics",
                f"http://{addr}/metrics needs the operator's token, and this host holds no"
                " cluster secret (a storage host holds only its node key); run doctor where"
                " KVPOOL_SECRET_FILE names the cluster secret to read it",
            )
        )
        return results
    results += _check_metrics(addr, facts.metrics_text)
    return results


def _check_metrics(addr: str, text: str | None) -> list[Check]:
    """The production guide's §8.1 grep, plus §8.3 row 5: a prefix hit ratio of 0, or a
    pool kept at its eviction watermark (kvpool_prefix_blocks_total and
    kvpool_tier_*_bytes, as the master exports them)."""
    grep = f'curl -s http://{addr}/metrics | grep -E "kv_cache|connected"'
    if not text:
        return [fail("master.metrics", f"http://{addr}/metrics gave nothing", grep)]
    values: dict[tuple[str, str], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                label = sample.labels.get("result") or sample.labels.get("tier") or ""
                key = (sample.name, label)
                values[key] = values.get(key, 0.0) + sample.value
    except ValueError as exc:
        return [fail("master.metrics", f"/metrics is not Prometheus text: {exc}", grep)]
    names = {name for name, _ in values}
    blocks = sorted(n for n in names if "kv_cache" in n)
    clients = sorted(n for n in names if "connected" in n)
    if not blocks or not clients:
        return [fail("master.metrics", "/metrics lacks the kv_cache/connected metrics", grep)]
    connected = values[(clients[0], "")]
    summary = f"{blocks[0]} {values[(blocks[0], '')]:g}, {clients[0]} {connected:g}"
    results = [
        warn(
            "master.metrics",
            summary + ": no node or vLLM process is registered",
            "start the serving processes with KVPOOL_CONFIG_PATH pointing at this master",
        )
        if connected == 0
        else pass_("master.metrics", summary)
    ]
    queried = values.get(("kvpool_prefix_blocks_total", "queried"), 0.0)
    hit = values.get(("kvpool_prefix_blocks_total", "hit"), 0.0)
    used = values.get(("kvpool_tier_used_bytes", "memory"), 0.0)
    capacity = values.get(("kvpool_tier_capacity_bytes", "memory"), 0.0)
    full = f"; memory tier {used / capacity:.0%} full" if capacity else ""
    if queried > 0 and hit == 0:
        results.append(
            warn(
                "master.hit_ratio",
                f"prefix hit ratio 0 (0 of {queried:g} blocks){full}: prompts share no"
                " prefix, or the pool evicts blocks before they are reused",
                "lower --eviction_high_watermark_ratio or add memory (global_segment_size);"
                " check that P and D use the same model and block size",
            )
        )
    elif queried > 0:
        results.append(
            pass_(
                "master.hit_ratio",
                f"prefix hit ratio {hit / queried:.0%} ({hit:g} of {queried:g} blocks){full}",
            )
        )
    return results


def check_master_flags(
    master: MasterConfig | None, error: str | None, *, engine: str = "kvpool"
) -> list[Check]:
    """The production guide's §3.1/§3.3 values in range; §8.3 row 5 (a pool kept too full
    never hits).  ``engine`` "mooncake": a mooncake_master, whose defaults differ."""
    if error is not None:
        return [fail("master.flags", f"master command: {error}", "fix the flag named above")]
    if master is None:
        assumed = (
            "mooncake_master's defaults are assumed (lease 10 s, client_ttl 10 s,"
            " eviction_ratio 0.05)"
            if engine == "mooncake"
            else "the production guide's defaults are assumed"
        )
        return [
            skip(
                "master.flags",
                "no --master-cmd and the master does not report its flags; " + assumed,
            )
        ]
    who = "mooncake_master: " if engine == "mooncake" else ""
    results = [
        pass_(
            "master.flags",
            f"{who}watermark {master.eviction_high_watermark_ratio}, eviction_ratio"
            f" {master.eviction_ratio}, lease {master.default_kv_lease_ttl} ms,"
            f" client_ttl {master.client_ttl} s",
        )
    ]
    if master.eviction_high_watermark_ratio > 0.95:
        results.append(
            warn(
                "master.watermark",
                f"eviction starts only at {master.eviction_high_watermark_ratio:.0%} full: puts"
                " fail while eviction catches up, and hit rates drop",
                "--eviction_high_watermark_ratio 0.9 (the production guide's value)",
            )
        )
    if master.eviction_ratio > 0.5:
        results.append(
            warn(
                "master.watermark",
                f"each eviction round drops {master.eviction_ratio:.0%} of the pool",
                "--eviction_ratio 0.1 (the production guide's value)",
            )
        )
    return results


def check_hashseed(env: Mapping[str, str], *, guide_connectors: bool) -> Check:
    """The production guide's §5.1 and §8.3 row 3.  kvpool's keys are content hashes, so
    the guide's rule only binds deployments still running Mooncake's and vllm-ascend's
    own connectors."""
    value = env.get("PYTHONHASHSEED")
    if guide_connectors and value != "0":
        return fail(
            "env.pythonhashseed",
            f"PYTHONHASHSEED is {value!r}: MooncakeConnectorV1 and AscendStoreConnector hash"
            " with Python's hash(), so nodes disagree on keys and never hit",
            "export PYTHONHASHSEED=0 on every node, or switch to kvpool's connectors",
        )
    return pass_(
        "env.pythonhashseed",
        f"PYTHONHASHSEED={value!r}: kvpool's block keys are BLAKE2b content hashes and do not"
        " depend on it (the key probe below proves it)",
    )


def check_key_agreement(probes: Mapping[str, Sequence[str] | str]) -> list[Check]:
    """Keys computed for the same tokens in processes with different PYTHONHASHSEED values."""
    if not probes:
        return [skip("keys.agreement", "key probe not run")]
    errors = {k: v for k, v in probes.items() if isinstance(v, str)}
    if errors:
        label, error = next(iter(errors.items()))
        return [fail("keys.agreement", f"key probe in {label} failed: {error}", "reinstall kvpool")]
    distinct = {tuple(v) for v in probes.values()}
    if len(distinct) != 1:
        return [
            fail(
                "keys.agreement",
                "processes computed different block keys for the same tokens: " + ", ".join(probes),
                "nodes would never hit each other's blocks; run every node on one kvpool version",
            )
        ]
    return [
        pass_(
            "keys.agreement",
            f"{len(probes)} processes ({', '.join(probes)}) computed identical block keys",
        ),
    ]


def check_cross_node(
    probe: tuple[Mapping[str, object] | None, bool, str | None] | None,
    mine: Sequence[str],
) -> Check:
    """The probe keys of another node, read through the pool (see probes.cross_node_probe)."""
    name = "keys.cross_node"
    if probe is None:
        return skip(name, "no reachable master to compare keys with other nodes through")
    other, published, error = probe
    if error is not None:
        return skip(name, f"cross-node key probe not run: {error}")
    if published or other is None:
        return pass_(
            name,
            "this node published its probe keys in the pool; doctor on the other nodes"
            " compares against them",
        )
    who = f"{other.get('host', '?')} (kvpool {other.get('version', '?')})"
    if list(mine) != other.get("keys"):
        return fail(
            name,
            f"{who} computed different block keys for the same tokens: nodes would never"
            " hit each other's blocks",
            "run the same kvpool version on every node (pip show kvpool)",
        )
    return pass_(name, f"this node computes the same block keys as {who}")


def check_registered(facts: MasterFacts | None, node: NodeConfig | None) -> Check | None:
    """With --live: the master's view of registered clients includes this node."""
    if facts is None or facts.status is None or node is None:
        return None
    clients = facts.status.get("clients")
    if not isinstance(clients, list):
        return None
    hosts = {_split(str(c.get("address", "")))[0] for c in clients if isinstance(c, Mapping)}
    if node.local_hostname in hosts:
        return pass_("master.registered", f"the master lists a client from {node.local_hostname}")
    return warn(
        "master.registered",
        f"none of the master's {len(clients)} clients is on {node.local_hostname}: the"
        " processes here have not registered (or use another address)",
        "check the connector start-up lines in the vLLM log and KVPOOL_CONFIG_PATH of those"
        " processes; local_hostname must be the address they register with",
    )

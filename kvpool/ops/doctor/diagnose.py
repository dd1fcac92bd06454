"""The pure half of ``kvpool doctor``: gathered facts in, the report's checks out, in report
order (no I/O, so the tests drive it with broken setups built as values).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.config import MasterConfig, NodeConfig, Timeouts
from kvpool.mooncake import doctor as mooncake_doctor
from kvpool.mooncake.master_flags import MOONCAKE_MASTER_DEFAULTS
from kvpool.ops.doctor.checks import Check, as_checks, skip
from kvpool.ops.doctor.checks_connector import Side, connector_checks
from kvpool.ops.doctor.checks_host import (
    check_peer_reachable,
    check_ports,
    check_ssd,
    check_timeouts,
    check_vllm_version,
)
from kvpool.ops.doctor.checks_node import (
    check_config_file,
    check_cross_node,
    check_hashseed,
    check_key_agreement,
    check_leadership,
    check_local_hostname,
    check_master,
    check_master_address,
    check_master_flags,
    check_registered,
)
from kvpool.ops.doctor.checks_security import (
    check_master_auth,
    check_master_bind,
    check_node_bind,
    check_secret_file,
)
from kvpool.ops.doctor.checks_settings import settings_checks, transfer_settings
from kvpool.ops.doctor.facts import Gathered

__all__ = ["diagnose"]


def _decode_ranks(sides: Sequence[Side]) -> int | None:
    for side in sides:
        if side.side == "decode" and side.own_topology is not None:
            return side.own_topology.ranks
    for side in sides:
        topology = side.config.transfer.topology("decode") if side.config.transfer else None
        if topology is not None and not isinstance(topology, str):
            return topology.ranks
    return None


def _effective_timeouts(g: Gathered) -> Timeouts | None:
    """The transfer connector's own values when it is configured here (its extra config and
    variables win there), else the node config's / environment's."""
    for side in g.sides:
        node = g.config_file.node if g.config_file else None
        local = side.side in g.local_sides
        settings = transfer_settings(side, g.env, node) if local else None
        if settings is not None:
            return Timeouts(settings.connect_timeout_ms, settings.transfer_timeout_ms)
    return g.timeouts


def _engine(g: Gathered) -> str:
    """Whose pool this is: what --master-cmd starts, else what the node config is for or
    what answered at the master's address."""
    if g.master_engine is not None:
        return g.master_engine
    mooncake_config = g.config_file is not None and g.config_file.mooncake is not None
    mooncake_master = g.master is not None and g.master.mooncake is not None
    mooncake_master = mooncake_master or g.mooncake_ha is not None
    return "mooncake" if mooncake_config or mooncake_master else "kvpool"


def _master_settings(g: Gathered, engine: str) -> MasterConfig:
    """The master's flags as given, else the defaults of the engine that runs it."""
    if g.master_config is not None:
        return g.master_config
    return MasterConfig(**MOONCAKE_MASTER_DEFAULTS) if engine == "mooncake" else MasterConfig()


def _security_checks(g: Gathered, node: NodeConfig | None) -> list[Check]:
    """kvpool's credentials: the files, the binds, and the master's handshake."""
    checks = [check_secret_file(f) for f in g.secret_files]
    answered = g.master is not None and g.master.health_status == 200
    for check in (
        check_node_bind(node, g.has_credential),
        check_master_bind(g.master_config, g.env_credential),
        check_master_auth(g.master_auth) if answered else None,
    ):
        if check is not None:
            checks.append(check)
    return checks


def diagnose(g: Gathered) -> list[Check]:
    """Every check, in report order, from gathered facts (pure)."""
    checks: list[Check] = list(g.input_errors)
    node = g.config_file.node if g.config_file else None
    either = node or (g.config_file.mooncake if g.config_file else None)
    engine = _engine(g)
    # --separate-hosts with both sides given: the pair is checked from another machine (the
    # one that rendered it), whose lack of a node config says nothing about P's or D's
    remote_pair = bool(g.sides) and not g.local_sides
    if g.config_file is not None and remote_pair and g.config_file.source is None:
        checks.append(
            skip("config.file", "no node config here: the pair runs on other hosts; run"
                 " doctor on each of them for its own")
        )  # fmt: skip
    elif g.config_file is not None:
        checks += check_config_file(g.config_file)
    checks.append(check_local_hostname(either, g.hostname_error))
    checks.append(check_master_address(either, g.master_arg))
    if g.mooncake_ha is not None:
        checks += as_checks([mooncake_doctor.leadership_finding(g.mooncake_ha)])
    leadership = check_leadership(g.leadership)
    checks += [leadership] if leadership is not None else []
    checks += check_master(g.master)
    registered = check_registered(g.master, node) if g.live else None
    checks += [registered] if registered is not None else []
    checks += check_master_flags(g.master_config, g.master_config_error, engine=engine)
    if engine == "mooncake":
        checks += as_checks([mooncake_doctor.security_finding()])
    else:
        checks += _security_checks(g, node)
    guide_names = any(e.is_guide_name for s in g.sides for e in s.config.entries)
    checks.append(check_hashseed(g.env, guide_connectors=guide_names))
    vllm = check_vllm_version(g.vllm_version)
    checks += [vllm] if vllm is not None else []
    checks += check_key_agreement(g.key_probe)
    mine = g.key_probe.get("this process")
    if isinstance(mine, list):
        checks.append(check_cross_node(g.cross_node, mine))
    same_host = len(g.local_sides) == len(g.sides)
    checks += connector_checks(g.sides, g.model, same_host=same_host)
    node_error = g.config_file.error if g.config_file else None
    mooncake = g.config_file.mooncake if g.config_file else None
    checks += settings_checks(g.sides, g.env, node, node_error, mooncake, remote_pair=remote_pair)
    checks.append(check_ssd(node, g.ssd, g.master_config))
    timeouts = _effective_timeouts(g)
    if timeouts is not None:
        lease = _master_settings(g, engine).default_kv_lease_ttl
        rdma = g.env.get("HCCL_RDMA_TIMEOUT", "").strip()
        checks += check_timeouts(
            timeouts,
            lease_ttl_ms=lease,
            decode_ranks=_decode_ranks(g.sides),
            rdma_timeout_exp=int(rdma) if rdma.isdigit() else None,
        )
    checks += check_ports(g.ports, live=g.live)
    if g.peer is not None:
        checks.append(check_peer_reachable(*g.peer))
    return checks

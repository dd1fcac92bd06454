"""What doctor says about real Mooncake (pure: facts in, findings out).

The guide's ``kv_cache|connected`` grep has no answer on real Mooncake; its facts come
from the master's ``master_*`` metrics.  Each :class:`Finding` is a line of doctor's
report as it stands (doctor imports this package, not the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.mooncake.ha import MooncakeHA, describe
from kvpool.mooncake.master import MooncakeMasterFacts
from kvpool.mooncake.settings import MooncakeNodeConfig

__all__ = [
    "MOONCAKE_RPC_PORT",
    "Finding",
    "config_findings",
    "leadership_finding",
    "master_findings",
    "security_finding",
]


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of doctor's report: ``status`` is ``PASS``, ``WARN``, ``FAIL`` or ``SKIP``
    (:class:`kvpool.ops.doctor.checks.Status`'s values), ``name`` is stable."""

    name: str
    status: str
    message: str
    fix: str = ""


def pass_(name: str, message: str) -> Finding:
    return Finding(name, "PASS", message)


def warn(name: str, message: str, fix: str) -> Finding:
    return Finding(name, "WARN", message, fix)


def fail(name: str, message: str, fix: str) -> Finding:
    return Finding(name, "FAIL", message, fix)


def skip(name: str, message: str) -> Finding:
    return Finding(name, "SKIP", message)


#: mooncake_master's default --rpc_port
MOONCAKE_RPC_PORT = 50051
_MIB = 1 << 20


# A node's Mooncake ``mooncake.json`` (``P2PHANDSHAKE`` metadata, ``local_buffer_size``, ...)
# is checked as the Mooncake config it is (:func:`config_findings`): its values, and
# with ``protocol`` ``rdma`` its ``device_name`` against the host's RDMA devices
# (``/sys/class/infiniband``, read by the gatherer).
def config_findings(
    source: str, config: MooncakeNodeConfig, rdma_devices: Sequence[str] | None
) -> list[Finding]:
    """A Mooncake mooncake.json (already valid keys and values: the parser refused the
    rest): what it asks of Mooncake, and whether this host has the RDMA devices it names.
    ``rdma_devices`` is the listing of /sys/class/infiniband (None: no such directory)."""
    c = config
    segment = (
        f"contributes {c.global_segment_size / _MIB:,.0f} MiB to the pool"
        if c.global_segment_size
        else "contributes no memory (a pure client: another process must)"
    )
    results = [
        pass_(
            "config.file",
            f"{source}: a Mooncake config (runs on real Mooncake): local_hostname"
            f" {c.local_hostname}, metadata_server {c.metadata_server}, master"
            f" {c.master_server_address}, protocol {c.protocol}; {segment}, transfer buffer"
            f" {c.local_buffer_size / _MIB:,.0f} MiB",
        )
    ]
    results.append(_check_device(c, rdma_devices))
    return results


def _check_device(c: MooncakeNodeConfig, devices: Sequence[str] | None) -> Finding:
    name = "config.device_name"
    if c.protocol != "rdma":
        if c.protocol != "tcp":
            return skip(name, f"protocol {c.protocol}: doctor checks RDMA devices only")
        unused = f" (device_name {c.device_name} is unused with tcp)" if c.device_name else ""
        return pass_(name, f"protocol tcp needs no RDMA device{unused}")
    listing = "ls /sys/class/infiniband"
    if not devices:
        where = "is empty" if devices is not None else "does not exist"
        return fail(
            name,
            f"protocol rdma, but this host has no RDMA device (/sys/class/infiniband {where})",
            "load the RDMA driver (rdma-core, the NIC's OFED) and check with `ibv_devices`,"
            ' or set "protocol": "tcp"',
        )
    wanted = [d.strip() for d in c.device_name.split(",") if d.strip()]
    if not wanted:
        return fail(
            name,
            f"protocol rdma without a device_name; this host has {', '.join(devices)}",
            f'set "device_name": "{devices[0]}" (one of `{listing}`)',
        )
    missing = [d for d in wanted if d not in devices]
    if missing:
        return fail(
            name,
            f"device_name {', '.join(missing)}: no such RDMA device on this host (it has"
            f" {', '.join(devices)})",
            f'set "device_name" to devices `{listing}` lists, e.g. "{devices[0]}"',
        )
    return pass_(name, f"RDMA device{'s' if len(wanted) > 1 else ''} {', '.join(wanted)} present")


def security_finding() -> Finding:
    """Mooncake has no authentication: say so, with what protects the pool instead."""
    return warn(
        "security.credentials",
        "the pool is open: the Mooncake engine has no credentials of its own, and no tenants"
        " or quotas, so any host that reaches the master's RPC port or a process's"
        " Transfer Engine ports can read, overwrite and remove every object, and every"
        " deployment on this pool shares every object with every other; network isolation"
        " is the only protection",
        "keep every Mooncake port on a private network (a VLAN, or a firewall admitting only"
        " the P/D hosts); Mooncake binds all interfaces unless told otherwise"
        " (--rpc_address, --metrics_host on the master); one pool per tenant, or kvpool's"
        " engine with a tenant credential per deployment (docs/security.md, Tenants and"
        " quotas)",
    )


# Allocation failures are judged with Mooncake
# #2187 in mind: ``is_exist`` renews leases, so a flood of lookups can keep every object
# leased and starve eviction; the fix is a shorter ``--default_kv_lease_ttl``.
def master_findings(address: str, facts: MooncakeMasterFacts) -> list[Finding]:
    """A Mooncake master answered at (or beside) ``address``: the §8.1 facts."""
    m = facts.metrics_address
    grep = f'curl -s http://{m}/metrics | grep -E "master_key_count|master_active_clients"'
    results = [
        pass_(
            "master.engine",
            f"a Mooncake master answers ({facts.role or 'role unknown'}): RPC at {address},"
            f" metrics at http://{m}/metrics (the guide's kv_cache/connected metrics do not"
            f" exist on real Mooncake; its §8.1 check is: {grep})",
        )
    ]
    use = f"{facts.allocated_bytes:,} of {facts.capacity_bytes:,} bytes allocated"
    summary = f"master_key_count {facts.keys}, master_active_clients {facts.active_clients}; {use}"
    if facts.active_clients == 0:
        results.append(
            warn(
                "master.metrics",
                summary + ": no client is registered",
                "start the serving processes with MOONCAKE_CONFIG_PATH pointing at a"
                " mooncake.json whose master_server_address is this master",
            )
        )
    elif facts.capacity_bytes == 0:
        results.append(
            warn(
                "master.metrics",
                summary + ": no memory is mounted, so every put fails",
                "give at least one process a global_segment_size of 16 MiB or more",
            )
        )
    else:
        results.append(pass_("master.metrics", summary))
    if facts.alloc_failures:
        full = facts.fraction is not None and facts.fraction >= 0.9
        results.append(
            warn(
                "master.alloc_failures",
                f"master_put_start_alloc_failures_total {facts.alloc_failures}"
                f" ({facts.evictions} evictions so far)"
                + (": the pool is full and eviction does not keep up" if full else ""),
                "lookups renew leases on Mooncake (is_exist, Mooncake #2187): lower"
                " --default_kv_lease_ttl toward the lookup-to-load gap (10000 ms, Mooncake's"
                " default, fits kvpool's connectors), or add memory (global_segment_size)",
            )
        )
    return results


def leadership_finding(ha: MooncakeHA) -> Finding:
    """Mooncake's own HA masters (:mod:`kvpool.mooncake.ha`): one leads, and serves."""
    if ha.ha_state == "leader_warmup":
        return warn(
            "master.leader",
            describe(ha) + ": the new leader waits one lease TTL (5 s) before it serves",
            "wait a few seconds and run doctor again; clients retry meanwhile",
        )
    return pass_("master.leader", describe(ha))

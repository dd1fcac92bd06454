"""Doctor's checks of a real ``mooncake_master`` (pure: facts in, checks out).

The production guide's §8.1 grep (``kv_cache|connected`` on port 50088) has no answer on
real Mooncake; its facts come from the master's ``master_*`` metrics on the metrics port
(:mod:`kvpool.ops.mooncake_master`).  Allocation failures are judged with Mooncake
#2187 in mind: ``is_exist`` renews leases, so a flood of lookups can keep every object
leased and starve eviction; the fix is a shorter ``--default_kv_lease_ttl``.
"""

from __future__ import annotations

from kvpool.ops.doctor.checks import Check, pass_, warn
from kvpool.ops.mooncake_master import MooncakeMasterFacts

__all__ = ["check_mooncake_master"]


def check_mooncake_master(address: str, facts: MooncakeMasterFacts) -> list[Check]:
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

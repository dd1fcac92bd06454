"""What each vLLM instance of ``kvpool up`` gets: its cores and its ``--kv-transfer-config``
(pure; :mod:`kvpool.ops.up.plan` puts them on the command lines)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.config.topology import Topology
from kvpool.ops.kvconfig import KVPOOL_CONNECTORS

__all__ = ["cpu_sets", "kv_transfer_config", "rank_binds"]


def cpu_sets(cpus: Sequence[int], instances: int, *, dedicated: int = 0) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance: disjoint contiguous groups of cores when
    there are enough, otherwise one core each, round robin (instances then share cores).

    With too few cores, the first ``dedicated`` instances (the prefills) still get a core of
    their own when that leaves at least one for the rest: while a prefill holds blocks for a
    decode, vLLM keeps stepping it in a busy loop, and a decode pinned to the same core was
    seen to make no progress until the prefill's hold timed out.
    """
    if instances <= 0:
        return []
    per = len(cpus) // instances
    if per == 0:
        if 0 < dedicated < len(cpus):
            rest = list(cpus[dedicated:])
            own = [str(c) for c in cpus[:dedicated]]
            return own + [str(rest[i % len(rest)]) for i in range(instances - dedicated)]
        return [str(cpus[i % len(cpus)]) for i in range(instances)]
    out = []
    for i in range(instances):
        group = cpus[i * per : (i + 1) * per]
        contiguous = list(group) == list(range(group[0], group[0] + len(group)))
        if len(group) == 1:
            out.append(str(group[0]))
        elif contiguous:
            out.append(f"{group[0]}-{group[-1]}")
        else:
            out.append(",".join(str(c) for c in group))
    return out


def rank_binds(cpus: Sequence[int], ranks: Sequence[int], *, dedicated: int = 0) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance when instance ``i`` runs ``ranks[i]``
    worker ranks (dp_size x tp_size): vLLM-CPU takes one core list per rank, joined by
    ``|`` in [DP, TP] order.  Cores are dealt out per rank as :func:`cpu_sets` deals them
    per instance, so with 2 cores a TP 2 prefill gets ``0|1`` and a TP 1 decode ``0``.
    ``dedicated`` counts instances (the prefills), as in :func:`cpu_sets`.
    """
    per_rank = cpu_sets(cpus, sum(ranks), dedicated=sum(ranks[:dedicated]))
    out, at = [], 0
    for n in ranks:
        out.append("|".join(per_rank[at : at + n]))
        at += n
    return out


def kv_transfer_config(
    role: str,
    kv_port: int,
    host: str,
    prefill: Topology | None = None,
    decode: Topology | None = None,
) -> dict[str, Any]:
    """The production guide's §5.2 (``prefill``) / §5.3 (``decode``) ``--kv-transfer-config`` with
    kvpool's classes.  As in the guide both sides carry both layouts; the one the connector
    reads is the PEER's (``"decode"`` on P, ``"prefill"`` on D: the guide's §5.4)."""
    prefill, decode = prefill or Topology(), decode or Topology()
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    transfer, store = "KVPoolTransferConnector", "KVPoolStoreConnector"
    store_extra: dict[str, Any] = {"lookup_rpc_port": "0", "backend": "mooncake"}
    if role == "decode":
        store_extra["load_async"] = True
    return {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": transfer,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[transfer][1],
                    "kv_role": kv_role,
                    "kv_port": str(kv_port),
                    "kv_connector_extra_config": {
                        "prefill": {"dp_size": prefill.dp_size, "tp_size": prefill.tp_size},
                        "decode": {"dp_size": decode.dp_size, "tp_size": decode.tp_size},
                        "kv_host": host,
                    },
                },
                {
                    "kv_connector": store,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[store][1],
                    "kv_role": kv_role,
                    "kv_connector_extra_config": store_extra,
                },
            ]
        },
    }

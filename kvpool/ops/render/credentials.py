"""The credentials ``kvpool config render`` writes (docs/security.md): one cluster secret for
the master and each P/D host, and for a storage host only its own node key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.security.credentials import Credential
from kvpool.security.secret import is_loopback

if TYPE_CHECKING:
    from kvpool.ops.render.inventory import Host, Inventory

__all__ = [
    "CLUSTER_SECRET",
    "NODE_CREDENTIAL",
    "PROXY_KEY",
    "SECRET_NAMES",
    "env_lines",
    "host_secret_path",
    "master_flags",
    "proxy_key_flags",
    "readme",
    "secret_files",
    "write_private",
]

CLUSTER_SECRET = "secret"
NODE_CREDENTIAL = "node.cred"
PROXY_KEY = "proxy.key"  # the API key clients of `kvpool proxy` send (OpenAI's Bearer)
#: file names written with mode 600
# Files named here are created with mode 600 (never readable by others, not even for a
# moment) and never printed.  The secret is an input: a re-render passes the one already
# written (kvpool.ops.render.run reads it back), so re-rendering does not break a running
# cluster; only --new-secret replaces it.  `insecure = true` renders no secret and
# --insecure on the master and the nodes (open to every host that reaches it; doctor
# warns).
SECRET_NAMES = frozenset({CLUSTER_SECRET, NODE_CREDENTIAL, PROXY_KEY})


def _on_host(inv: Inventory, name: str) -> str:
    return f"{inv.config_dir.rstrip('/')}/{name}"


def host_secret_path(inv: Inventory, host: Host) -> str:
    """Where a host's credential lives on it: the cluster secret on a P/D host (its vLLM
    is a client), the node's own key on a storage host."""
    return _on_host(inv, CLUSTER_SECRET if host.runs_vllm else NODE_CREDENTIAL)


def secret_files(inv: Inventory, secret: str | None) -> dict[str, str]:
    """The credential files: the cluster secret for the master and every P/D host, one
    node key per storage host.  ``secret`` None: a fresh 256-bit secret."""
    text = secret.strip() if secret is not None else secrets.token_hex(32)
    cluster = Credential.parse(text, CLUSTER_SECRET)  # a given secret must be a good one
    files = {CLUSTER_SECRET: text + "\n"}
    for host in inv.hosts:
        if host.runs_vllm:
            files[f"{host.name}/{CLUSTER_SECRET}"] = text + "\n"
        else:
            files[f"{host.name}/{NODE_CREDENTIAL}"] = cluster.node_credential(host.node_id) + "\n"
    return files


def master_flags(inv: Inventory) -> list[str]:
    if inv.credentials:
        return ["--secret_file", _on_host(inv, CLUSTER_SECRET)]
    return ["--insecure"] if inv.open_beyond_loopback else []


def proxy_key_flags(inv: Inventory) -> list[str]:
    """The proxy's key: a proxy that other hosts reach refuses to start without one (or
    ``--insecure``), so render gives it ``proxy.key`` beside its ``proxy.sh``."""
    if inv.open_beyond_loopback:
        return ["--insecure"]
    reachable = any(not is_loopback(h.address) for h in inv.hosts)
    return ["--api-key-file", _on_host(inv, PROXY_KEY)] if reachable else []


def env_lines(inv: Inventory, host: Host) -> str:
    """env.sh's credential: the cluster secret for a P/D host's vLLM and tools (``kvpool
    status``, ``kvpool doctor``); none on a storage host (its node config names its key)."""
    if not inv.credentials:
        return ""
    if not host.runs_vllm:
        node = _on_host(inv, NODE_CREDENTIAL)
        return (
            f"# copy {host.name}/{NODE_CREDENTIAL} to {node} (mode 600): node"
            f" {host.node_id}'s own key, named by mooncake.json\n"
        )
    path = _on_host(inv, CLUSTER_SECRET)
    return (
        f"# copy {host.name}/{CLUSTER_SECRET} to {path} (mode 600): the cluster secret\n"
        f"export KVPOOL_SECRET_FILE={path}\n"
    )


def write_private(target: Path, text: str) -> None:
    """Write a credential file readable by its owner only, from its creation on."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode through O_CREAT
        f.write(text)


def readme(inv: Inventory) -> str:
    """What to copy where, and how the pool is protected (or that it is not)."""
    lines = [
        "# Rendered by kvpool config render",
        "",
        f"Run master.sh on {inv.role('prefill')[0].name} ({inv.master.address}). Copy each"
        f" host's folder to {inv.config_dir} on that host, then run its node.sh and serve.sh.",
        "",
        "## Security",
        "",
    ]
    if inv.engine == "mooncake":
        lines += [
            "The pool is OPEN: Mooncake has no credentials of its own. Any host that reaches",
            f"mooncake_master ({inv.master.port}, metrics {inv.metrics_port}) or a vLLM"
            " process's Transfer Engine ports can read, overwrite and remove every object.",
            "Network isolation is the only protection: keep every host on a private network",
            "(a VLAN, or a firewall admitting only these hosts). `kvpool doctor` warns of it.",
        ]
    elif inv.credentials:
        lines += [
            f"The pool runs on a cluster secret, `{CLUSTER_SECRET}` (mode 600; never commit",
            "it or paste it anywhere). The master and every P/D host hold it (a vLLM is a",
            "client of the pool, and only the cluster secret can be one); a storage host",
            f"holds only its own node key, `{NODE_CREDENTIAL}`. Keep the modes when copying",
            "(`scp -p`, or `chmod 600`).",
            "",
            "A re-render keeps this secret; `kvpool config render --new-secret` makes a new",
            "one, which is a rotation: every process restarts (docs/security.md). Check a",
            "host with `. ./env.sh && kvpool doctor --master-cmd master.sh`.",
        ]
    elif inv.open_beyond_loopback:
        lines += [
            "The pool is OPEN (`insecure = true`): master and nodes run with --insecure, and",
            "any host that reaches their ports can read, overwrite and remove every object.",
            "Keep them on a private network, or remove `insecure` and re-render for a secret.",
        ]
    else:
        lines += ["Every host is loopback: the pool is reachable from this machine only."]
    return "\n".join(lines) + "\n"

"""``kvpool config render``: per-node files from one inventory, as the guide's §4 Ansible
template does, with the peer topologies filled in.  :func:`render` is pure (inventory in,
file texts out); :func:`run` reads and writes.  The reference: docs/configuration.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvpool.config import load_node_config
from kvpool.config.values import SIZE_CONVENTION
from kvpool.errors import ConfigError
from kvpool.ops.doctor.checks_connector import model_info
from kvpool.ops.render.credentials import CLUSTER_SECRET, PROXY_KEY
from kvpool.ops.render.files import render, write_rendered
from kvpool.ops.render.inventory import (
    ENGINES,
    Host,
    Inventory,
    load_inventory,
    parse_inventory,
)
from kvpool.security.secret import read_secret_file

__all__ = [
    "ENGINES",
    "CheckOptions",
    "Host",
    "Inventory",
    "RenderOptions",
    "load_inventory",
    "parse_inventory",
    "render",
    "run",
    "run_check",
    "write_rendered",
]


def _check_model(inv: Inventory) -> None:
    """consumer_is_to_put needs an MLA model; check when the model is readable here."""
    if not inv.consumer_is_to_put:
        return
    config = Path(inv.model) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return  # the model lives on the nodes: doctor --model checks it there
    info = model_info(data)
    if not info.is_mla:
        raise ConfigError(
            f"consumer_is_to_put: {inv.model} is not an MLA model ({info.reason}); remove it"
        )


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """``kvpool config render INVENTORY --out DIR``."""

    inventory: str
    out: str
    engine: str | None = None  # None: the inventory's engine, else kvpool
    new_secret: bool = False  # replace a secret already in ``out`` (a rotation)


def _kept_secret(options: RenderOptions) -> str | None:
    """The cluster secret an earlier render wrote to ``out``: a re-render keeps it, so the
    running cluster keeps working.  None: none there, or ``--new-secret``."""
    path = Path(options.out) / CLUSTER_SECRET
    if options.new_secret or not path.exists():
        return None
    credential = read_secret_file(str(path), CLUSTER_SECRET)
    if not credential.is_cluster:
        raise ConfigError(
            f"{path}: holds a node credential, not a cluster secret; remove it, or pass"
            " --new-secret to write a new one"
        )
    return credential.secret.decode()


def _kept_proxy_key(options: RenderOptions) -> str | None:
    """The proxy key an earlier render wrote: kept as the secret is (clients hold it)."""
    path = Path(options.out) / PROXY_KEY
    if options.new_secret or not path.exists():
        return None
    return path.read_text(encoding="utf-8").strip() or None


def run(options: RenderOptions) -> int:
    """``kvpool config render``: write every host's files, print what was written (never
    a secret).  A bad inventory is a ConfigError naming the key (nothing is written)."""
    inv = parse_inventory(load_inventory(options.inventory), engine=options.engine)
    _check_model(inv)
    kept = _kept_secret(options) if inv.credentials else None
    written = write_rendered(render(inv, kept, _kept_proxy_key(options)), options.out)
    for path in written:
        print(path)
    print(f"master: {inv.master.address} (run master.sh on {inv.role('prefill')[0].name})")
    print(f"sizes: {SIZE_CONVENTION}")
    if inv.protocol != "tcp":
        print(
            f"protocol {inv.protocol} ({inv.device_name}): each host's node config is checked"
            " for the NIC where it runs; run `kvpool doctor` on every host"
        )
    if inv.credentials:
        how = "kept from the last render" if kept else "new"
        print(
            f"cluster secret ({how}): {Path(options.out) / CLUSTER_SECRET}, mode 600; copy it"
            " only to the master and P/D hosts (storage hosts get their node.cred)"
        )
    elif inv.open_beyond_loopback:
        print("insecure = true: the pool is open to every host that reaches it")
    if inv.engine == "mooncake":
        print(
            "engine mooncake: no credentials (Mooncake has none), and mooncake_master and every"
            " vLLM process's Transfer Engine listen on every interface; keep the hosts on a"
            " private network"
        )
    return 0


@dataclass(frozen=True, slots=True)
class CheckOptions:
    """``kvpool config check [PATH]``: None reads KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH."""

    path: str | None = None


def run_check(options: CheckOptions) -> int:
    """``kvpool config check``: validate a node config and print it resolved (a bad one is
    a ConfigError naming the key)."""
    node = load_node_config(options.path)
    for name in node.__dataclass_fields__:
        print(f"{name} = {getattr(node, name)!r}")
    return 0

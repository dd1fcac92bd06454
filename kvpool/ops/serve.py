"""The long-running commands: ``kvpool master``, ``kvpool node`` and ``kvpool proxy``.

Each hands its validated config over to the service that owns the event loop; what stays
here is logging and reading the node's config file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.config import MasterConfig
    from kvpool.proxy import ProxyConfig

__all__ = ["NodeOptions", "run_master", "run_node", "run_proxy"]

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _configure_logging(level: str | None) -> None:
    """Logging at ``--log_level``; an unknown level is a ConfigError naming the flag
    (before anything is allocated), never a ValueError from :mod:`logging`."""
    name = (level or "info").lower()
    if name not in _LOG_LEVELS:
        raise ConfigError(f"--log_level: unknown level {level!r}; use " + ", ".join(_LOG_LEVELS))
    logging.basicConfig(level=name.upper(), format=_LOG_FORMAT)


# Start-up errors (a busy port, a small /dev/shm, an unusable SSD path, an unknown
# log level) are ConfigErrors naming the flag and its fix, raised before anything is
# allocated; ``kvpool.cli`` prints them as one line and exits 2.
#
# The services are imported when a command runs, so ``kvpool --help`` and
# ``kvpool doctor`` stay light.
def run_master(config: MasterConfig, *, log_level: str | None = None) -> int:
    """``kvpool master``: serve the pool's metadata (and its own segment) until a signal."""
    from kvpool.master.server import run_master as serve_master

    _configure_logging(log_level)
    return serve_master(config)


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """``kvpool node``: ``config`` None reads KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH."""

    config: str | None = None
    data_port: int = 0  # 0: any free port
    bind: str = ""  # "": the config's local_hostname
    log_level: str | None = None
    insecure: bool = False  # serve beyond loopback without a credential


def run_node(options: NodeOptions) -> int:
    """``kvpool node``: contribute this host's memory to the pool until a signal.  A bad
    node config is a ConfigError naming the key."""
    from kvpool.config import load_node_config
    from kvpool.errors import ConfigError
    from kvpool.mooncake.master import mooncake_at
    from kvpool.node.node import run_node as serve_node

    _configure_logging(options.log_level)
    config = load_node_config(options.config)
    # the other engine's master would be retried forever: say what answers, once
    mooncake = mooncake_at(config.master_address)
    if mooncake is not None:
        raise ConfigError(f"metadata_server: {mooncake}")
    return serve_node(
        config, bind_host=options.bind, data_port=options.data_port, insecure=options.insecure
    )


def run_proxy(config: ProxyConfig) -> int:
    """``kvpool proxy``: route each request to a prefill, then a decode, until a signal."""
    from kvpool.proxy import run_proxy as serve_proxy

    return serve_proxy(config)

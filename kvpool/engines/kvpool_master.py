"""The ``kvpool`` engine: kvpool's own master and storage nodes, through :class:`kvpool.Client`.

Every process opens its own client: metadata goes to the master, bytes straight to the
node that owns the segment.  Its credential is the node config's ``"secret_file"``, else
the environment's, else none (docs/security.md).
"""

from __future__ import annotations

import os

from kvpool.engines.kvpool_client import ClientEngine
from kvpool.errors import ConfigError

__all__ = ["MasterEngine", "open_master_engine"]


def _node_config_secret_file() -> str:
    """The node config's ``secret_file``, when the environment names an existing config."""
    from kvpool.config.node import config_path_from_env, read_node_json

    found = config_path_from_env(os.environ)
    if found is None or not found[1].is_file():
        return ""
    data, _ = read_node_json(found[1])
    value = data.get("secret_file", "") if isinstance(data, dict) else ""
    return value.strip() if isinstance(value, str) else ""


class MasterEngine(ClientEngine):
    """kvpool's master as a :class:`~kvpool.engines.base.PoolEngine`."""

    engine = "kvpool"

    @classmethod
    def connect(cls, master: str, *, timeout_s: float, replica_num: int = 0) -> MasterEngine:
        """An engine for the master at ``host:port``; connects on first use, and every
        call waits at most ``timeout_s``; each put in ``replica_num`` copies (0: the
        master's ``--replica_num``)."""
        from kvpool.client.client import Client
        from kvpool.security.secret import read_secret_file

        path = _node_config_secret_file()
        credential = read_secret_file(path, "secret_file") if path else None
        client = Client(master, timeout_s=timeout_s, credential=credential, replica_num=replica_num)
        return cls(client)


def open_master_engine(
    *, master: str, timeout_s: float, replica_num: int = 0, **_: object
) -> MasterEngine:
    """:func:`kvpool.engines.open_engine`'s ``"kvpool"``: a client of the master at
    ``master`` (host:port), each call waiting at most ``timeout_s``."""
    if not master:
        raise ConfigError('engine "kvpool" needs the master\'s address (host:port)')
    return MasterEngine.connect(master, timeout_s=timeout_s, replica_num=replica_num)

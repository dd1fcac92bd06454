"""Whether a master address is a real Mooncake master: its RPC port answers coro_rpc.

:func:`foreign_master` is the client's probe (``client.master_link.FOREIGN_MASTERS``).
"""

from __future__ import annotations

import socket
import struct

from kvpool.errors import ConfigError
from kvpool.net import split_address

__all__ = ["foreign_master", "mooncake_answers", "wrong_engine"]

# coro_rpc (yalantinglibs, what mooncake_master serves on --rpc_port): a request header is
# magic 21, version, serialize type, message type, then seq, function id, body length and
# attachment length (u32 little-endian); a reply header starts with the same magic.
_CORO_MAGIC = 21
_CORO_PROBE = struct.pack("<BBBBIIII", _CORO_MAGIC, 0, 0, 0, 1, 0xDEADBEEF, 0, 0)
_CORO_REPLY_HEADER = 16


# A real mooncake_master's RPC port speaks coro_rpc: it closes a kvpool frame without a
# byte.  The probe is a call of a function no server registers: any coro_rpc server
# answers it with its own header, whatever its metrics port.
def mooncake_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether ``address`` answers in coro_rpc, as a Mooncake master's RPC port does (it
    replies "the rpc function not registered" to the probe).  One bounded exchange."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_CORO_PROBE)
            head = b""
            while len(head) < _CORO_REPLY_HEADER:
                chunk = sock.recv(_CORO_REPLY_HEADER - len(head))
                if not chunk:
                    break
                head += chunk
    except OSError:  # timeouts included: nothing that answers coro_rpc
        return False
    return len(head) == _CORO_REPLY_HEADER and head[0] == _CORO_MAGIC


def wrong_engine(address: str) -> ConfigError:
    """The error of a kvpool client whose master address is a Mooncake master."""
    return ConfigError(
        f"{address} is a Mooncake master (mooncake_master's RPC port: it answers Mooncake's"
        " coro_rpc, not kvpool's protocol); point kvpool at a kvpool master (`kvpool master`),"
        " or use backend mooncake with a Mooncake mooncake.json"
        f' ("master_server_address": "{address}", "metadata_server": "P2PHANDSHAKE";'
        " docs/mooncake.md)"
    )


def foreign_master(address: str, timeout_s: float) -> ConfigError | None:
    """The client's probe (:data:`kvpool.client.master_link.FOREIGN_MASTERS`): the error
    naming a Mooncake master at ``address``, or None when none answers there."""
    return wrong_engine(address) if mooncake_answers(address, timeout_s) else None

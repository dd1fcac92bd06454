"""The blocking socket steps of the handshake while a secret is rotated (what a node's
data port, the master link and the prefill's ``kv_port`` pull server run)."""

from __future__ import annotations

import socket
import threading

import pytest

from kvpool.errors import AuthError, KVPoolError
from kvpool.security.credentials import Credential
from kvpool.security.handshake import Identity
from kvpool.security.socket_auth import admit, authenticate
from tests.security.test_handshake_rotation import NEW, OLD, OTHER


def cred(*lines: str) -> Credential:
    return Credential.parse("\n".join(lines), "k")


def handshake(client: Credential, server: Credential) -> tuple[object, object]:
    """``(what the client got, what the server got)``: a server id or an Identity, else
    the error each side raised."""
    a, b = socket.socketpair()
    got: dict[str, object] = {}

    def serve() -> None:
        try:
            got["server"] = admit(b, server, "node-a", ("data",), 10.0, b"plain")
        except KVPoolError as exc:
            got["server"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        got["client"] = authenticate(a, client, "data", "client-1", 10.0, "node-a's data port")
    except KVPoolError as exc:
        got["client"] = exc
    thread.join(timeout=15)
    assert not thread.is_alive()
    a.close()
    b.close()
    return got["client"], got["server"]


@pytest.mark.parametrize(
    ("client", "server"), [((OLD,), (NEW, OLD)), ((NEW, OLD), (OLD,)), ((NEW, OLD), (NEW,))]
)
def test_either_side_holding_both_secrets_meets_the_other(
    client: tuple[str, ...], server: tuple[str, ...]
) -> None:
    assert handshake(cred(*client), cred(*server)) == ("node-a", Identity("data", "client-1"))


def test_neither_secret_shared_is_a_refusal_on_both_sides() -> None:
    client_got, server_got = handshake(cred(OTHER), cred(NEW, OLD))
    assert isinstance(client_got, AuthError) and "different secrets" in str(client_got)
    assert isinstance(server_got, KVPoolError)

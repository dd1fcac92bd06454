"""The handshake while a secret is rotated: a side holding the new secret and the previous
one meets a peer holding either, in one round trip; a peer holding neither is refused."""

from __future__ import annotations

import pytest

from kvpool.errors import AuthError
from kvpool.security.credentials import Credential
from kvpool.security.handshake import ClientHandshake, Identity, ServerHandshake
from tests.security.test_handshake import frame

OLD = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"
NEW = "7d2a9c4e6b1f3a5c8e0d2b4f6a8c1e3d5b7f9a0c2e4b6d8f1a3c5e7b9d0f2a4c"
OTHER = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"
MASTER = ("client", "node")


def cred(*lines: str) -> Credential:
    return Credential.parse("\n".join(lines) + "\n", "k")


def run(client: Credential, server: Credential, role: str = "client",
        server_id: str = "master") -> tuple[Identity | None, bytes]:  # fmt: skip
    c = ClientHandshake(client, role, "client-1")
    s = ServerHandshake(server, server_id, (role,))
    challenge = s.on_hello(frame(c.hello()))
    proof = c.on_challenge(frame(challenge))
    verdict, identity = s.on_proof(frame(proof))
    c.on_verdict(frame(verdict))
    return identity, proof


@pytest.mark.parametrize(
    ("client", "server"),
    [
        ((NEW, OLD), (OLD,)),  # a switched client, a server not yet switched
        ((OLD,), (NEW, OLD)),  # a switched server, a client not yet switched
        ((NEW, OLD), (NEW, OLD)),
        ((NEW,), (NEW, OLD)),  # after: the old line dropped on one side first
        ((NEW, OLD), (NEW,)),
    ],
)
def test_every_step_of_a_rolling_rotation_admits_the_peer(
    client: tuple[str, ...], server: tuple[str, ...]
) -> None:
    for role, server_id in (("client", "master"), ("node", "master"), ("data", "node-a")):
        identity, _ = run(cred(*client), cred(*server), role, server_id)
        assert identity == Identity(role, "client-1")


def test_the_client_proves_the_new_secret_when_both_sides_hold_it() -> None:
    # the proof made with both secrets on both sides is the one a new-only server accepts
    c = ClientHandshake(cred(NEW, OLD), "client", "client-1")
    s = ServerHandshake(cred(NEW, OLD), "master", MASTER)
    proof = c.on_challenge(frame(s.on_hello(frame(c.hello()))))
    new_only = ServerHandshake(cred(NEW), "master", MASTER, nonce=s.nonce)
    new_only.on_hello(frame(c.hello()))
    verdict, identity = new_only.on_proof(frame(proof))
    assert identity == Identity("client", "client-1"), verdict


def test_a_peer_with_neither_secret_is_refused_both_ways() -> None:
    with pytest.raises(AuthError, match="did not prove the cluster secret"):
        run(cred(OTHER), cred(NEW, OLD))
    with pytest.raises(AuthError, match="did not prove the cluster secret"):
        run(cred(NEW, OLD), cred(OTHER))
    with pytest.raises(AuthError, match="did not prove"):
        run(cred(OLD), cred(NEW))  # after the rotation, the old secret alone is refused


def test_a_server_refuses_a_client_proof_under_a_secret_it_does_not_hold() -> None:
    # a proof of the right transcript under a third secret: the server holding the new
    # and the previous secret checks it against both and refuses it
    c = ClientHandshake(cred(OTHER), "client", "client-1")
    s = ServerHandshake(cred(NEW, OLD), "master", MASTER)
    s.on_hello(frame(c.hello()))
    impostor = ServerHandshake(cred(OTHER), "master", MASTER, nonce=s.nonce)
    forged = c.on_challenge(frame(impostor.on_hello(frame(c.hello()))))
    verdict, identity = s.on_proof(frame(forged))
    assert identity is None and s.failure is not None
    assert b"wrong credential" in verdict


def test_one_secret_gives_the_challenge_of_before_rotation() -> None:
    s = ServerHandshake(cred(NEW), "master", MASTER)
    _, body = frame(s.on_hello(frame(ClientHandshake(cred(NEW), "client", "c").hello())))
    assert len(body) == 32 + 32 + len("master") and b"\0" not in body[64:]
    two = ServerHandshake(cred(NEW, OLD), "master", MASTER)
    _, body = frame(two.on_hello(frame(ClientHandshake(cred(NEW), "client", "c").hello())))
    assert len(body) == 32 + 32 + len("master") + 1 + 32


def test_node_credentials_rotate_as_the_cluster_secret() -> None:
    old_node = Credential.parse(OLD, "k").node_credential("node-a")
    new_node = Credential.parse(NEW, "k").node_credential("node-a")
    for node, master in (((new_node, old_node), (OLD,)), ((old_node,), (NEW, OLD))):
        c = ClientHandshake(cred(*node), "node", "node-a")
        s = ServerHandshake(cred(*master), "master", MASTER)
        proof = c.on_challenge(frame(s.on_hello(frame(c.hello()))))
        verdict, identity = s.on_proof(frame(proof))
        c.on_verdict(frame(verdict))
        assert identity == Identity("node", "node-a")

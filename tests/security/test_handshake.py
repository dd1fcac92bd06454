"""The handshake's message logic, without sockets: both sides prove the key, and every
proof is bound to its role, its ids and its connection's nonces."""

from __future__ import annotations

import pytest

from kvpool.errors import AuthError, ProtocolError
from kvpool.security.credentials import Credential
from kvpool.security.handshake import (
    AUTH_MAGIC,
    ClientHandshake,
    FrameReader,
    Identity,
    ServerHandshake,
)

SECRET = Credential.parse("3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e", "k")
WRONG = Credential.parse("9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b", "k")
MASTER = ("client", "node")


def frame(data: bytes) -> tuple[int, bytes]:
    reader = FrameReader()
    reader.feed(data)
    got = reader.next_frame()
    assert got is not None and reader.rest() == b""
    return got


def run(client: ClientHandshake, server: ServerHandshake) -> tuple[Identity | None, bytes]:
    challenge = server.on_hello(frame(client.hello()))
    proof = client.on_challenge(frame(challenge))
    verdict, identity = server.on_proof(frame(proof))
    client.on_verdict(frame(verdict))
    return identity, proof


def test_the_same_secret_on_both_sides_admits_the_peer_as_what_it_claims() -> None:
    identity, _ = run(
        ClientHandshake(SECRET, "client", "client-1"), ServerHandshake(SECRET, "master", MASTER)
    )
    assert identity == Identity("client", "client-1")


def test_a_node_credential_proves_its_own_node_to_a_master_with_the_secret() -> None:
    node = Credential.parse(SECRET.node_credential("node-a"), "k")
    identity, _ = run(
        ClientHandshake(node, "node", "node-a"), ServerHandshake(SECRET, "master", MASTER)
    )
    assert identity == Identity("node", "node-a")
    # and a client of node-a's data port proves node-a's key to the node holding it
    identity, _ = run(
        ClientHandshake(SECRET, "data", "client-1"), ServerHandshake(node, "node-a", ("data",))
    )
    assert identity == Identity("data", "client-1")


def test_a_client_with_another_secret_finds_out_before_it_proves_anything() -> None:
    client = ClientHandshake(WRONG, "client", "client-1")
    challenge = ServerHandshake(SECRET, "master", MASTER).on_hello(frame(client.hello()))
    with pytest.raises(AuthError, match="did not prove the cluster secret"):
        client.on_challenge(frame(challenge))


def test_a_proof_made_without_the_secret_is_refused_with_a_reason() -> None:
    server = ServerHandshake(SECRET, "master", MASTER)
    client = ClientHandshake(SECRET, "client", "client-1")
    client.on_challenge(frame(server.on_hello(frame(client.hello()))))
    forged = b"KVPA\x03\x00\x20" + bytes(32)  # a peer without the key can only guess
    verdict, identity = server.on_proof(frame(forged))
    assert identity is None and isinstance(server.failure, AuthError)
    with pytest.raises(AuthError, match="wrong credential for client 'client-1'"):
        client.on_verdict(frame(verdict))


def test_a_proof_is_bound_to_its_connection_and_its_claimed_id() -> None:
    first = ClientHandshake(SECRET, "node", "node-a")
    _, recorded = run(first, ServerHandshake(SECRET, "master", MASTER))
    # replayed on a new connection: the server's nonce is new, so the proof is stale
    server = ServerHandshake(SECRET, "master", MASTER)
    server.on_hello(frame(ClientHandshake(SECRET, "node", "node-a", nonce=first.nonce).hello()))
    _, identity = server.on_proof(frame(recorded))
    assert identity is None
    # node-a's key proves nothing for node-b
    node_a = Credential.parse(SECRET.node_credential("node-a"), "k")
    client = ClientHandshake(node_a, "node", "node-b")
    challenge = ServerHandshake(SECRET, "master", MASTER).on_hello(frame(client.hello()))
    with pytest.raises(AuthError, match="cannot act for node-b"):
        client.on_challenge(frame(challenge))
    # and a proof for node-a, presented as node-b, does not pass
    honest = ClientHandshake(node_a, "node", "node-a")
    server = ServerHandshake(SECRET, "master", MASTER)
    claim = ClientHandshake(SECRET, "node", "node-b", nonce=honest.nonce)
    challenge = server.on_hello(frame(claim.hello()))
    ns_proof = frame(challenge)
    own = ServerHandshake(SECRET, "master", MASTER, nonce=ns_proof[1][:32])
    node_a_proof = honest.on_challenge(frame(own.on_hello(frame(honest.hello()))))
    _, identity = server.on_proof(frame(node_a_proof))
    assert identity is None


def test_a_port_refuses_roles_it_does_not_serve() -> None:
    server = ServerHandshake(SECRET, "node-a", ("data",))
    reply = server.on_hello(frame(ClientHandshake(SECRET, "client", "c").hello()))
    assert isinstance(server.failure, AuthError)
    with pytest.raises(AuthError, match="serves data, not client"):
        ClientHandshake(SECRET, "client", "c").on_challenge(frame(reply))


def test_frames_are_cut_from_any_split_and_bad_ones_refused() -> None:
    data = ClientHandshake(SECRET, "client", "client-1").hello() + b"KVP1rest"
    reader = FrameReader()
    for i in range(len(data) - 8):
        reader.feed(data[i : i + 1])
        if i < len(data) - 9:
            assert reader.next_frame() is None
    assert reader.next_frame() is not None
    reader.feed(b"KVP1rest")
    assert reader.rest() == b"KVP1rest"
    for bad in (b"KVP1\x01\x00\x00", AUTH_MAGIC + b"\x01\xff\xff"):
        reader = FrameReader()
        reader.feed(bad)
        with pytest.raises(ProtocolError):
            reader.next_frame()

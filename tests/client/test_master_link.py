"""The client's connect path told what answered when it is not a kvpool master.

Fake peers on loopback stand in for the two ways a port can fail a kvpool frame: one
speaks coro_rpc (as mooncake_master's RPC port: it closes a kvpool frame, answers its own
protocol), one closes everything.  The real mooncake_master is in
test_master_link_mooncake.py.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvpool.client.client import Client
from kvpool.errors import ConfigError, TransferError
from kvpool.mooncake.sniff import mooncake_answers
from kvpool.testing.processes import PoolProcess

# what a real mooncake_master (0.3.13.post1) answered to the probe, recorded here
CORO_REPLY = (
    b"\x15\x00\x0b\x00\x01\x00\x00\x00(\x00\x00\x00\x00\x00\x00\x00"
    b"w\xfa\xcf\x9d\x04\x80\x0c\x00\x1fthe rpc function not registered"
)


class FakePeer:
    """Accepts connections until closed; ``coro_rpc`` answers a coro_rpc header the way
    Mooncake's RPC port does, and every other first byte gets the connection closed."""

    def __init__(self, *, coro_rpc: bool) -> None:
        self.coro_rpc = coro_rpc
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                first = conn.recv(64)
                if self.coro_rpc and first[:1] == b"\x15":
                    conn.sendall(CORO_REPLY)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a bare close does not)
        self.sock.close()
        self._thread.join(5)


@pytest.fixture(params=[True, False], ids=["coro_rpc", "closes"])
def peer(request: pytest.FixtureRequest) -> Iterator[FakePeer]:
    p = FakePeer(coro_rpc=request.param)
    yield p
    p.close()


def test_the_probe_tells_coro_rpc_from_a_peer_that_closes(peer: FakePeer) -> None:
    assert mooncake_answers(peer.address) is peer.coro_rpc


def test_the_probe_is_false_where_nothing_listens() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert mooncake_answers(address, 1.0) is False


def test_a_client_names_the_mooncake_master_and_no_other(peer: FakePeer) -> None:
    client = Client(peer.address, timeout_s=5)
    try:
        if peer.coro_rpc:
            with pytest.raises(ConfigError, match="is a Mooncake master") as info:
                client.exists("k")
            assert peer.address in str(info.value) and "docs/mooncake.md" in str(info.value)
        else:  # a peer that closes is just that, whatever it is
            with pytest.raises(TransferError, match="0 of 12 bytes"):
                client.exists("k")
    finally:
        client.close()


def test_a_kvpool_master_is_never_taken_for_mooncake(master: PoolProcess) -> None:
    assert mooncake_answers(master.address) is False  # it answers in kvpool's frames
    with Client(master.address, timeout_s=5) as client:  # and is served as before
        assert client.exists("k") is False

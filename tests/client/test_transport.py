"""The client's two seams: the transport its bytes take, and its link to the master."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from kvpool.client.client import Client
from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp, SsdReadOp
from kvpool.datapath.in_process import InProcessTransport
from kvpool.datapath.transport import (
    DataPath,
    SharedMemoryTransport,
    TcpTransport,
    transport_named,
)
from kvpool.embedded import EmbeddedPool, InProcessMaster
from kvpool.errors import ConfigError, TransferError
from kvpool.security.peer import PeerSettings
from kvpool.testing.processes import PoolProcess


def _kind(op: DataOp) -> str:
    if isinstance(op, SsdReadOp):
        return "ssd read"
    return "read" if isinstance(op, ReadOp) else "write"


class Recording:
    """A data path that records what the client asks of it, and can be told to fail."""

    def __init__(self, inner: DataPath) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.fail_writes = False

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        kinds = {_kind(op) for op in ops}
        self.calls.append(" ".join(sorted(kinds)) + (f" x{len(ops)}" if len(ops) > 1 else ""))
        if self.fail_writes and "write" in kinds:
            raise TransferError("the wire broke")
        return self.inner.run(ops)

    def close(self) -> None:
        self.calls.append("close")
        self.inner.close()


class RecordingTransport:
    name = "recording"

    def __init__(self, inner: TcpTransport) -> None:
        self.inner = inner
        self.paths: list[Recording] = []

    def connect(self, address: str) -> Recording:
        path = Recording(self.inner.connect(address))
        self.paths.append(path)
        return path


def test_transports_are_chosen_by_name_or_by_allow_shm() -> None:
    assert isinstance(Client(transport="tcp").transport, TcpTransport)
    assert not isinstance(Client(transport="tcp").transport, SharedMemoryTransport)
    assert isinstance(Client().transport, SharedMemoryTransport)
    assert Client(allow_shm=False).transport.name == "tcp"
    assert transport_named("shm", PeerSettings(3.0)).peer.timeout_s == 3.0
    with pytest.raises(ConfigError, match="'rdma' is not one of shm, tcp"):
        Client(transport="rdma")


def test_a_tcp_only_client_never_maps_a_segment(master: PoolProcess) -> None:
    with Client(master.address, transport="tcp", timeout_s=5) as c:
        c.put("k", b"x" * 4096)
        assert c.get("k") == b"x" * 4096
        (path,) = c._paths.values()
        assert set(path._routes.values()) == {"tcp"}  # type: ignore[attr-defined]


def test_every_byte_goes_through_the_clients_transport(master: PoolProcess) -> None:
    transport = RecordingTransport(TcpTransport(PeerSettings(5.0)))
    with Client(master.address, transport=transport, timeout_s=5) as c:
        c.put("one", b"1" * 1000)
        assert c.get("one") == b"1" * 1000
        assert c.batch_put(["a", "b"], [b"a" * 10, b"b" * 20]) == [None, None]
        assert c.batch_get_into(["a", "b"], [bytearray(10), bytearray(20)]) == [10, 20]
        (path,) = transport.paths  # one data path per storage owner, kept open
    # one call per transfer, and one per owner for a batch
    assert path.calls == ["write", "read", "write x2", "read x2", "close"]


def test_a_failed_transfer_reopens_the_path_and_frees_the_reservation(
    master: PoolProcess,
) -> None:
    transport = RecordingTransport(TcpTransport(PeerSettings(5.0)))
    with Client(master.address, transport=transport, timeout_s=5) as c:
        c.put("warm", b"x")
        transport.paths[0].fail_writes = True
        with pytest.raises(TransferError):
            c.put("k", b"first")
        assert transport.paths[0].calls[-1] == "close"  # dropped after the failure
        c.put("k", b"second")  # a fresh path; the failed put's reservation was revoked
        assert len(transport.paths) == 2 and c.get("k") == b"second"


def test_the_embedded_pool_is_a_client_with_in_process_seams() -> None:
    with EmbeddedPool(8 << 20) as pool:
        assert isinstance(pool.transport, InProcessTransport)
        assert isinstance(pool.link, InProcessMaster) and not pool.link.pipelined
        values = [os.urandom(1000), os.urandom(2000)]
        assert pool.batch_put(["a", "b"], values) == [None, None]
        buffers = [bytearray(1000), bytearray(2000)]
        assert pool.batch_get_into(["a", "b"], buffers) == [1000, 2000]
        assert [bytes(b) for b in buffers] == values
    # it overrides none of the Client's internals: only its constructor and close
    own = {name for name in vars(EmbeddedPool) if not name.startswith("__")}
    assert own == {"close"}

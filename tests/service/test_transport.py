"""The client's two seams: the transport its bytes take, and its link to the master."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from kvpool.errors import ConfigError, KVPoolError, TransferError
from kvpool.service.client import Client
from kvpool.service.embedded import EmbeddedPool, InProcessMaster
from kvpool.testing.processes import PoolProcess
from kvpool.transfer.in_process import InProcessTransport
from kvpool.transfer.transport import (
    DataPath,
    Item,
    SharedMemoryTransport,
    TcpTransport,
    transport_named,
)


class Recording:
    """A data path that counts what the client asks of it, and can be told to fail."""

    def __init__(self, inner: DataPath) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.fail_writes = False

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        self.calls.append("write")
        if self.fail_writes:
            raise TransferError("the wire broke")
        return self.inner.write(segment_id, offset, buffer, shm_name=shm_name)

    def write_noted(
        self,
        segment_id: str,
        offset: int,
        buffer: Any,
        key: str,
        checksum: int,
        *,
        shm_name: str = "",
    ) -> bool:
        self.calls.append("write")
        if self.fail_writes:
            raise TransferError("the wire broke")
        return self.inner.write_noted(segment_id, offset, buffer, key, checksum, shm_name=shm_name)

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        self.calls.append("read_into")
        return self.inner.read_into(segment_id, offset, buffer, shm_name=shm_name)

    def read_checked(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        self.calls.append("read_into")
        return self.inner.read_checked(segment_id, offset, buffer, shm_name=shm_name)

    def write_many(self, items: Sequence[Item]) -> list[KVPoolError | None]:
        self.calls.append("write_many")
        return self.inner.write_many(items)

    def write_many_noted(
        self, items: Sequence[Item], notes: Sequence[tuple[str, int]]
    ) -> tuple[list[KVPoolError | None], bool]:
        self.calls.append("write_many")
        return self.inner.write_many_noted(items, notes)

    def read_many_into(self, items: Sequence[Item]) -> list[KVPoolError | None]:
        self.calls.append("read_many_into")
        return self.inner.read_many_into(items)

    def read_many_checked(self, items: Sequence[Item]) -> list[KVPoolError | int]:
        self.calls.append("read_many_into")
        return self.inner.read_many_checked(items)

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        self.calls.append("ssd_read_into")
        return self.inner.ssd_read_into(key, buffer)

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
    assert transport_named("shm", 3.0).timeout_s == 3.0
    with pytest.raises(ConfigError, match="'rdma' is not one of shm, tcp"):
        Client(transport="rdma")


def test_a_tcp_only_client_never_maps_a_segment(master: PoolProcess) -> None:
    with Client(master.address, transport="tcp", timeout_s=5) as c:
        c.put("k", b"x" * 4096)
        assert c.get("k") == b"x" * 4096
        (path,) = c._paths.values()
        assert set(path._routes.values()) == {"tcp"}  # type: ignore[attr-defined]


def test_every_byte_goes_through_the_clients_transport(master: PoolProcess) -> None:
    transport = RecordingTransport(TcpTransport(5.0))
    with Client(master.address, transport=transport, timeout_s=5) as c:
        c.put("one", b"1" * 1000)
        assert c.get("one") == b"1" * 1000
        assert c.batch_put(["a", "b"], [b"a" * 10, b"b" * 20]) == [None, None]
        assert c.batch_get_into(["a", "b"], [bytearray(10), bytearray(20)]) == [10, 20]
        (path,) = transport.paths  # one data path per storage owner, kept open
    assert path.calls == ["write", "read_into", "write_many", "read_many_into", "close"]


def test_a_failed_transfer_reopens_the_path_and_frees_the_reservation(
    master: PoolProcess,
) -> None:
    transport = RecordingTransport(TcpTransport(5.0))
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

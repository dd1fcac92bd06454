"""A write tagged with its object's key and checksum is reported to the node
(``SegmentServer.on_write``) once its bytes are in; a tenant's tag is not.  A checked
read hands back the checksum of exactly the bytes it read."""

from __future__ import annotations

import random

import pytest

from kvpool.datapath.data_ops import read_checked, read_many_checked, write, write_many
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.errors import UnknownSegment
from kvpool.protocol.data import Error, SegmentWriteMany
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.storage.checksum import checksum
from kvpool.storage.segment import Segment
from kvpool.tenancy.grants import tenant_check
from tests.tenancy.test_grants import red_on_node_a

SECRET = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"

Note = tuple[str, str, int, int, int]


def test_a_tagged_write_is_noted_after_its_bytes_and_an_untagged_one_is_not(
    server: SegmentServer, segment: Segment
) -> None:
    notes: list[Note] = []

    def note(segment_id: str, key: str, offset: int, size: int, csum: int) -> None:
        assert segment.read(offset, size) == b"kv" * 50  # the bytes are in first
        notes.append((segment_id, key, offset, size, csum))

    server.on_write = note
    host, port = server.address
    with SegmentConnection(host, port, PeerSettings(5.0)) as conn:
        write(conn, "seg0", 4096, b"kv" * 50, key="block-1", checksum=77)
        write(conn, "seg0", 8192, b"kv" * 50)  # no tag: nothing to note
        with pytest.raises(UnknownSegment):  # a refused write notes nothing either
            write(conn, "nope", 0, b"kv" * 50, key="block-2", checksum=78)
    assert notes == [("seg0", "block-1", 4096, 100, 77)]


def test_a_batch_notes_each_range_and_refuses_a_wrong_number_of_notes(
    server: SegmentServer, segment: Segment
) -> None:
    notes: list[Note] = []
    server.on_write = lambda *note: notes.append(note)
    host, port = server.address
    with SegmentConnection(host, port, PeerSettings(5.0)) as conn:
        items = [("seg0", 1000 * i, bytes([i]) * 100) for i in range(3)]
        tags = [(f"b{i}", i) for i in range(3)]
        assert write_many(conn, items, tags) == [0, 1, 2]  # a noted write: its checksum
        assert notes == [("seg0", f"b{i}", 1000 * i, 100, i) for i in range(3)]
        notes.clear()
        # a ranged write whose notes do not match its ranges: refused before a byte
        # moves, and the connection goes on
        with conn._lock:
            channel = conn._connected()
            channel.send_parts(
                SegmentWriteMany([("seg0", 5000, 4), ("seg0", 6000, 4)], [("x", 1)]),
                [memoryview(b"XXXX"), memoryview(b"YYYY")],
            )
            reply, _ = channel.recv(reply=True)
        assert isinstance(reply, Error) and "one per range" in reply.message
        assert segment.read(5000, 4) != b"XXXX" and notes == []
        assert write_many(conn, items[:2]) == [None, None]  # untagged: nothing noted
        assert notes == []


def test_a_tenants_tag_is_ignored() -> None:
    cluster = Credential.parse(SECRET, "test")
    notes: list[Note] = []
    with Segment.create(1 << 20) as segment:
        server = SegmentServer(
            timeout_s=5.0, credential=cluster, server_id="node-a", tenants=tenant_check
        )
        server.add_segment("node-a/mem", segment)
        server.on_write = lambda *note: notes.append(note)
        server.start()
        try:
            host, port = server.address
            grant, red = red_on_node_a(cluster)
            with SegmentConnection(
                host, port, PeerSettings(5.0, credential=red, client_id="red")
            ) as conn:
                # a tenant naming a key outside its namespace: the bytes land (its grant
                # allows them), the key is not noted (the master scopes tenants' keys)
                write(conn, f"node-a/mem#{grant}", 0, b"r" * 100, key="@blue/x", checksum=1)
                assert segment.read(0, 100) == b"r" * 100
                items = [
                    (f"node-a/mem#{grant}", 0, b"s" * 50),
                    (f"node-a/mem#{grant}", 50, b"t" * 50),
                ]
                assert write_many(conn, items, [("@blue/y", 2), ("z", 3)]) == [2, 3]
                assert segment.read(0, 100) == b"s" * 50 + b"t" * 50
        finally:
            server.close()
    assert notes == []


@pytest.mark.parametrize("size", [0, 1, 300_000, 5 << 20])
def test_a_checked_read_returns_the_checksum_of_the_bytes_it_read(
    server: SegmentServer, segment: Segment, size: int
) -> None:
    data = bytes(random.Random(size).randbytes(size))
    segment.write(0, data)
    into = bytearray(size)
    host, port = server.address
    with SegmentConnection(host, port, PeerSettings(5.0)) as conn:
        assert read_checked(conn, "seg0", 0, into) == checksum(data)
        assert into == data
        if size:  # changed on the node: the digest says so
            segment.write(0, bytes([data[0] ^ 0xFF]))
            assert read_checked(conn, "seg0", 0, into) != checksum(data)


def test_a_checked_batch_returns_each_values_checksum_or_its_error(
    server: SegmentServer, segment: Segment
) -> None:
    values = [random.Random(i).randbytes(1000 * (i + 1)) for i in range(4)]
    for i, value in enumerate(values):
        segment.write(100_000 * i, value)
    intos = [bytearray(len(v)) for v in values]
    items = [("seg0", 100_000 * i, into) for i, into in enumerate(intos)]
    host, port = server.address
    with SegmentConnection(host, port, PeerSettings(5.0)) as conn:
        assert read_many_checked(conn, items) == [checksum(v) for v in values]  # one request
        assert intos == values
        # an unknown segment refuses the ranged request; asked again per item, the others
        # still read and come back with their checksums
        mixed = [items[0], ("nope", 0, bytearray(10)), items[2]]
        done = read_many_checked(conn, mixed)
        assert done[0] == checksum(values[0]) and done[2] == checksum(values[2])
        assert isinstance(done[1], UnknownSegment)

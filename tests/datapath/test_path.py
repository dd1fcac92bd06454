from __future__ import annotations

import numpy as np
import pytest

from kvpool.datapath.data_ops import DataOp, ReadOp, SsdReadOp, WriteOp, sole_result
from kvpool.datapath.path import NodeDataPath
from kvpool.datapath.segment_server import SegmentServer
from kvpool.datapath.shm import host_token
from kvpool.errors import ObjectNotFound, UnknownSegment
from kvpool.security.peer import PeerSettings
from kvpool.storage.checksum import checksum
from kvpool.storage.segment import Segment


def test_same_host_segments_go_through_shared_memory(
    server: SegmentServer, segment: Segment
) -> None:
    host, port = server.address
    with NodeDataPath(host, port, PeerSettings(5.0)) as path:
        assert path.route("seg0") == "shm"
        requests_before = server.stats.requests
        data = np.arange(4096, dtype=np.uint16)
        # a copy does not pass the node: the write is stored, not noted
        assert path.run([WriteOp("seg0", 64, data, key="k", checksum=7)]) == [None]
        out = np.zeros_like(data)
        assert path.run([ReadOp("seg0", 64, out, checked=True)]) == [checksum(data.tobytes())]
        np.testing.assert_array_equal(out, data)
        assert server.stats.requests == requests_before  # no TCP request for the data
    assert segment.read(64, 8192) == data.tobytes()


def test_other_hosts_and_opt_out_go_through_tcp(segment: Segment) -> None:
    with SegmentServer(host_token="some-other-host") as srv:
        srv.add_segment("seg0", segment)
        host, port = srv.address
        for path in (NodeDataPath(host, port), NodeDataPath(host, port, allow_shm=False)):
            with path:
                assert path.route("seg0") == "tcp"
                # over TCP a noted write carries its tag: the node noted it
                assert path.run([WriteOp("seg0", 0, b"via-tcp", key="k", checksum=7)]) == [7]
                buf = bytearray(7)
                assert path.run([ReadOp("seg0", 0, buf)]) == [None]
                assert buf == b"via-tcp"
        assert srv.stats.bytes_written == 14


def test_forget_reroutes_after_a_segment_changes(server: SegmentServer) -> None:
    host, port = server.address
    with NodeDataPath(host, port) as path:
        assert path.route("seg0") == "shm"
        path.forget("seg0")
        assert not path.shm.has("seg0")
        assert path.route("seg0") == "shm"


def test_batches_mix_routes_and_keep_per_item_results(segment: Segment) -> None:
    with Segment.create(1 << 20) as remote, SegmentServer() as srv:
        srv.add_segment("near", segment)
        srv.add_segment("far", remote)
        host, port = srv.address
        with NodeDataPath(host, port) as path:
            # "near" is attachable; pretend "far" is on another host.
            path.shm.attach("near", segment.name)
            path._routes.update({"near": "shm", "far": "tcp"})
            items: list[DataOp] = [
                WriteOp("near", 0, b"a" * 100),
                WriteOp("far", 0, b"b" * 100),
                WriteOp("near", segment.size, b"c"),  # out of range
                WriteOp("far", 100, b"d" * 100),
            ]
            results = path.run(items)
            assert [r is None for r in results] == [True, True, False, True]
            outs = [bytearray(100) for _ in range(4)]
            reads: list[DataOp] = [
                ReadOp("near", 0, outs[0]),
                ReadOp("far", 0, outs[1]),
                ReadOp("far", 100, outs[2]),
                ReadOp("far", 0, outs[3], checked=True),
            ]
            assert path.run(reads) == [None, None, None, checksum(b"b" * 100)]
            assert outs == [b"a" * 100, b"b" * 100, b"d" * 100, b"b" * 100]
        assert srv.stats.bytes_written == 200  # only the "far" items crossed TCP


def test_a_restarted_node_with_a_new_segment_is_not_written_through_a_stale_mapping(
    segment: Segment,
) -> None:
    with SegmentServer(host_token=host_token()) as srv:
        srv.add_segment("seg0", segment)
        host, port = srv.address
        with NodeDataPath(host, port) as path:
            sole_result(path.run([WriteOp("seg0", 0, b"old", shm_name=segment.name)]))
            # The node restarts: same segment id, new shared memory.
            with Segment.create(segment.size) as fresh:
                srv.add_segment("seg0", fresh)
                segment.close()
                sole_result(path.run([WriteOp("seg0", 0, b"new", shm_name=fresh.name)]))
                assert fresh.read(0, 3) == b"new"
                assert path.shm.name_of("seg0") == fresh.name


def test_a_batch_checks_each_segments_route_against_its_shm_name(segment: Segment) -> None:
    """A batch's ops carry their placements' shared-memory names, as a single op does:
    a node restarted under the same segment id is not written through a stale mapping."""
    with SegmentServer(host_token=host_token()) as srv:
        srv.add_segment("seg0", segment)
        host, port = srv.address
        with NodeDataPath(host, port) as path:
            path.run([WriteOp("seg0", 0, b"old", shm_name=segment.name)])
            with Segment.create(segment.size) as fresh:
                srv.add_segment("seg0", fresh)
                segment.close()
                ops: list[DataOp] = [
                    WriteOp("seg0", 0, b"new", shm_name=fresh.name),
                    WriteOp("seg0", 8, b"two", shm_name=fresh.name),
                ]
                assert path.run(ops) == [None, None]
                assert fresh.read(0, 3) == b"new" and fresh.read(8, 3) == b"two"


def test_ssd_reads_go_over_tcp_and_a_refusal_is_the_ops_result(server: SegmentServer) -> None:
    host, port = server.address
    with NodeDataPath(host, port, allow_shm=False) as path:
        (refused,) = path.run([SsdReadOp("missing", bytearray(4))])  # no SSD tier here
        assert isinstance(refused, ObjectNotFound)
        (unknown,) = path.run([ReadOp("no-such-segment", 0, bytearray(4))])
        assert isinstance(unknown, UnknownSegment)
        with pytest.raises(UnknownSegment):  # a single transfer's caller raises it
            sole_result([unknown])

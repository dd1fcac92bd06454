from __future__ import annotations

import numpy as np

from kvpool.storage.segment import Segment
from kvpool.transfer.path import NodeDataPath
from kvpool.transfer.segment_server import SegmentServer
from kvpool.transfer.shm import host_token


def test_same_host_segments_go_through_shared_memory(
    server: SegmentServer, segment: Segment
) -> None:
    host, port = server.address
    with NodeDataPath(host, port, timeout_s=5) as path:
        assert path.route("seg0") == "shm"
        requests_before = server.stats.requests
        data = np.arange(4096, dtype=np.uint16)
        path.write("seg0", 64, data)
        out = np.zeros_like(data)
        path.read_into("seg0", 64, out)
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
                path.write("seg0", 0, b"via-tcp")
                buf = bytearray(7)
                path.read_into("seg0", 0, buf)
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
            items: list[tuple[str, int, object]] = [
                ("near", 0, b"a" * 100),
                ("far", 0, b"b" * 100),
                ("near", segment.size, b"c"),  # out of range
                ("far", 100, b"d" * 100),
            ]
            results = path.write_many(items)
            assert [r is None for r in results] == [True, True, False, True]
            outs = [bytearray(100) for _ in range(3)]
            reads: list[tuple[str, int, object]] = [
                ("near", 0, outs[0]),
                ("far", 0, outs[1]),
                ("far", 100, outs[2]),
            ]
            assert path.read_many_into(reads) == [None, None, None]
            assert outs == [b"a" * 100, b"b" * 100, b"d" * 100]
        assert srv.stats.bytes_written == 200  # only the "far" items crossed TCP


def test_a_restarted_node_with_a_new_segment_is_not_written_through_a_stale_mapping(
    segment: Segment,
) -> None:
    with SegmentServer(host_token=host_token()) as srv:
        srv.add_segment("seg0", segment)
        host, port = srv.address
        with NodeDataPath(host, port) as path:
            path.write("seg0", 0, b"old", shm_name=segment.name)
            # The node restarts: same segment id, new shared memory.
            with Segment.create(segment.size) as fresh:
                srv.add_segment("seg0", fresh)
                segment.close()
                path.write("seg0", 0, b"new", shm_name=fresh.name)
                assert fresh.read(0, 3) == b"new"
                assert path.shm.name_of("seg0") == fresh.name

"""The Mooncake engine moves a KV cache's pages in place: the tensor's storage is
registered once and each page is read and written where it is (header apart)."""

from __future__ import annotations

from kvpool.testing.mooncake import Namespace
from tests.engines.mooncake_host import mooncake_json

PAGE = 128 << 10


def test_kv_cache_pages_move_in_place() -> None:
    with Namespace() as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster")
        engine = ns.new(
            "tests.engines.mooncake_host:open_engine", mooncake_json("127.0.0.1:50051", 64 << 20)
        )
        r = ns.run("tests.engines.mooncake_host:kv_cache_round_trip", engine)
    assert r["put"] == [None] * 4
    assert r["got"] == [PAGE] * 4 and r["equal"]
    assert r["regions"] == 1  # the cache's storage, registered once
    assert r["wide"] == [PAGE] and r["wide_equal"]  # another size: through the staging area
    assert r["damaged"] == [-1]  # a damaged copy read in place is a miss
    assert r["moved"] == {"put_in_place": 4, "put_staged": 0, "get_in_place": 4, "get_staged": 1}

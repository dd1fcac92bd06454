from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvpool.errors import PoolError, UnknownSegment
from kvpool.storage.segment import Segment
from kvpool.transfer.shm import ShmConnection, host_token


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 16 << 20])
def test_round_trip_sizes_land_in_the_owners_segment(segment: Segment, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with ShmConnection() as shm:
        shm.attach("seg0", segment.name, segment.size)
        assert shm.write("seg0", 123, data) == size
        out = np.empty_like(data)
        assert shm.read_into("seg0", 123, out) == size
    np.testing.assert_array_equal(out, data)
    assert segment.read(123, size) == data.tobytes()
    assert segment.path.exists()  # detaching never unlinks the owner's segment


def test_bounds_unknown_segment_and_wrong_size_are_refused(segment: Segment) -> None:
    with ShmConnection() as shm:
        with pytest.raises(UnknownSegment):
            shm.write("seg0", 0, b"x")
        with pytest.raises(UnknownSegment, match="not the same segment"):
            shm.attach("seg0", segment.name, segment.size + 1)
        with pytest.raises(PoolError, match="no shared-memory segment"):
            shm.attach("seg0", "kvpool-missing-name")
        shm.attach("seg0", segment.name)
        with pytest.raises(PoolError, match="outside segment"):
            shm.write("seg0", segment.size, b"x")
        shm.detach("seg0")
        assert not shm.has("seg0")


def test_another_process_writes_through_shm_and_the_owner_sees_it(segment: Segment) -> None:
    code = (
        "import sys; from kvpool.transfer.shm import ShmConnection\n"
        "with ShmConnection() as shm:\n"
        "    shm.attach('s', sys.argv[1])\n"
        "    shm.write('s', 10, b'written-by-child')\n"
    )
    subprocess.run(
        [sys.executable, "-W", "error", "-c", code, segment.name], check=True, timeout=60
    )
    assert segment.read(10, 16) == b"written-by-child"


def test_host_token_is_stable_and_shared_by_processes_on_this_host() -> None:
    code = "from kvpool.transfer.shm import host_token; print(host_token())"
    child = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    )
    assert child.stdout.strip() == host_token() == host_token()


def test_attach_maps_every_page_up_front_and_keeps_what_the_owner_wrote(
    segment: Segment,
) -> None:
    segment.write(segment.size - 4, b"tail")

    def resident() -> list[int]:  # bytes mapped per mapping of the segment (smaps' Rss)
        rss, inside = [], False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
                inside = line.endswith(str(segment.path))
            elif inside and fields[0] == "Rss:":
                rss.append(int(fields[1]) * 1024)
        return rss

    with ShmConnection() as shm:
        shm.attach("seg0", segment.name, segment.size)
        # the owner's mapping and this one: both whole, so no copy pays a page fault
        assert resident() == [segment.size, segment.size]
        out = bytearray(4)
        shm.read_into("seg0", segment.size - 4, out)
        assert out == b"tail"
        shm.write("seg0", 0, b"head")
    assert segment.read(0, 4) == b"head"

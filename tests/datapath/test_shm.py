from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvpool.datapath.shm import ShmConnection, host_token, remove_if_owner_dead
from kvpool.errors import PoolError, TransferError, UnknownSegment
from kvpool.storage.segment import Segment
from kvpool.testing.fresh import run_python
from tests.waiting import wait_until

_OWNER = (
    "import sys; from kvpool.storage.segment import Segment\n"
    "seg = Segment.create(1 << 20)\n"
    "print(seg.name, flush=True)\n"
    "sys.stdin.read()\n"  # lives until killed
)


def start_owner() -> tuple[subprocess.Popen[str], str]:
    """A process that owns a segment, and the segment's name."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    return owner, owner.stdout.readline().strip()


def kill(owner: subprocess.Popen[str]) -> None:
    owner.kill()
    owner.wait(30)
    for pipe in (owner.stdin, owner.stdout):
        if pipe is not None:
            pipe.close()


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
        "import sys; from kvpool.datapath.shm import ShmConnection\n"
        "with ShmConnection() as shm:\n"
        "    shm.attach('s', sys.argv[1])\n"
        "    shm.write('s', 10, b'written-by-child')\n"
    )
    run_python(code, segment.name, warnings="error", timeout_s=60, check=True)
    assert segment.read(10, 16) == b"written-by-child"


def test_host_token_is_stable_and_shared_by_processes_on_this_host() -> None:
    code = "from kvpool.datapath.shm import host_token; print(host_token())"
    child = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    )
    assert child.stdout.strip() == host_token() == host_token()


def test_attach_maps_every_page_in_the_background_and_keeps_what_the_owner_wrote(
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
        # the owner's mapping and this one: both whole soon (populated by a thread, not
        # by the caller, whose first read needs only its own pages), so no copy pays a
        # page fault
        wait_until(lambda: resident() == [segment.size, segment.size], 60, what="populated")
        out = bytearray(4)
        shm.read_into("seg0", segment.size - 4, out)
        assert out == b"tail"
        shm.write("seg0", 0, b"head")
    assert segment.read(0, 4) == b"head"


def test_a_copy_into_a_dead_owners_segment_fails_and_removes_its_file() -> None:
    owner, name = start_owner()
    path = Path("/dev/shm") / name
    try:
        with ShmConnection() as shm:
            shm.attach("s", name)
            assert shm.write("s", 0, b"stored") == 6 and shm.owner_alive("s")
            kill(owner)  # SIGKILL: the file stays, the mapping here still "works"
            assert path.exists() and not shm.owner_alive("s")
            with pytest.raises(TransferError, match=r"owner .* is gone"):
                shm.write("s", 0, b"never acknowledged")
            assert not shm.has("s")  # unmapped here ...
            assert not path.exists()  # ... and its memory given back to the host
    finally:
        kill(owner)
        path.unlink(missing_ok=True)


def test_a_read_from_a_dead_owners_segment_is_not_served() -> None:
    owner, name = start_owner()
    try:
        with ShmConnection() as shm:
            shm.attach("s", name)
            kill(owner)
            with pytest.raises(TransferError):
                shm.read_into("s", 0, bytearray(6))
    finally:
        kill(owner)
        (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_only_a_dead_owners_segment_on_this_host_is_removed(segment: Segment) -> None:
    token = host_token()
    assert not remove_if_owner_dead(segment.name, token)  # alive: this process owns it
    assert segment.path.exists()
    owner, name = start_owner()
    try:
        kill(owner)
        assert not remove_if_owner_dead(name, "another-host")  # not this host's file
        assert remove_if_owner_dead(name, token)
        assert not (Path("/dev/shm") / name).exists()
        assert not remove_if_owner_dead(name, token)  # already gone: nothing to do
        assert not remove_if_owner_dead("../etc", token)
    finally:
        kill(owner)
        (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_copies_that_attach_the_same_segment_at_once_all_succeed(segment: Segment) -> None:
    # Copies routed at once each attach the segment (an AsyncClient's threads do).  A second
    # attach used to close the descriptor another thread's copy was about to ask about its
    # owner: the copy failed with EBADF (or asked a reused descriptor: another file).
    errors: list[BaseException] = []

    def copies(shm: ShmConnection, i: int) -> None:
        data = bytes([i]) * 4096
        out = bytearray(4096)
        try:
            for _ in range(200):
                shm.attach("seg0", segment.name, segment.size)
                shm.write("seg0", i * 4096, data)
                shm.read_into("seg0", i * 4096, out)
                assert out == data
        except BaseException as exc:  # reported below
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as under load
    try:
        with ShmConnection() as shm:
            threads = [threading.Thread(target=copies, args=(shm, i)) for i in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not any(thread.is_alive() for thread in threads)
            assert shm.name_of("seg0") == segment.name
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) < 200  # replaced attachments were closed

from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from kvpool.errors import ConfigError, NoSpace, PoolError
from kvpool.storage import pages
from kvpool.storage import segment as segment_module
from kvpool.storage.pages import Warmth
from kvpool.storage.segment import SHM_DIR, Segment, remove_stale_segments
from kvpool.testing.fresh import run_python
from tests.waiting import wait_until


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(1 << 20)
    yield seg
    seg.close()


def test_create_write_read_and_unlink_on_close() -> None:
    seg = Segment.create(4096)
    path = seg.path
    assert path.parent == SHM_DIR and path.exists()
    assert seg.write(10, b"hello") == 5
    assert seg.read(10, 5) == b"hello"
    out = bytearray(3)
    assert seg.read_into(11, out) == 3 and out == b"ell"
    seg.close()
    assert not path.exists()
    seg.close()  # idempotent
    with pytest.raises(PoolError, match="closed"):
        seg.read(0, 1)


def test_another_process_attaches_by_name_and_sees_writes(segment: Segment) -> None:
    segment.write(0, b"from-owner")
    code = (
        "import sys; from kvpool.storage.segment import Segment\n"
        "s = Segment.attach(sys.argv[1]); assert s.read(0, 10) == b'from-owner'\n"
        "s.write(100, b'from-child'); s.close()\n"
    )
    run_python(code, segment.name, warnings="error", timeout_s=60, check=True)
    assert segment.read(100, 10) == b"from-child"
    assert segment.path.exists()  # an attached close never unlinks the owner's segment


def test_numpy_round_trip_into_caller_buffers(segment: Segment) -> None:
    src = np.random.default_rng(1).standard_normal(65536, dtype=np.float32)
    segment.write(4096, src)
    dst = np.empty_like(src)
    segment.read_into(4096, dst)
    np.testing.assert_array_equal(src, dst)


@pytest.mark.parametrize(("offset", "length"), [(-1, 1), (0, (1 << 20) + 1), ((1 << 20), 1)])
def test_out_of_range_access_is_refused_and_touches_nothing(
    segment: Segment, offset: int, length: int
) -> None:
    with pytest.raises(PoolError, match="outside segment"):
        segment.write(offset, bytes(length))
    with pytest.raises(PoolError, match="outside segment"):
        segment.read(offset, length)
    assert segment.read((1 << 20) - 1, 1) == b"\0"


def test_zero_length_access_at_the_end_is_fine(segment: Segment) -> None:
    assert segment.write(1 << 20, b"") == 0
    assert segment.read(1 << 20, 0) == b""


def test_duplicate_name_bad_name_and_bad_size_are_config_errors(segment: Segment) -> None:
    with pytest.raises(ConfigError, match="already exists"):
        Segment.create(10, segment.name)
    with pytest.raises(ValueError, match="invalid segment name"):
        Segment.create(10, "../etc")
    with pytest.raises(ConfigError, match="positive"):
        Segment.create(0)


def test_attach_to_a_missing_name_is_a_pool_error() -> None:
    with pytest.raises(PoolError, match="no shared-memory segment"):
        Segment.attach("kvpool-does-not-exist")


def test_close_with_a_live_view_still_unlinks(segment: Segment) -> None:
    view = segment.view(0, 8)
    segment.close()
    assert not Path(segment.path).exists()
    view[0] = 1  # still mapped until the view goes away; no crash
    del view


def _segment_in_child(directory: Path, then: str = "") -> subprocess.CompletedProcess[str]:
    """A child process that creates a segment in ``directory``, prints its name, then runs
    ``then`` (with ``os`` imported)."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from kvpool.storage.segment import Segment\n"
        "s = Segment.create(4096, directory=Path(sys.argv[1]))\n"
        "print(s.name, flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code + then, str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_segments_of_killed_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    child = _segment_in_child(tmp_path, then="os.kill(os.getpid(), 9)\n")
    assert child.returncode == -9
    dead_name = child.stdout.strip()
    assert (tmp_path / dead_name).exists()  # SIGKILL skipped close()
    live = Segment.create(4096, directory=tmp_path)
    explicit = Segment.create(4096, "kvpool-named", directory=tmp_path)
    try:
        assert remove_stale_segments(tmp_path) == [dead_name]
        assert not (tmp_path / dead_name).exists()
        assert live.path.exists() and explicit.path.exists()
    finally:
        live.close()
        explicit.close()


# ------------------------------------------------------------------------- populating
def resident(path: Path) -> list[int]:
    """Resident bytes of each mapping of ``path`` in this process (from smaps)."""
    sizes: list[int] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            sizes.append(int(fields[1]) * 1024)
    return sizes


SIZE = 4 << 20


def test_create_and_attach_populate_every_page_and_keep_the_content() -> None:
    with Segment.create(SIZE) as owner:
        assert resident(owner.path) == [SIZE]  # mapped at creation, before any write
        assert owner.read(0, SIZE) == bytes(SIZE)  # still zero-filled
        owner.write(SIZE - 5, b"owner")
        with Segment.attach(owner.name) as seg:
            assert sorted(resident(owner.path)) == [SIZE, SIZE]
            assert seg.size == SIZE and seg.read(SIZE - 5, 5) == b"owner"  # populating reads
            seg.write(0, b"client")  # and writes still land in the owner's memory
        assert owner.read(0, 6) == b"client"


def test_populate_false_maps_lazily() -> None:
    with (
        Segment.create(SIZE, populate=False) as owner,
        Segment.attach(owner.name, populate=False) as seg,
    ):
        assert resident(owner.path) == [0, 0]
        seg.write(0, b"x" * 4096)  # one page, in this mapping only (a huge page at most)
        untouched, written = sorted(resident(owner.path))
        assert untouched == 0 and 4096 <= written < SIZE


def test_warmth_says_whether_the_pages_were_populated() -> None:
    with Segment.create(SIZE) as warm, Segment.create(SIZE, populate=False) as lazy:
        assert warm.warmth == Warmth("warm", SIZE, SIZE)
        assert lazy.warmth == Warmth("off", 0, SIZE)


def test_warming_in_the_background_populates_every_page_and_keeps_writes() -> None:
    size = 64 << 20
    with Segment.create(size, populate=False) as owner:
        assert resident(owner.path) == [0]
        owner.warm_in_background()
        # clients write while it warms: populating never changes content
        for offset in range(0, size, 1 << 20):
            owner.write(offset, offset.to_bytes(8, "little"))
        warmth = wait_until(lambda: owner.warmth.state == "warm" and owner.warmth)
        assert warmth == Warmth("warm", size, size)
        assert resident(owner.path) == [size]
        for offset in range(0, size, 1 << 20):
            assert owner.read(offset, 8) == offset.to_bytes(8, "little")
        owner.warm_in_background()  # warm already: nothing more to do
        assert owner.warmth.state == "warm"


def test_closing_a_warming_segment_stops_its_warmer_and_unlinks() -> None:
    owner = Segment.create(256 << 20, populate=False)
    owner.warm_in_background()
    owner.close()  # whether it got far or not: stopped and joined before the unmap
    assert owner.warmth.state in ("stopped", "warm")
    assert not owner.path.exists()
    assert not [t for t in threading.enumerate() if t.name == f"kvpool-warm-{owner.name}"]
    with pytest.raises(PoolError, match="closed"):
        owner.warm_in_background()


def test_without_madvise_populate_falls_back_to_touching_each_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    touched: list[tuple[int, int]] = []
    touch = pages._touch

    def spy(mapping: mmap.mmap, start: int, length: int) -> None:
        touched.append((start, length))
        touch(mapping, start, length)

    monkeypatch.setattr(pages, "_POPULATE_WRITE", None)  # a Python/OS without it
    monkeypatch.setattr(pages, "_touch", spy)
    monkeypatch.setattr(pages, "POPULATE_CHUNK", 1 << 20)
    size = SIZE + 4096 + 10  # a last chunk of one page and a bit
    with Segment.create(size) as owner:
        owner.write(size - 3, b"end")
        with Segment.attach(owner.name) as seg:
            assert sorted(resident(owner.path)) == [size + 4086] * 2  # whole pages
            assert seg.read(size - 3, 3) == b"end"
            seg.write(0, b"start")
        assert owner.read(0, 5) == b"start"
    chunks = [(i << 20, 1 << 20) for i in range(4)] + [(SIZE, 4106)]
    assert touched == chunks * 2  # owner, then attach: every chunk by the fallback


def test_a_kernel_refusing_the_advice_falls_back_once_and_for_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an advice number no kernel knows: madvise fails with EINVAL, as MADV_POPULATE_WRITE
    # does before Linux 5.14
    monkeypatch.setattr(pages, "_POPULATE_WRITE", 0x7FFF)
    with Segment.create(SIZE) as owner:
        assert pages._POPULATE_WRITE is None  # not asked again
        assert resident(owner.path) == [SIZE]
        assert owner.read(0, SIZE) == bytes(SIZE)


class _FailingMapping:
    """A mapping whose madvise fails as with no memory left."""

    def __len__(self) -> int:
        return SIZE

    def madvise(self, option: int, start: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")


def test_no_memory_to_populate_is_no_space_for_the_owner_and_lazy_for_others(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pages, "_POPULATE_WRITE", 23)
    fake = cast(mmap.mmap, _FailingMapping())
    with pytest.raises(NoSpace, match="cannot populate"):
        segment_module.populate(fake, owner=True)
    with caplog.at_level(logging.WARNING, logger="kvpool.segment"):
        segment_module.populate(fake, owner=False)  # the attach goes on, lazily mapped
    assert "not populated" in caplog.text


def test_a_failed_populate_at_creation_leaves_no_segment_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fail(mapping: mmap.mmap, *, owner: bool) -> None:
        raise NoSpace("cannot populate")

    monkeypatch.setattr(segment_module, "_populate", fail)
    with pytest.raises(NoSpace):
        Segment.create(SIZE, "kvpool-populate-test", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_dead_segment_named_by_a_pid_that_lives_here_is_removed(tmp_path: Path) -> None:
    # A process in another PID namespace (bench/_netns.py's rows) names its segment by
    # its pid there: here that pid may be another, live process.  Its lock says it died.
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from kvpool.storage.segment import Segment\n"
        "s = Segment.create(4096, f'kvpool-{os.getppid()}-0123456789ab',"
        " directory=Path(sys.argv[1]))\n"
        "os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    name = f"kvpool-{os.getpid()}-0123456789ab"  # our pid: alive
    path = tmp_path / name
    assert path.exists()
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime - 60))  # not being created
    live = Segment.create(4096, directory=tmp_path)  # our pid too, lock held
    try:
        assert remove_stale_segments(tmp_path) == [name]
        assert live.path.exists()
    finally:
        live.close()


def test_a_segment_being_created_is_not_taken_for_a_dead_one(tmp_path: Path) -> None:
    # between open() and flock() in Segment.create: no lock yet, but its creator lives
    name = f"kvpool-{os.getpid()}-aaaaaaaaaaaa"
    (tmp_path / name).write_bytes(b"")
    assert remove_stale_segments(tmp_path) == []
    assert (tmp_path / name).exists()


def test_an_owner_that_exits_without_close_leaves_no_segment(tmp_path: Path) -> None:
    # a program that forgets close() must not hold shared memory until reboot
    done = _segment_in_child(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("kvpool-")
    assert list(tmp_path.iterdir()) == []


def test_a_collected_owner_unlinks_and_a_forked_child_does_not(tmp_path: Path) -> None:
    seg = Segment.create(4096, directory=tmp_path)
    path = seg.path
    pid = os.fork()
    if pid == 0:  # the child exits as a normal Python exit would, finalizers and all
        import atexit

        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(pid, 0)
    assert path.exists()  # the child's exit left the parent's segment alone
    del seg
    import gc

    gc.collect()
    assert not path.exists()

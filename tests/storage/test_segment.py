from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.errors import ConfigError, PoolError
from kvpool.storage.segment import SHM_DIR, Segment, remove_stale_segments


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
    subprocess.run(
        [sys.executable, "-W", "error", "-c", code, segment.name], check=True, timeout=60
    )
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


def test_segments_of_killed_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from kvpool.storage.segment import Segment\n"
        "s = Segment.create(4096, directory=Path(sys.argv[1]))\n"
        "print(s.name, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
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

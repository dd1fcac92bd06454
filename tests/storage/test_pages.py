"""Warming a mapping: in the caller, in a thread that can be stopped, and when the memory
is not there."""

from __future__ import annotations

import errno
import mmap
import threading
from collections.abc import Iterator

import pytest

from kvpool.storage import pages
from kvpool.storage.pages import Warmer, Warmth

SIZE = 8 << 20
CHUNK = 1 << 20


@pytest.fixture
def mapping() -> Iterator[mmap.mmap]:
    # an anonymous shared mapping: populated the same way as a segment's file
    area = mmap.mmap(-1, SIZE)
    yield area
    area.close()


def test_run_populates_every_chunk_in_the_caller(mapping: mmap.mmap) -> None:
    warmer = Warmer(mapping, "t", chunk=CHUNK)
    assert warmer.warmth == Warmth("warming", 0, SIZE)
    assert warmer.run() == Warmth("warm", SIZE, SIZE)
    assert warmer.warmth.fraction == 1.0


def test_a_stopped_warmer_ends_part_way_and_says_so(
    mapping: mmap.mmap, monkeypatch: pytest.MonkeyPatch
) -> None:
    advise = pages._advise
    calls: list[int] = []
    warmer = Warmer(mapping, "t", chunk=CHUNK)

    def third_chunk_stops(address: int, length: int, advice: int) -> int:
        calls.append(length)
        if len(calls) == 3:  # shutdown arrives while the third chunk is populated
            warmer.stop(wait=False)
        return advise(address, length, advice)

    monkeypatch.setattr(pages, "_advise", third_chunk_stops)
    warmer.start()
    warmer.stop()  # joins: returns once the thread has ended
    if len(calls) >= 3:  # the stop above may have come first: then it ended sooner
        assert len(calls) == 3
        assert warmer.warmth == Warmth("stopped", 3 * CHUNK, SIZE)
    assert warmer.warmth.state == "stopped"
    assert not [t for t in threading.enumerate() if t.name == "kvpool-warm-t"]


def test_memory_that_is_not_there_fails_the_warmer_with_the_reason(
    mapping: mmap.mmap, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages, "_POPULATE_WRITE", 23)
    monkeypatch.setattr(pages, "_advise", lambda address, length, advice: errno.ENOMEM)
    warmth = Warmer(mapping, "t", chunk=CHUNK).run()
    assert warmth.state == "failed" and warmth.warmed == 0
    assert "cannot populate" in warmth.error and "memory" in warmth.error.lower()

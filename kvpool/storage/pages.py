"""Warming a mapping: faulting its pages in before the first copy into them needs them.

A never-touched page of a shared-memory segment costs a page fault (and the kernel's
zeroing) on its first write, in each process that maps it; :class:`Warmer` populates a
mapping chunk by chunk, in the caller or in a background thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass

from kvpool.errors import NoSpace

__all__ = [
    "POPULATE_CHUNK",
    "Warmer",
    "Warmth",
    "populate",
]

log = logging.getLogger("kvpool.segment")

# madvise(MADV_POPULATE_WRITE) (Linux >= 5.14) faults a range in, writable, in one call.
# Python 3.11's mmap lacks the constant; its value is fixed by the kernel ABI (23 in
# asm-generic/mman-common.h, and on every architecture that has it).
_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
# Populate this much per call: 32 MiB takes ~10 ms in the owner (zeroing included), so a
# stop is noticed within that.  The call goes through ctypes, which releases the GIL: the
# process's other threads (a master's event loop) run while the kernel works.
POPULATE_CHUNK = 32 << 20
# The fallback touches pages holding the GIL: in smaller steps, so other threads get it.
_TOUCH_STEP = 4 << 20

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int


def _address(mapping: mmap.mmap) -> int | None:
    """Where ``mapping`` starts in memory (None: not a real mapping).  The ctypes view
    that tells it is dropped at once, so the mapping can still be closed."""
    try:
        probe = ctypes.c_char.from_buffer(mapping)
    except (TypeError, ValueError):
        return None
    address = ctypes.addressof(probe)
    del probe
    return address


def _advise(address: int, length: int, advice: int) -> int:
    """madvise on ``[address, address + length)``; 0 or the errno."""
    assert _madvise is not None
    if _madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def _touch(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault pages in by reading one byte of each (content untouched, in C)."""
    with memoryview(mapping) as whole:
        for at in range(start, start + length, _TOUCH_STEP):
            end = min(start + length, at + _TOUCH_STEP)
            bytes(whole[at : end : mmap.PAGESIZE])


@dataclass(frozen=True, slots=True)
class Warmth:
    """How far a segment's pages are faulted in.

    ``state``: ``off`` (left to fault on first touch), ``warming``, ``warm``,
    ``stopped`` (part-way, by :meth:`Warmer.stop`), or ``failed`` (``error`` says why;
    the pages still fault in lazily).
    """

    state: str
    warmed: int
    total: int
    error: str = ""

    @property
    def fraction(self) -> float:
        return self.warmed / self.total if self.total else 1.0


# Rules:
#
# - Populating never changes content: MADV_POPULATE_WRITE maps each page writable as a
#   write fault would, and the fallback only reads.  So it may run while clients write.
# - The advice is preferred; where the kernel refuses it (EINVAL: before 5.14, or no such
#   constant) one byte per page is read instead -- as fast here (a read fault on a shared
#   tmpfs mapping maps the page writable) but without the kernel's promise -- and the
#   advice is not asked for again.
# - Any other failure (ENOMEM; EFAULT for what would be a SIGBUS) means the memory is not
#   there: the warmer stops, ``failed``, and says why.
# - Whoever owns the mapping stops the warmer (:meth:`Warmer.stop`) before unmapping it.
class Warmer:
    """Populates one mapping, in the caller or in a thread of its own."""

    def __init__(self, mapping: mmap.mmap, name: str = "", chunk: int = 0) -> None:
        self._mapping = mapping
        self.name = name
        self.total = len(mapping)
        self.chunk = chunk or POPULATE_CHUNK
        self._warmed = 0
        self._state = "warming"
        self._error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def warmth(self) -> Warmth:
        return Warmth(self._state, self._warmed, self.total, self._error)

    def run(self) -> Warmth:
        """Populate every page now, in this thread (until done, failed or stopped)."""
        global _POPULATE_WRITE
        address = _address(self._mapping) if _madvise is not None else None
        while self._warmed < self.total and not self._stop.is_set():
            start = self._warmed
            length = min(self.chunk, self.total - start)
            advice = _POPULATE_WRITE
            failed = errno.EINVAL
            if advice is not None:
                if address is not None:
                    failed = _advise(address + start, length, advice)
                else:  # not a real mapping (a test's): its own madvise
                    try:
                        self._mapping.madvise(advice, start, length)
                        failed = 0
                    except OSError as exc:
                        failed = exc.errno or errno.EINVAL
                if failed == errno.EINVAL:
                    _POPULATE_WRITE = None  # this kernel does not know it: never ask again
            if failed == errno.EINVAL:
                _touch(self._mapping, start, length)
            elif failed:
                self._error = f"cannot populate {self.total} bytes of shared memory: " + (
                    os.strerror(failed)
                )
                self._state = "failed"
                return self.warmth
            self._warmed = start + length
        self._state = "warm" if self._warmed >= self.total else "stopped"
        return self.warmth

    def start(self) -> None:
        """Populate in a background thread; :meth:`stop` ends it."""
        self._thread = threading.Thread(
            target=self._background, name=f"kvpool-warm-{self.name}", daemon=True
        )
        self._thread.start()

    def _background(self) -> None:
        warmth = self.run()
        if warmth.state == "failed":
            log.error("segment %s: %s; its pages fault in on first touch", self.name, warmth.error)
        elif warmth.state == "warm":
            log.info("segment %s warm: %d bytes faulted in", self.name, warmth.total)

    def stop(self, *, wait: bool = True) -> None:
        """Stop populating (within one chunk); ``wait``: until the thread has ended (it
        never waits for itself).  Idempotent."""
        self._stop.set()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


def populate(mapping: mmap.mmap, *, owner: bool) -> None:
    """Map every page of ``mapping`` now, so later copies do not page-fault.

    A failure is :class:`NoSpace` for the owner (now, not a SIGBUS on some later write);
    a process attaching only logs it and keeps the lazy mapping (the owner's pages exist;
    only its own page tables are missing).
    """
    warmth = Warmer(mapping).run()
    if warmth.state == "failed":
        if owner:
            raise NoSpace(warmth.error)
        log.warning("shared memory not populated (%s): pages fault lazily", warmth.error)

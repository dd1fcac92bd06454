"""Saves off the engine step: pages copied into the connector's staging, put by one thread.

``wait_for_save`` copies each page into a staging slot (a memcpy), queues it and returns; a
writer thread puts batches in order.  Once copied the bytes are the connector's, so vLLM
may free, reuse or preempt the blocks at once: no block is held past its step (a held one
would not survive a preemption, which frees blocks without asking the connector).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SaveBatch", "SaveQueue"]

_NICE = 10  # the writer thread's niceness


@dataclass(slots=True)
class SaveBatch:
    """One pool call's worth of a save: ``keys[i]``'s object is ``parts[i]`` (staging
    views), ``pages`` the staging slots it holds."""

    save_id: int  # one per SaveSpec: a failure skips the rest of the same save
    req_id: str
    keys: list[str]
    parts: list[list[Any]]
    parents: list[str | None]
    pages: list[int]
    group: int = 0  # the KV cache group the pages are of (its position)


# Rules:
# - The staging is `capacity` page slots; a queued batch holds its slots until its put
#   ends, so the slots bound both the memory and the queue.  A step that finds too few
#   free slots waits for the writer (counted as save_waits): nothing is dropped.
# - A put that fails is counted (save_errors) and the later batches of the same save are
#   skipped (skipped_blocks): their chain hangs off the failed chunk.  Engines store an
#   object whole or not at all, so a failed or skipped save is a future miss, never bytes
#   a reader could take for a hit.
# - close() takes no more batches, lets the writer finish for at most drain_s, then drops
#   what is still queued (counted and logged).
class SaveQueue:
    """Bounded page staging and the writer thread that empties it."""

    def __init__(
        self,
        host: np.ndarray[Any, Any],
        *,
        write: Callable[[SaveBatch], bool],
        counters: Counter[str],
        lock: threading.Lock,
        logger: logging.Logger,
    ) -> None:
        """``host``: the staging, ``[capacity, ...]`` one page per row; ``write`` puts a
        batch and says whether the rest of its save may go on; ``counters`` (under
        ``lock``) are the worker's."""
        import torch

        self.host = host
        # the same memory as a CPU tensor: an engine that registers big CPU tensors
        # (Mooncake, from 16 MiB) then puts the staging in place
        self.tensor = torch.from_numpy(host)
        self.capacity = len(host)
        self._write = write
        self._counters = counters
        self._counters_lock = lock
        self._log = logger
        self._cv = threading.Condition()
        self._free = list(range(self.capacity))
        self._queue: deque[SaveBatch] = deque()
        self._busy = False  # the writer holds a batch
        self._unsaved: Counter[str] = Counter()  # batches queued or being put, per request
        self.finished = 0  # batches the writer is done with (put, failed or skipped)
        self._closed = False
        self._failed_save = -1  # the save whose put failed: its later batches are skipped
        self._thread = threading.Thread(target=self._run, name="kvpool-store-save", daemon=True)
        self._thread.start()

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += n

    def acquire(self, n: int) -> list[int] | None:
        """``n`` (at most ``capacity``) free page slots, lowest first, waiting for the
        writer when there are fewer; None once closed (the caller saves in the step)."""
        with self._cv:
            if len(self._free) < n and not self._closed:
                self._count("save_waits")
                self._cv.wait_for(lambda: len(self._free) >= n or self._closed)
            if self._closed:
                return None
            self._free.sort()
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def runs(self, pages: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(first index in pages, first slot, count)`` of each run of consecutive slots:
        one gather per run."""
        out: list[tuple[int, int, int]] = []
        for i, page in enumerate(pages):
            if out and out[-1][1] + out[-1][2] == page:
                j, first, count = out[-1]
                out[-1] = (j, first, count + 1)
            else:
                out.append((i, page, 1))
        return out

    def submit(self, batch: SaveBatch) -> None:
        with self._cv:
            if self._closed:  # shut down between acquire and submit: give the slots back
                self._free.extend(batch.pages)
                self._count("skipped_blocks", len(batch.pages))
                return
            self._queue.append(batch)
            self._unsaved[batch.req_id] += 1
            self._cv.notify_all()

    def _run(self) -> None:
        # Below the engine's own threads: on a busy host a put should take the CPU the
        # forward pass and sampling leave, not slow them (best effort; Linux only).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._busy = True
            try:
                if batch.save_id == self._failed_save:
                    self._count("skipped_blocks", len(batch.pages))
                elif not self._write(batch):
                    self._failed_save = batch.save_id
            except Exception as exc:  # a bug in a put must not stop later saves
                self._failed_save = batch.save_id
                self._count("save_errors")
                self._log.error("[KVPoolStoreConnector] save of %s crashed: %s", batch.req_id, exc)
            finally:
                with self._cv:
                    self._free.extend(batch.pages)
                    self._busy = False
                    self._unsaved -= Counter({batch.req_id: 1})  # drops what reaches 0
                    self.finished += 1
                    self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Batches queued or being put."""
        with self._cv:
            return len(self._queue) + int(self._busy)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued batch is put; False at the timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def wait_saved(self, req_ids: Sequence[str], timeout_s: float) -> bool:
        """Wait until no batch of ``req_ids`` is queued or being put (put or failed);
        False at the timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not any(r in self._unsaved for r in req_ids), timeout_s
            )

    def close(self, drain_s: float) -> bool:
        """Finish what is queued within ``drain_s``, then drop the rest; whether the
        writer is done.  A put still in progress is left to end on its own (a daemon
        thread): the caller must not wait on its connection."""
        drained = self.wait_idle(drain_s)
        with self._cv:
            self._closed = True
            dropped = sum(len(b.pages) for b in self._queue)
            self._queue.clear()
            self._unsaved.clear()
            self._cv.notify_all()
        if dropped:
            self._count("skipped_blocks", dropped)
            self._log.warning(
                "[KVPoolStoreConnector] shutdown: %d queued pages not saved (a future miss)",
                dropped,
            )
        if drained:
            self._thread.join(drain_s)
        return drained

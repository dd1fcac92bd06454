"""Storage a process contributes to the pool: a shared-memory segment, an optional SSD
tier, and the data server that lets clients read and write them directly.

Used by ``kvpool master`` (its embedded segment, the single-command default) and by
``kvpool node``.  The master never carries object bytes: clients reach this data server
over TCP, or attach the segment's shared memory when they share the host.

The SSD tier outlives processes: whoever owns it announces what it holds to the index
when it (re)joins one -- the master at start-up, a node at each registration -- from
the files' headers alone (:meth:`LocalStorage.announce_ssd`); what the index refuses is
deleted so its space does not leak.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpool.core.index import Demote
from kvpool.errors import ChecksumMismatch, KVPoolError, ProtocolError
from kvpool.storage.segment import Segment, remove_stale_segments
from kvpool.storage.ssd import SsdStore
from kvpool.transfer.segment_server import SegmentServer
from kvpool.transfer.shm import host_token

__all__ = [
    "RESTORE_BATCH",
    "RESTORE_BATCH_BYTES",
    "LocalStorage",
    "RestoreEntry",
    "SsdRestored",
    "restore_batches",
    "restore_in_batches",
]

log = logging.getLogger("kvpool.storage")

# Entries per Restore message, and their keys' bytes.  An entry is a key and three
# integers; the byte bound keeps a batch of long keys under 1 MiB -- well inside the
# codec's 4 MiB frame limit, and one message never stalls the master's loop for long.
RESTORE_BATCH = 4096
RESTORE_BATCH_BYTES = 1 << 20
_ENTRY_OVERHEAD = 32  # msgpack for the three integers and the tuple, at most

RestoreEntry = tuple[str, int, int, int]  # key, offset, size, checksum (as in m.Restore)


def restore_batches(
    entries: list[RestoreEntry], batch: int = RESTORE_BATCH
) -> Iterator[list[RestoreEntry]]:
    """``entries`` in slices of at most ``batch`` entries and about
    :data:`RESTORE_BATCH_BYTES` of keys."""
    chunk: list[RestoreEntry] = []
    size = 0
    for entry in entries:
        cost = len(entry[0].encode()) + _ENTRY_OVERHEAD
        if chunk and (len(chunk) >= batch or size + cost > RESTORE_BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += cost
    if chunk:
        yield chunk


def restore_in_batches(
    entries: list[RestoreEntry],
    send: Callable[[list[RestoreEntry]], list[bool]],
    batch: int = RESTORE_BATCH,
) -> list[bool]:
    """Announce ``entries`` through ``send`` (one Restore each) in bounded slices
    (:func:`restore_batches`); the index's answer per entry."""
    accepted: list[bool] = []
    for chunk in restore_batches(entries, batch):
        answer = send(chunk)
        if len(answer) != len(chunk):
            raise ProtocolError(f"{len(answer)} answers to a Restore of {len(chunk)} objects")
        accepted.extend(answer)
    return accepted


@dataclass(frozen=True, slots=True)
class SsdRestored:
    """What :meth:`LocalStorage.announce_ssd` did."""

    restored: int = 0
    restored_bytes: int = 0
    dropped: int = 0  # files deleted: a header that failed its check, or refused


class LocalStorage:
    """One memory segment (+ SSD tier) owned by this process, served over TCP and shm."""

    def __init__(
        self,
        client_id: str,
        segment_size: int,
        *,
        host: str = "127.0.0.1",
        data_port: int = 0,
        ssd_path: str = "",
        ssd_limit: int = 0,
        timeout_s: float = 10.0,
    ) -> None:
        self.client_id = client_id
        self.segment_id = f"{client_id}/mem"
        self.ssd_segment_id = f"{client_id}/ssd"
        if segment_size:
            remove_stale_segments()  # what a SIGKILLed predecessor left in /dev/shm
        self.segment = Segment.create(segment_size) if segment_size else None
        # The index enforces the limit on value bytes; the store's own cap only guards
        # against accounting bugs, so it leaves room for per-file headers.
        self.ssd = (
            SsdStore.open(ssd_path, ssd_limit + ssd_limit // 100 + (1 << 20))
            if ssd_path and ssd_limit
            else None
        )
        self.ssd_limit = ssd_limit if self.ssd is not None else 0
        self.host_token = host_token()
        self.server = SegmentServer(
            host, data_port, timeout_s=timeout_s, host_token=self.host_token, ssd=self.ssd
        )
        if self.segment is not None:
            self.server.add_segment(self.segment_id, self.segment)
        self.data_address = ""

    def start(self) -> str:
        host, port = self.server.start()
        self.data_address = f"{host}:{port}"
        return self.data_address

    @property
    def shm_name(self) -> str:
        return self.segment.name if self.segment is not None else ""

    def demote(self, event: Demote) -> bool:
        """Copy a memory object to the SSD tier; False (a counted failure) when the bytes
        no longer match their checksum or the disk refuses them."""
        if self.segment is None or self.ssd is None:
            return False
        data = self.segment.view(event.src.offset, event.src.size)
        try:
            self.ssd.put(event.key, data, expect=event.checksum or None)
        except ChecksumMismatch:
            log.warning("not demoting %s: its bytes changed under it", event.key)
            return False
        except KVPoolError as exc:
            log.warning("demotion of %s failed: %s", event.key, exc)
            return False
        return True

    def announce_ssd(
        self,
        send: Callable[[list[RestoreEntry]], list[bool]],
        batch: int = RESTORE_BATCH,
    ) -> SsdRestored:
        """Announce the SSD tier's intact objects to an index that does not know them.

        Headers only are read (:meth:`SsdStore.scan`); a file whose header fails its check
        is deleted, never announced.  Objects the index refuses (already present
        elsewhere, over capacity) are deleted too, so their space does not leak.
        """
        if self.ssd is None:
            return SsdRestored()
        scan = self.ssd.scan()
        entries = [(key, 0, size, csum) for key, size, csum in scan.entries]
        accepted = restore_in_batches(entries, send, batch)
        restored = restored_bytes = 0
        for (key, _, size, _), ok in zip(entries, accepted, strict=True):
            if ok:
                restored += 1
                restored_bytes += size
            else:
                with contextlib.suppress(OSError):  # an undeletable file stays a miss
                    self.ssd.remove(key)
        done = SsdRestored(restored, restored_bytes, scan.dropped + len(entries) - restored)
        log.info(
            "restored %d SSD objects (%d bytes), dropped %d",
            done.restored,
            done.restored_bytes,
            done.dropped,
        )
        return done

    def forget_ssd(self, key: str) -> None:
        if self.ssd is not None:
            self.ssd.remove(key)

    def close(self) -> None:
        self.server.close()
        if self.segment is not None:
            self.segment.close()

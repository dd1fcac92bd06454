"""Storage a process contributes to the pool: a shared-memory segment, an optional SSD
tier, and the data server that lets clients read and write them directly, in ``kvpool
master`` (its own segment, the single-command default) and in ``kvpool node``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpool.core.objects import Demote
from kvpool.datapath.segment_server import SegmentServer
from kvpool.datapath.shm import host_token
from kvpool.errors import ChecksumMismatch, ConfigError, KVPoolError, NoSpace, ProtocolError
from kvpool.security.peer import PLAIN_SERVE, ServeSettings
from kvpool.storage.pages import Warmth
from kvpool.storage.segment import SHM_DIR, Segment, remove_stale_segments
from kvpool.storage.ssd import SsdStore
from kvpool.tenancy.grants import tenant_check

__all__ = [
    "MASTER_SETTINGS",
    "RESTORE_BATCH",
    "RESTORE_BATCH_BYTES",
    "LocalStorage",
    "RestoreEntry",
    "SettingNames",
    "SsdRestored",
    "check_shm_space",
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
class SettingNames:
    """How the owner's configuration names the settings a start-up error is about; the
    defaults are a node's (mooncake.json keys and ``kvpool node``'s flag)."""

    segment: str = "global_segment_size"
    ssd: str = "ssd_offload_path"
    data_port: str = "--data-port"


#: the master's names (its embedded segment's data port has no flag: any free port)
MASTER_SETTINGS = SettingNames("--segment_size", "--ssd_offload_path", "data port")


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_shm_space(size: int, setting: str, directory: str = str(SHM_DIR)) -> None:
    """ConfigError, before anything is allocated, when ``directory`` (``/dev/shm``) has
    less than ``size`` bytes free: Docker gives a container 64 MiB unless told."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot look at {directory}: {exc}") from None
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ConfigError(_shm_fix(size, setting, f"{directory} has {_human(free)} free"))


def _shm_fix(size: int, setting: str, why: str) -> str:
    return (
        f"{setting} {_human(size)} does not fit: {why}; lower {setting}, or give this "
        "container more shared memory (Docker Compose: shm_size, e.g. shm_size: 16gb, or "
        "ipc: host; docker run --shm-size)"
    )


@dataclass(frozen=True, slots=True)
class SsdRestored:
    """What :meth:`LocalStorage.announce_ssd` did."""

    restored: int = 0
    restored_bytes: int = 0
    dropped: int = 0  # files deleted: a header that failed its check, or refused


def _port_fix(host: str, port: int, setting: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{setting} {port}: {host}:{port} is already in use (another kvpool running?); "
            f"stop it or choose another {setting}"
        )
    return f"{setting} {port}: cannot listen on {host}:{port} ({_reason(exc)})"


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


# What is set up when: the data port is bound first, then the SSD tier is opened, then the
# free space of ``/dev/shm`` is checked against the segment, and only then is the segment
# allocated -- its memory committed (``posix_fallocate``) whatever the warm-up mode, so a
# tmpfs too small is refused here, never a SIGBUS on a later write -- and then warmed
# (its pages faulted in: now with ``sync``, in a thread with ``background``).  So a busy
# port, an unusable SSD path or a small ``/dev/shm`` is a one-line
# :class:`~kvpool.errors.ConfigError` naming the setting and its fix, with nothing left
# behind (a failure part-way closes what was set up).  The settings are named as the
# process's own configuration spells them (:class:`SettingNames`).
#
# The SSD tier outlives processes: whoever owns it announces what it holds to the index
# when it (re)joins one -- the master at start-up, a node at each registration -- from
# the files' headers alone (:meth:`LocalStorage.announce_ssd`); what the index refuses is
# deleted so its space does not leak.
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
        names: SettingNames = SettingNames(),
        serve: bool = True,
        listen: ServeSettings = PLAIN_SERVE,
        warmup: str = "background",
    ) -> None:
        """``serve=False``: an in-process pool that never starts the data server, so no
        port is bound for it (:meth:`start` would bind one then).  ``listen``: how the
        data port admits peers (timeout, credential, TLS); it proves itself as
        ``client_id``.  ``warmup``: when the segment's pages are faulted in
        (:data:`~kvpool.config.values.WARMUP_MODES`)."""
        self.client_id = client_id
        self.segment_id = f"{client_id}/mem"
        self.ssd_segment_id = f"{client_id}/ssd"
        self.host_token = host_token()
        self.server = SegmentServer(
            host,
            data_port,
            timeout_s=listen.timeout_s,
            host_token=self.host_token,
            credential=listen.credential,
            server_id=client_id,
            tls=listen.tls,
            tenants=tenant_check,  # a tenant's connections: each request with its grant
        )
        try:
            if serve:
                self.server.bind()
        except OSError as exc:
            raise ConfigError(_port_fix(host, data_port, names.data_port, exc)) from None
        try:
            self.ssd = self._open_ssd(ssd_path, ssd_limit, names.ssd)
            self.server.ssd = self.ssd
            self.segment = self._create_segment(segment_size, names.segment, warmup)
        except BaseException:
            self.server.close()
            raise
        self.ssd_limit = ssd_limit if self.ssd is not None else 0
        if self.segment is not None:
            self.server.add_segment(self.segment_id, self.segment)
        self.data_address = ""

    @staticmethod
    def _open_ssd(path: str, limit: int, setting: str) -> SsdStore | None:
        if not (path and limit):
            return None
        # The index enforces the limit on value bytes; the store's own cap only guards
        # against accounting bugs, so it leaves room for per-file headers.
        try:
            return SsdStore.open(path, limit + limit // 100 + (1 << 20))
        except ConfigError as exc:  # it names the mooncake.json key; say the caller's
            raise ConfigError(str(exc).replace("ssd_offload_path", setting, 1)) from None

    @staticmethod
    def _create_segment(size: int, setting: str, warmup: str) -> Segment | None:
        if not size:
            return None
        remove_stale_segments()  # what a SIGKILLed predecessor left in /dev/shm
        check_shm_space(size, setting)
        try:
            segment = Segment.create(size, populate=warmup == "sync")
        except NoSpace as exc:  # the space went between the check and the allocation
            raise ConfigError(_shm_fix(size, setting, str(exc))) from None
        if warmup == "background":
            segment.warm_in_background()
        return segment

    def start(self) -> str:
        host, port = self.server.start()
        self.data_address = f"{host}:{port}"
        return self.data_address

    @property
    def warmth(self) -> Warmth | None:
        """How far the memory segment's pages are faulted in (None: no segment)."""
        return self.segment.warmth if self.segment is not None else None

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

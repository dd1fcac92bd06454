"""``kvpool node``: a storage node that contributes a memory segment to the pool.

It registers, adds its segment, heartbeats, and keeps a catalog to re-announce to a
master that restarted.  Data never passes through the master: clients use the node's
segment directly, over TCP or its shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvpool.client.client import Client
from kvpool.config import NodeConfig
from kvpool.errors import ConfigError, KVPoolError, UnknownClient
from kvpool.node.storage import LocalStorage, RestoreEntry, restore_in_batches
from kvpool.protocol import messages as m
from kvpool.security.credentials import Credential
from kvpool.security.peer import ServeSettings
from kvpool.security.secret import load_credential, require_credential
from kvpool.security.tls import TLSConfig
from kvpool.storage.checksum import checksum

__all__ = ["NodeService", "node_id", "run_node"]

log = logging.getLogger("kvpool.node")


_ID_FILE = ".kvpool-node-id"
# A noted write whose put never ended is forgotten after this long: far past the
# master's writer TTL (30 s by default), after which that put can no longer end.
NOTED_MAX_AGE_S = 300.0
_VALID_ID = re.compile(r"^node-[A-Za-z0-9._:-]{1,120}$")


def node_id(hostname: str, ssd_path: str = "") -> str:
    """This node's client id: new for each run, unless it has an SSD tier.

    The SSD files outlive the process, and the index files them under the owner's id: a
    node restarted on the same SSD directory keeps its id (kept in the directory), so
    the master sees the same owner come back (and drops what its previous run held in
    memory) instead of a stranger announcing keys the old registration still lists.
    """
    fresh = f"node-{hostname}-{uuid.uuid4().hex[:8]}"
    if not ssd_path:
        return fresh
    path = Path(ssd_path) / _ID_FILE
    with contextlib.suppress(OSError, UnicodeDecodeError):
        saved = path.read_text().strip()
        if _VALID_ID.match(saved):
            return saved
    with contextlib.suppress(OSError):  # an unusable path is reported by the SSD tier
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fresh + "\n")
    return fresh


# At each registration -- its first, and whenever the master answers a heartbeat with
# UnknownClient (it restarted, or dropped us) -- the node announces what it holds: its
# memory catalog, every entry re-checked against its checksum first, and its SSD tier,
# whose files carry their checksum in their headers (so a warm SSD cache outlives a master
# restart, and a restart of the node).  What the master refuses is dropped here, SSD files
# deleted, so no space leaks.  Announcements go in bounded batches, so a large catalog
# never builds one huge frame.
#
# Credentials: the config's ``secret_file``, else ``KVPOOL_SECRET_FILE`` /
# ``KVPOOL_SECRET``.  With one, the node proves its node key to the master (role ``node``)
# and its data port admits only peers that prove the same key; a node credential
# (``kvpool-node:ID:...``) fixes the node's id to the one it names.  Without one, a node
# whose data port would listen beyond loopback refuses to start unless ``insecure``.
class NodeService:
    """A node's storage plus its registration and heartbeat with the master."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        bind_host: str = "",
        data_port: int = 0,
        on_fatal: Callable[[ConfigError], None] | None = None,
        credential: Credential | None = None,
        insecure: bool = False,
    ) -> None:
        """``credential`` None: the config's ``secret_file`` or the environment's."""
        self.config = config
        #: told when the heartbeat loop meets an error no retry can mend, and stops
        self.on_fatal = on_fatal
        if credential is None:
            credential = load_credential(config.secret_file, os.environ, key="secret_file")
        self.credential = credential
        host = bind_host or config.local_hostname
        bind_key = "--bind" if bind_host else "local_hostname"
        require_credential(host, credential, insecure, key=bind_key)
        ssd = config.enable_ssd_offload
        self.client_id = node_id(config.local_hostname, config.ssd_offload_path if ssd else "")
        if credential is not None and credential.is_tenant:
            raise ConfigError(
                f"secret_file: this is tenant {credential.tenant}'s credential, a client's; "
                "a node needs its own (kvpool secret node-key --node-id node-<name>) or the "
                "cluster secret"
            )
        if credential is not None and not credential.is_cluster:
            if not _VALID_ID.match(credential.node_id):
                raise ConfigError(
                    f"secret_file: the node credential names {credential.node_id!r}, not a "
                    "node id (node-<name>); make one for node-<name>"
                )
            self.client_id = credential.node_id  # the credential is this id's, and only its
        # off unless tls_* (or KVPOOL_TLS_*) are set
        tls = TLSConfig(config.tls_cert, config.tls_key, config.tls_ca, prefix="tls_")
        if not tls.enabled:
            tls = TLSConfig.from_env()
        self.storage = LocalStorage(
            self.client_id,
            config.global_segment_size,
            host=bind_host or config.local_hostname,
            data_port=data_port,
            ssd_path=config.ssd_offload_path if ssd else "",
            ssd_limit=config.ssd_offload_limit if ssd else 0,
            listen=ServeSettings(
                config.timeouts.transfer_timeout_ms / 1000, credential, tls.server_context()
            ),
            warmup=config.segment_warmup,
        )
        self.master = Client(
            config.master_address,
            timeout_s=config.timeouts.connect_timeout_ms / 1000,
            client_id=self.client_id,
            credential=credential,
            role="node",
            tls=tls.client_context(),
        )
        self.catalog: dict[str, tuple[int, int, int]] = {}  # key -> offset, size, checksum
        # Tagged writes not in the catalog yet: key -> offset, size, checksum, when.  The
        # master acknowledges such a put without waiting for our confirmation (PutEnd
        # noted), so these are announced with the catalog to a master that restarted.
        # The heartbeat moves one into the catalog when the master's add comes; one
        # whose put never ended ages out (its bytes may be overwritten by then: every
        # announced entry is checked against its checksum first).
        self.noted: dict[str, tuple[int, int, int, float]] = {}
        self._noted_lock = threading.Lock()
        self.storage.server.on_write = self._note
        self.heartbeat_s = 1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registrations = 0
        self._register_pending = False
        self._announce_pending = False
        self._warmth_said: tuple[str, int] | None = None  # what the master last heard

    # ------------------------------------------------------------------------- lifetime
    def start(self) -> str:
        address = self.storage.data_address or self.storage.start()
        self._register()
        self._thread = threading.Thread(
            target=self._loop, name="kvpool-node-heartbeat", daemon=True
        )
        self._thread.start()
        log.info(
            "kvpool node %s listening on %s, segment %d bytes, master %s",
            self.client_id,
            address,
            self.config.global_segment_size,
            self.config.master_address,
        )
        return address

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.master.close()
        self.storage.close()

    # ---------------------------------------------------------------------------- master
    def _register(self) -> None:
        # until the segments are added, every heartbeat registers again (the master drops
        # a half-registered previous attempt), rather than heartbeating an empty owner
        self._register_pending = True
        st = self.storage
        reply = self.master.call(m.Register(self.client_id, st.data_address, st.host_token))
        assert isinstance(reply, m.RegisterReply)
        self.heartbeat_s = max(0.05, reply.heartbeat_interval_ms / 1000)
        assert st.segment is not None
        warmth = st.segment.warmth
        # with a catalog to re-announce, new puts wait until it is (_restore says done)
        self.master.call(
            m.AddSegment(
                self.client_id,
                st.segment_id,
                st.segment.size,
                "memory",
                st.shm_name,
                restoring=bool(self.catalog or self.noted),
                warm=warmth.state,
                warmed=warmth.warmed,
            )
        )
        self._warmth_said = (warmth.state, warmth.warmed)
        if st.ssd is not None:
            self.master.call(m.AddSegment(self.client_id, st.ssd_segment_id, st.ssd_limit, "ssd"))
        self.registrations += 1
        self._register_pending = False
        self._announce_pending = True
        try:
            self._announce()
        except KVPoolError as exc:  # registered all the same: the heartbeat loop retries
            log.warning("re-announcing to the master failed part-way: %s (retrying)", exc)

    def _announce(self) -> None:
        """Tell a master that does not know this node (it restarted, or this node did)
        what it holds: the SSD tier, then the memory catalog.  SSD first: a key demoted
        just before the master died may still be listed in the catalog (the heartbeat
        that would have removed it never came), and the SSD copy is the one the index
        last held.  If this fails part-way the next heartbeat tries again; the index
        accepts the same announcement twice."""
        if self.storage.ssd is not None:
            self.storage.announce_ssd(self._send_restore(self.storage.ssd_segment_id))
        if self.catalog or self.noted:
            self._restore()
        self._announce_pending = False

    def _send_restore(self, segment_id: str) -> Callable[[list[RestoreEntry]], list[bool]]:
        def send(batch: list[RestoreEntry]) -> list[bool]:
            reply = self.master.call(m.Restore(self.client_id, segment_id, batch))
            assert isinstance(reply, m.Bools)
            return reply.values

        return send

    def _restore(self) -> None:
        """Re-announce intact memory objects to a master that forgot them."""
        st = self.storage
        assert st.segment is not None
        with self._noted_lock:
            known = {key: entry[:3] for key, entry in self.noted.items()}
        known.update(self.catalog)  # the master's add is the last word on a key
        intact = [
            (key, off, size, csum)
            for key, (off, size, csum) in known.items()
            if checksum(st.segment.view(off, size)) == csum
        ]
        accepted = restore_in_batches(intact, self._send_restore(st.segment_id))
        # done: the segment takes new puts (placed before now, one could have taken the
        # extent of an object not announced yet, and that object would have been lost)
        self.master.call(m.Restore(self.client_id, st.segment_id, [], done=True))
        kept = {key for (key, *_), ok in zip(intact, accepted, strict=True) if ok}
        self.catalog = {k: v for k, v in known.items() if k in kept}
        with self._noted_lock:
            for key in known:
                self.noted.pop(key, None)  # announced: in the catalog now, or refused
        log.info("re-announced %d of %d objects to the master", len(kept), len(intact))

    def _note(self, segment_id: str, key: str, offset: int, size: int, csum: int) -> None:
        """A tagged write landed in our memory segment (a data-server thread)."""
        if segment_id != self.storage.segment_id:
            return
        with self._noted_lock:
            self.noted[key] = (offset, size, csum, time.monotonic())

    def heartbeat_once(self) -> bool:
        """One heartbeat; True when its reply carried catalog changes (the next
        heartbeat, sent at once, tells the master they are applied)."""
        if self._register_pending:
            self._register()
            return False
        news = self._warmth_news()
        try:
            reply = self.master.call(m.Heartbeat(self.client_id, news))
        except UnknownClient:
            log.warning("the master does not know this node (restarted?): registering again")
            self._register()
            return False
        assert isinstance(reply, m.HeartbeatReply)
        if news:
            self._warmth_said = (news[0][1], news[0][2])
        with self._noted_lock:
            noted = self.noted
            for key, _segment, offset, size, csum in reply.added:
                self.catalog[key] = (offset, size, csum)
                noted.pop(key, None)
            for key in reply.removed:
                self.catalog.pop(key, None)
                noted.pop(key, None)
            if noted:
                too_old = time.monotonic() - NOTED_MAX_AGE_S
                for key in [k for k, entry in noted.items() if entry[3] < too_old]:
                    del noted[key]
        if self._announce_pending:
            self._announce()
        return bool(reply.added or reply.removed)

    def _warmth_news(self) -> list[m.WarmthReport]:
        """The memory segment's warmth, when it changed since the master last heard it."""
        st = self.storage
        if st.segment is None:
            return []
        warmth = st.segment.warmth
        if (warmth.state, warmth.warmed) == self._warmth_said:
            return []
        return [(st.segment_id, warmth.state, warmth.warmed)]

    def _loop(self) -> None:
        # The master holds a heartbeat until it has changes for us or its interval
        # passed (a long poll): puts into our segment are answered once we confirm.
        wait = self.heartbeat_s
        while not self._stop.wait(wait):
            started = time.monotonic()
            changed = False
            try:
                changed = self.heartbeat_once()
            except ConfigError as exc:
                log.error("%s", exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return
            except KVPoolError as exc:
                log.warning("heartbeat failed: %s (retrying)", exc)
            spent = time.monotonic() - started
            wait = 0.0 if changed else max(0.0, self.heartbeat_s - spent)


# A master that is unreachable is retried every second, at start and in the heartbeat
# loop (it may start later, or restart).  A :class:`~kvpool.errors.ConfigError` is not
# retried: the address is another engine's master
# (:func:`~kvpool.client.master_link.foreign_master`), which no wait will change, so
# :func:`run_node` stops with it (the CLI prints its one line and exits 2).
def run_node(
    config: NodeConfig, *, bind_host: str = "", data_port: int = 0, insecure: bool = False
) -> int:
    """Serve until a signal; raises the ConfigError that stopped it, if one did."""
    done = threading.Event()
    fatal: list[ConfigError] = []

    def stop_with(exc: ConfigError) -> None:
        fatal.append(exc)
        done.set()

    node = NodeService(
        config, bind_host=bind_host, data_port=data_port, on_fatal=stop_with, insecure=insecure
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while True:
        try:
            node.start()
            break
        except ConfigError:
            node.stop()
            raise
        except KVPoolError as exc:
            log.warning("cannot register with the master at %s: %s", config.master_address, exc)
            if done.wait(1.0):
                node.stop()
                return 0
    done.wait()
    node.stop()
    if fatal:
        raise fatal[0]
    log.info("kvpool node stopped")
    return 0

"""The ``mooncake`` engine: real Mooncake Store (``mooncake.store.MooncakeDistributedStore``)
as a pool engine; how it keeps the engine rules on Mooncake is on :class:`MooncakeEngine`."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.config.node import read_node_json
from kvpool.engines.base import MISS, BatchMoves
from kvpool.errors import ConfigError, KVPoolError, NoSpace, ObjectBusy, TransferError
from kvpool.mooncake.buffers import Registered, Staging
from kvpool.mooncake.ha import CLUSTER_ENV, cluster_id, master_view_key, read_master_view
from kvpool.mooncake.parts import HEADER_SIZE, Layout
from kvpool.mooncake.settings import (
    MooncakeNodeConfig,
    parse_mooncake_config,
    parse_mooncake_master,
)
from kvpool.mooncake.wheel import INSTALL_HINT
from kvpool.net import http_get, split_address

__all__ = [
    "HEADER_SIZE",
    "MOONCAKE_CODES",
    "MooncakeEngine",
    "open_mooncake_engine",
    "put_error",
]

#: Mooncake Store's error codes that kvpool meets (mooncake-store/include/types.h)
MOONCAKE_CODES: dict[int, str] = {
    -200: "no available handle (the pool is full)",
    -600: "invalid parameters (a buffer too small?)",
    -704: "object not found",
    -705: "object already exists",
    -706: "object has a lease",
    -707: "lease expired",
    -800: "transfer failed",
    -801: "checksum mismatch",
    -900: "RPC failed",
}
_NO_HANDLE = -200
_NOT_FOUND = -704
_HAS_LEASE = -706

_FIRST_CHUNK = 4  # prefix_lookup's first probe: most lookups end within a few RPCs


def put_error(code: int, key: str) -> KVPoolError | None:
    """A put's Mooncake code as kvpool's per-key result."""
    if code >= 0 or code == -705:  # an object already there is a harmless success
        return None
    what = MOONCAKE_CODES.get(code, "unknown error")
    if code == _NO_HANDLE:
        return NoSpace(f"{key}: Mooncake has no room ({what})")
    return TransferError(f"{key}: Mooncake put failed with {code} ({what})")


def open_mooncake_engine(
    *, mooncake: MooncakeNodeConfig | None, timeout_s: float, replica_num: int = 0, **_: object
) -> MooncakeEngine:
    """:func:`kvpool.engines.open_engine`'s ``"mooncake"``: Mooncake Store as ``mooncake``
    says (default: the node config that KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH names)."""
    if mooncake is None:
        data, source = read_node_json()
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        mooncake = parse_mooncake_config(data, source=source)
    return MooncakeEngine(mooncake, timeout_s=timeout_s, replica_num=replica_num)


class MooncakeEngine(BatchMoves):
    """Real Mooncake Store as a :class:`~kvpool.engines.base.PoolEngine`.

    The pool of a cluster that already runs Mooncake: a C++ ``mooncake_master`` keeps the
    index, and every process that opens the store with ``global_segment_size > 0``
    contributes that much memory (the guide's "every node registers memory").  The store
    comes from the optional ``mooncake`` extra (``pip install 'kvpool[mooncake]'``; the
    non-CUDA wheel here, the CUDA or NPU wheel on a real cluster).  Configured from the
    ``mooncake.json`` Mooncake and vllm-ascend write
    (:class:`~kvpool.mooncake.settings.MooncakeNodeConfig`).

    How the adapter keeps :mod:`kvpool.engines.base`'s rules on Mooncake:

    - *Checksums.*  Mooncake returns whatever bytes a segment holds.  Each object is stored
      as a 16-byte header (magic, xxh3-64 of the payload) followed by the payload; a read
      whose header or checksum does not match is a miss, never wrong bytes.  Objects are
      therefore kvpool's own: Mooncake's other clients see the header.
    - *Buffers.*  Mooncake moves bytes only to and from memory registered with
      ``register_buffer`` (:mod:`.buffers`).  Pages of a big CPU tensor (a vLLM KV
      cache) are registered in place once and moved zero-copy: an object is 1 + L pieces,
      its header from the staging area, then each part (one layer's block) where it is
      (:mod:`.parts`), as vllm-ascend's Mooncake backend does with
      ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``; other parts are
      copied through one registered staging area.  One call per batch.  A get in place
      lands before its checksum is known: a miss leaves those parts unspecified, and the
      store connector reports the block failed (vLLM recomputes it).
    - *Errors.*  Mooncake answers integer codes; :func:`put_error` maps them (-200 no handle
      → :class:`~kvpool.errors.NoSpace`, -704 → a miss, ...).
    - *Eviction.*  Mooncake evicts in a background thread, not inside the put: a put into a
      full pool fails (-200) until that thread has run.  Keys refused with -200 are retried
      for at most ``put_retry_s`` (0.2 s) before NoSpace is the answer.
    - *Leases, not pins.*  Mooncake has no pins.  :meth:`pin` and :meth:`release` do nothing
      and answer 0 (:attr:`pins` is False).  What protects a found block on Mooncake is the
      lease its ``is_exist`` took: every probe (and every read) renews the object's lease for
      the master's ``--default_kv_lease_ttl`` (Mooncake #2187: probes that renew leases can
      starve eviction).  So on Mooncake a lookup *does* protect what it found, for one lease
      — a request must start its load within ``default_kv_lease_ttl`` — and a flood of
      lookups keeps objects leased.  :meth:`prefix_lookup` therefore probes in chunks that
      stop at the first miss, so blocks behind a hole are not kept leased.  The lease the
      master needs is in docs/mooncake.md.
    - *Connect.*  Opening is lazy (constructors have no side effects).  Before ``setup`` the
      adapter checks the master's RPC port with one bounded TCP connect (Mooncake's own
      setup retries for ~90 s against nothing), and an HTTP GET that a kvpool master answers
      and a Mooncake RPC port does not: a mooncake.json pointed at kvpool's master is an
      error at connect time that says so.
    - *Mooncake's HA.*  ``master_server_address`` may be ``etcd://host:port[;...]`` for
      masters run with ``--enable_ha``: it goes to Mooncake's client unchanged, which reads
      the leader from etcd and follows the next one by itself.  The checks above then look
      at the leader etcd names (:mod:`.ha`).  A failover loses Mooncake's metadata (op-log
      off, its default): objects put before it are misses afterwards, never wrong bytes.
    """

    engine = "mooncake"
    #: Mooncake has no pins: :meth:`pin` is a no-op (see above)
    pins = False
    #: every probe renews the object's lease for the master's default_kv_lease_ttl
    probes_lease = True

    def __init__(
        self,
        config: MooncakeNodeConfig,
        *,
        timeout_s: float = 10.0,
        put_retry_s: float = 0.2,
        store_factory: Callable[[], Any] | None = None,
        replica_num: int = 0,
    ) -> None:
        self.config = config
        #: copies of each put (Mooncake's ReplicateConfig.replica_num; 0: its default, 1)
        self.replica_num = replica_num
        self.timeout_s = timeout_s
        self.put_retry_s = put_retry_s
        self._factory = store_factory
        self._store: Any = None
        self._staging: Staging | None = None
        self._registered: Registered | None = None
        self._lock = threading.Lock()  # one staging area: one call at a time
        #: objects moved in place / through the staging area, by direction (health())
        self.moved = {"put_in_place": 0, "put_staged": 0, "get_in_place": 0, "get_staged": 0}

    # ------------------------------------------------------------------ connecting
    def _leader(self) -> str:
        """The master to check: ``master_server_address``, or with Mooncake's HA form
        (``etcd://...``) the leader etcd names now, read from the key Mooncake's client
        reads (and then follows by itself: kvpool passes the address on unchanged)."""
        address = self.config.master_server_address
        endpoints = parse_mooncake_master(address, key="master_server_address")
        if not endpoints:
            return address
        cluster = cluster_id(os.environ)
        try:
            view = read_master_view(endpoints, cluster, min(self.timeout_s, 2.0))
        except KVPoolError as exc:
            raise TransferError(f"the etcd of the Mooncake masters {address}: {exc}") from None
        if view is None:
            raise TransferError(
                f"no Mooncake master leads in {address} now ({master_view_key(cluster)} is"
                " absent): the masters are down or between leaders; the masters' --cluster_id"
                f" must be {CLUSTER_ENV}'s ({cluster})"
            )
        return view.leader

    def _connect_master(self) -> str:
        """A bounded TCP connect to the master (the leader, with HA); its address."""
        address = self._leader()
        host, port = split_address(address)
        try:
            socket.create_connection((host, port), timeout=self.timeout_s).close()
        except OSError as exc:
            raise TransferError(
                f"no Mooncake master answers at {address} (master_server_address in"
                f" {self.config.source or 'the config'}): {exc.strerror or exc}"
            ) from None
        return address

    def _check_master(self) -> None:
        address = self._connect_master()
        reply = http_get(f"http://{address}/health", min(self.timeout_s, 2.0))
        if reply.status is not None:
            raise TransferError(
                f"{address} answers HTTP (status {reply.status}): this looks like a kvpool"
                " master, not mooncake_master's RPC port; point master_server_address at"
                " mooncake_master's --rpc_port, or write a kvpool config"
                ' ("metadata_server": "<kvpool master>:50088") to use kvpool\'s engine'
            )

    def _open(self) -> Any:
        if self._store is not None:
            return self._store
        self._check_master()
        if self._factory is not None:
            store = self._factory()
        else:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as exc:
                raise ConfigError(
                    f"engine mooncake: the Mooncake wheel is not installed ({exc}); {INSTALL_HINT}"
                ) from None
            store = MooncakeDistributedStore()
        c = self.config
        rc = store.setup(
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device_name,
            c.master_server_address,
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake setup against {c.master_server_address} failed with {rc}"
                f" ({MOONCAKE_CODES.get(rc, 'see the store log')}); Mooncake needs"
                " global_segment_size 0 or at least 16 MiB"
            )
        self._store, self._staging, self._registered = store, Staging(store), Registered(store)
        return store

    # ---------------------------------------------------------------------- probes
    def _exists(self, keys: Sequence[str]) -> list[int]:
        store = self._open()
        answers = [int(a) for a in store.batch_is_exist(list(keys))]
        if -1 in answers:  # an error, not an answer: is the master still there?
            self._connect_master()
        return answers

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            return [a == 1 for a in self._exists(keys)]

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored, probed in chunks of 4, 8, 16, ... that stop
        at the first miss: every probe leases what it finds, and keys behind a hole are
        of no use to the request, so they are not probed (at most one chunk's worth past
        the hole is).  Probing all keys at once would keep them leased for as long as
        lookups repeat, and a pool full of such keys refuses every put (Mooncake #2187)."""
        found, size = 0, _FIRST_CHUNK
        with self._lock:
            while found < len(keys):
                for answer in self._exists(keys[found : found + size]):
                    if answer != 1:
                        return found
                    found += 1
                size *= 2
        return found

    # ---------------------------------------------------------------------- puts
    def _put_batch(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        parents: Sequence[str | None] | None,
    ) -> list[KVPoolError | None]:
        with self._lock:
            return self._put(list(keys), [list(p) for p in parts])

    def _put(self, keys: list[str], parts: list[list[Any]]) -> list[KVPoolError | None]:
        """One object per key: its header from the staging area, then its parts (each in
        place where registered, else copied into the staging area)."""
        store = self._open()
        assert self._staging is not None and self._registered is not None
        first = {k: i for i, k in reversed(list(enumerate(keys)))}  # a repeat is the first
        todo = sorted(set(first.values()))
        layout = Layout(self._registered, {i: (parts[i], False) for i in todo})
        area, base = self._staging.region(layout.staging_bytes)
        plans = layout.place(area, base, fill=True)
        codes: dict[int, int] = {}
        deadline = time.monotonic() + self.put_retry_s
        extra = self._replicate()
        while todo:
            answers = store.batch_put_from_multi_buffers(
                [keys[i] for i in todo],
                [plans[i].ptrs for i in todo],
                [plans[i].sizes for i in todo],
                *extra,
            )
            for i, rc in zip(todo, answers, strict=True):
                codes[i] = int(rc)
                if rc == 0:
                    self.moved["put_in_place" if plans[i].in_place else "put_staged"] += 1
            # Mooncake evicts in the background: a refused put may fit a moment later.
            todo = [i for i in todo if codes[i] == _NO_HANDLE]
            if not todo or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return [put_error(codes[first[k]], k) for k in keys]

    def _replicate(self) -> tuple[Any, ...]:
        """The put's ReplicateConfig argument, when more than one copy is asked for."""
        if self.replica_num <= 1:
            return ()
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.replica_num
        return (config,)

    # ---------------------------------------------------------------------- gets
    def _get_batch(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        """Each object read into its parts: registered parts in place (bytes land there
        before the checksum is known: a miss leaves them unspecified, as the seam allows),
        the others through the staging area, copied out only once the object checked good."""
        with self._lock:
            self._open()
            assert self._staging is not None and self._registered is not None
            layout = Layout(self._registered, {i: (p, True) for i, p in enumerate(parts)})
            area, base = self._staging.region(layout.staging_bytes)
            plans = layout.place(area, base, fill=False)
            got = self._store.batch_get_into_multi_buffers(
                list(keys), [plans[i].ptrs for i in plans], [plans[i].sizes for i in plans]
            )
            out = [MISS] * len(keys)
            for i, n in zip(plans, got, strict=True):
                plan = plans[i]
                if n != HEADER_SIZE + plan.payload or not plan.intact(area):
                    continue  # missing, another size, a failed transfer, or damaged
                plan.copy_out()
                out[i] = plan.payload
                self.moved["get_in_place" if plan.in_place else "get_staged"] += 1
            return out

    # ------------------------------------------------------------ pins (none here)
    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        """Mooncake has no pins: nothing is pinned, the answer is 0.  The lookup that
        found ``keys`` already leased them for the master's default_kv_lease_ttl."""
        return 0

    def release(self, owner: str) -> int:
        return 0

    # -------------------------------------------------------------------- the rest
    def remove(self, key: str) -> bool:
        with self._lock:
            # force: a corrupt copy must go even while a reader's lease is on it
            rc = int(self._open().remove(key, True))
        if rc == 0:
            return True
        if rc == _NOT_FOUND:
            return False
        if rc == _HAS_LEASE:
            raise ObjectBusy(f"{key}: Mooncake keeps it under a lease")
        raise TransferError(f"{key}: Mooncake remove failed with {rc}")

    def health(self) -> dict[str, Any]:
        """Mooncake's own health_check, and a bounded connect to the master: after the
        master is lost the store still calls itself healthy and answers every probe
        "not found" (reads miss, puts fail with -900 after Mooncake's ~4 s RPC timeout)."""
        with self._lock:
            rc = int(self._open().health_check())
            leader = self._connect_master()
        if rc != 0:
            raise TransferError(
                f"Mooncake store not healthy ({rc}: 1 closed, 2 master unreachable)"
            )
        return {
            "engine": "mooncake",
            "master": self.config.master_server_address,
            "leader": leader,  # the master itself without HA
            "healthy": 1,
            **self.moved,
        }

    def close(self) -> None:
        with self._lock:
            if self._staging is not None and self._registered is not None:
                self._staging.free()
                self._registered.free()
                self._staging = self._registered = None
            if self._store is not None:
                self._store.close()
                self._store = None

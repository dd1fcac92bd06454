"""The pool as the store connector sees it: an engine, the process's shared embedded pool,
and a reconnecting handle (:class:`PoolHandle` turns a dead pool into a fast error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvpool.config.kv_transfer import StoreConfig
from kvpool.config.node import config_path_from_env
from kvpool.engines import PoolEngine, PoolLookups, open_engine
from kvpool.errors import ChecksumMismatch, KVPoolError, PoolError, TransferError
from kvpool.mooncake.settings import MooncakeNodeConfig, load_any_node_config

__all__ = ["ENGINE_OF_BACKEND", "EmbeddedPools", "PoolHandle", "is_outage", "open_pool"]

T = TypeVar("T")
P = TypeVar("P", bound=PoolLookups)
# A pool that stays down is retried at most this far apart (a hung one costs a timeout per
# try, paid by whoever asks: the scheduler, for lookups).
_MAX_WAIT_S = 60.0

#: the engine behind each ``backend`` value: vllm-ascend's ``"mooncake"`` names the shared
#: pool behind a master, which kvpool's master serves here
ENGINE_OF_BACKEND = {"mooncake": "kvpool", "kvpool": "kvpool", "embedded": "embedded"}


class _Serialized:
    """One user's view of a shared engine: each call under the engine's one lock (the
    embedded pool is shared by the scheduler half, the worker half and the worker's loader
    thread of one process), and a ``close`` that leaves the engine open for the others."""

    def __init__(self, pool: PoolEngine, lock: threading.Lock) -> None:
        self._pool = pool
        self._lock = lock
        self.engine = pool.engine

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return self._pool.batch_exists(keys)

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._pool.prefix_lookup(keys)

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        with self._lock:
            return self._pool.batch_put_parts(keys, parts, parents=parents)

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        with self._lock:
            return self._pool.batch_get_parts(keys, parts)

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        with self._lock:
            return self._pool.pin(keys, owner, ttl_ms)

    def release(self, owner: str) -> int:
        with self._lock:
            return self._pool.release(owner)

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._pool.remove(key)

    def health(self) -> dict[str, Any]:
        with self._lock:
            return self._pool.health()

    def close(self) -> None:
        """The shared pool outlives any one user; see :meth:`EmbeddedPools.release`."""


class EmbeddedPools:
    """The embedded pools of this process, by name.

    vLLM builds the scheduler half and the worker half of a connector separately; with
    tensor_parallel_size 1 both live in the engine-core process, and this registry is how
    they find the same in-process pool.  It is the one piece of process-wide state in the
    connector, deliberately: the alternative (a socket between the halves) would make the
    "embedded, no master" backend need a server.
    """

    _lock = threading.Lock()
    _pools: dict[str, tuple[PoolEngine, threading.Lock]] = {}  # noqa: RUF012 - registry

    @classmethod
    def get(cls, name: str, factory: Callable[[], PoolEngine]) -> PoolEngine:
        with cls._lock:
            if name not in cls._pools:
                cls._pools[name] = (factory(), threading.Lock())
            pool, lock = cls._pools[name]
        return _Serialized(pool, lock)

    @classmethod
    def install(cls, pool: PoolEngine, name: str = "default") -> None:
        """Make ``pool`` this process's embedded pool (before vLLM starts): tests wrap the
        real pool this way to watch or damage what the connector stores."""
        with cls._lock:
            if name in cls._pools:
                raise ValueError(f"an embedded pool named {name!r} already exists")
            cls._pools[name] = (pool, threading.Lock())

    @classmethod
    def peek(cls, name: str = "default") -> PoolEngine | None:
        """The pool itself (tests and tools inspect or damage it on purpose)."""
        with cls._lock:
            entry = cls._pools.get(name)
        return None if entry is None else entry[0]

    @classmethod
    def release(cls, name: str = "default") -> None:
        with cls._lock:
            entry = cls._pools.pop(name, None)
        if entry is not None:
            entry[0].close()


# Opened through kvpool.engines.open_engine; tests pass any object with the engine's
# methods.  backend "mooncake" runs on real Mooncake when the node config is a Mooncake one
# (kvpool.config.node.node_engine), else on kvpool's master.
def open_pool(
    config: StoreConfig, *, timeout_ms: int | None = None, lookups: bool = False
) -> PoolEngine:
    """The engine for ``config.backend`` (a new connection, or the shared embedded pool);
    ``timeout_ms`` overrides ``config.pool_timeout_ms`` (the scheduler's lookups).

    ``lookups``: for the scheduler half, which only asks what the pool holds.  On real
    Mooncake it opens the store as a pure client (``global_segment_size`` 0): memory is
    contributed by the processes that hold KV (the workers, one per rank, as vllm-ascend's
    backend), not once more by each instance's scheduler process."""
    engine = ENGINE_OF_BACKEND[config.backend]
    if engine == "embedded":
        return EmbeddedPools.get(
            "default", lambda: open_engine("embedded", capacity=config.embedded_capacity)
        )
    timeout_s = (timeout_ms or config.pool_timeout_ms) / 1000
    if config.backend == "mooncake":
        node = load_any_node_config() if config_path_from_env(os.environ) else None
        if isinstance(node, MooncakeNodeConfig):
            # one Mooncake store per process and use, as vllm-ascend's: each would mount
            # its own global_segment_size and register as its own client
            name = f"mooncake:{node.master_server_address}"
            if lookups:
                node = dataclasses.replace(node, global_segment_size=0)
                name = f"mooncake-lookups:{node.master_server_address}"
            return EmbeddedPools.get(
                name,
                lambda: open_engine(
                    "mooncake", mooncake=node, timeout_s=timeout_s, replica_num=config.replica_num
                ),
            )
    return open_engine(
        engine, master=config.master, timeout_s=timeout_s, replica_num=config.replica_num
    )


def is_outage(exc: BaseException) -> bool:
    """A failure of the pool itself rather than an answer about one object."""
    if isinstance(exc, PoolError | ChecksumMismatch):
        return False
    return isinstance(exc, KVPoolError | OSError | EOFError)


# Opens the pool lazily, turns a dead pool into a fast TransferError for
# reconnect_interval instead of letting every request wait out a timeout, and reconnects
# afterwards; the wait doubles with each outage in a row, up to a minute.  A miss or a full
# pool (NoSpace) is an answer, not an outage, and keeps the connection.
class PoolHandle(Generic[P]):
    """A lazily opened, self-healing pool connection for one thread of use at a time: a
    :class:`~kvpool.engines.PoolEngine` for the worker, :class:`~kvpool.engines.PoolLookups`
    (all that the lookup channel answers) for the scheduler."""

    def __init__(
        self,
        opener: Callable[[], P],
        *,
        reconnect_interval_s: float,
        describe: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._opener = opener
        self._interval = reconnect_interval_s
        self._describe = describe
        self._clock = clock
        self._client: P | None = None
        self._down_until = 0.0
        self._failures = 0  # outages in a row: the wait doubles with each, up to _MAX_WAIT_S
        self._last_error = ""
        self._lock = threading.Lock()

    @property
    def last_error(self) -> str:
        return self._last_error

    def call(self, fn: Callable[[P], T]) -> T:
        """Run ``fn`` on the pool; an outage marks the pool down and re-raises.

        Raises TransferError at once (no network wait) while the pool is marked down.
        """
        with self._lock:
            if self._client is None:
                now = self._clock()
                if now < self._down_until:
                    raise TransferError(
                        f"pool {self._describe} unavailable ({self._last_error}); retrying in"
                        f" {self._down_until - now:.1f}s"
                    )
                try:
                    self._client = self._opener()
                except Exception as exc:
                    self._mark_down(exc)
                    raise TransferError(f"cannot open pool {self._describe}: {exc}") from exc
            client = self._client
            try:
                result = fn(client)
            except Exception as exc:
                if is_outage(exc):
                    self._mark_down(exc)
                raise
            self._failures = 0
            return result

    def open(self) -> bool:
        """Open the pool now if it is not open (a worker at start: on Mooncake this
        mounts the process's ``global_segment_size``, so the memory is in the pool from
        the start, not from the first save or load).  A failure is logged by the caller
        and not held against the pool: the first real call tries again."""
        with self._lock:
            if self._client is None:
                try:
                    client = self._opener()
                    client.health()  # engines open lazily: this is what connects
                except Exception as exc:
                    self._last_error = f"{type(exc).__name__}: {exc}"
                    return False
                self._client = client
            return True

    def _mark_down(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._failures += 1
        wait = min(self._interval * 2 ** (self._failures - 1), max(self._interval, _MAX_WAIT_S))
        self._down_until = self._clock() + wait
        client, self._client = self._client, None
        if client is not None:
            # Closing a broken connection may fail too; it is gone either way.
            with contextlib.suppress(Exception):
                client.close()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

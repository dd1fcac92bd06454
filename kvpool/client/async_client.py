"""The client's asyncio twin: the same operations, awaitable.

Each call runs the blocking client in a worker thread.  That is the whole design, on
purpose: the client's work is I/O that releases the GIL, and a second implementation of
its rules (leases, checksums, misses, failed nodes) over asyncio would have to be kept in
step by hand.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from kvpool.client.client import Client
from kvpool.errors import KVPoolError
from kvpool.net import DEFAULT_MASTER_PORT

__all__ = ["AsyncClient"]

_T = TypeVar("_T")


# Concurrency: the master connection carries one request at a time (the Client serialises
# on it), while data reads and writes of concurrent calls overlap.  Calls run in a private
# thread pool of ``max_workers`` threads so the pool cannot starve the loop's default
# executor.  Cancelling an awaiting task does not interrupt the call already running in
# its thread (it finishes, or fails on its own timeout); the result is dropped.
class AsyncClient:
    """Awaitable put/get/exists/... on a master, or on any Client-like pool.

    ``AsyncClient("127.0.0.1:50088")`` connects like :class:`Client` (keyword arguments go
    to it); ``AsyncClient(client=pool)`` wraps an existing one (an ``EmbeddedPool``), and
    closing the AsyncClient then closes it too.
    """

    def __init__(
        self,
        master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}",
        *,
        client: Client | None = None,
        max_workers: int = 4,
        **client_kwargs: Any,
    ) -> None:
        if client is not None and client_kwargs:
            raise ValueError("pass either client= or Client arguments, not both")
        self.client = client if client is not None else Client(master, **client_kwargs)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="kvpool-async")
        self._closed = False

    async def _run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self._closed:
            raise KVPoolError("this AsyncClient is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------------------ writes
    async def put(
        self, key: str, value: Any, *, parent: str | None = None, replica_num: int | None = None
    ) -> None:
        """Store ``value`` (bytes-like, NumPy array, CPU tensor); see :meth:`Client.put_from`."""
        await self._run(self.client.put_from, key, value, parent=parent, replica_num=replica_num)

    put_from = put

    async def batch_put(
        self, keys: Sequence[str], values: Sequence[Any]
    ) -> list[KVPoolError | None]:
        return await self._run(self.client.batch_put, keys, values)

    # ------------------------------------------------------------------------------- reads
    async def get(self, key: str) -> bytes:
        """The object's bytes; :class:`~kvpool.errors.ObjectNotFound` on a miss."""
        return await self._run(self.client.get, key)

    async def get_into(self, key: str, buffer: Any) -> int:
        """Fill the front of ``buffer``; the caller must not touch it until this returns."""
        return await self._run(self.client.get_into, key, buffer)

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._run(self.client.batch_get, keys)

    async def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return await self._run(self.client.batch_get_into, keys, buffers)

    # ------------------------------------------------------------------------------ probes
    async def exists(self, key: str) -> bool:
        return await self._run(self.client.exists, key)

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(self.client.batch_exists, keys)

    async def prefix_lookup(self, keys: Sequence[str], tokens_per_key: int = 0) -> int:
        return await self._run(self.client.prefix_lookup, keys, tokens_per_key)

    async def remove(self, key: str) -> bool:
        return await self._run(self.client.remove, key)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.client.stats)

    # ---------------------------------------------------------------------------- lifetime
    async def close(self) -> None:
        """Close the client (after the calls already running finish) and the threads."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self.client.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

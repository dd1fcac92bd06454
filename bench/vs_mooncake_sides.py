"""The two engines of ``bench/vs_mooncake.py``, behind one small interface (put, get,
keep, remove, exists, batch_exists of numpy buffers).

- :class:`KvpoolSide`: ``kvpool master --segment_size 0`` (it hosts no memory) and a
  ``kvpool node`` contributing the pool's memory, so every byte crosses a process
  boundary; the client is kvpool's :class:`~kvpool.client.client.Client` on its TCP
  transport, as a separate host would use it.
- :class:`MooncakeSide`: ``mooncake_master``, a store process contributing
  ``global_segment_size``, and a client store contributing nothing, whose buffers are
  registered once (``register_buffer``) and moved with ``put_from`` / ``get_into`` /
  ``batch_put_from`` / ``batch_get_into``, as docs/mooncake.md shows.  Only ever inside a
  private network namespace (Mooncake binds every interface).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.client.client import Client
from kvpool.errors import KVPoolError
from kvpool.testing.mooncake import MooncakeMaster
from kvpool.testing.processes import PoolProcess, start_master, start_node

ROOT = Path(__file__).resolve().parents[1]
#: the owner of the get rows' pins
OWNER = "vs-mooncake"


def _check(codes: Any, what: str) -> None:
    bad = [c for c in (codes if isinstance(codes, list) else [codes]) if c < 0]
    if bad:
        raise RuntimeError(f"Mooncake {what} failed with {bad[0]}")


class KvpoolSide:
    """kvpool's master (no memory of its own) and a node contributing the pool's memory."""

    def __init__(self, pool_size: int, workdir: Path) -> None:
        config = workdir / "kvpool.json"
        self.master: PoolProcess = start_master("--segment_size", "0")
        config.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": self.master.address,
                    "protocol": "tcp",
                    "global_segment_size": pool_size,
                }
            )
        )
        try:
            self.node: PoolProcess = start_node(config)
        except BaseException:
            self.master.stop()
            raise
        self.client = Client(self.master.address, allow_shm=False, timeout_s=60.0)
        try:
            deadline = time.monotonic() + 60
            while self.client.stats()["tiers"]["memory"]["capacity"] < pool_size:
                if time.monotonic() > deadline:
                    raise RuntimeError("the kvpool node did not register its memory in 60 s")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    def put(self, keys: list[str], buffers: list[np.ndarray]) -> None:
        if len(keys) == 1:
            self.client.put_from(keys[0], buffers[0])
        else:
            errors = [e for e in self.client.batch_put(keys, buffers) if e is not None]
            if errors:
                raise errors[0]

    def get(self, keys: list[str], buffers: list[np.ndarray]) -> None:
        if len(keys) == 1:
            self.client.get_into(keys[0], buffers[0])
        elif -1 in self.client.batch_get_into(keys, buffers):
            raise RuntimeError("a kvpool batch get missed")

    def keep(self, keys: list[str]) -> None:
        self.client.pin(keys, OWNER, ttl_ms=3_600_000)

    def remove(self, keys: list[str]) -> None:
        """Best effort, outside the timing: a key a get's lease still holds is left to
        eviction."""
        self.client.release_owner(OWNER)
        for key in keys:
            with contextlib.suppress(KVPoolError):
                self.client.remove(key)

    def exists(self, key: str) -> None:
        self.client.exists(key)

    def batch_exists(self, keys: list[str]) -> None:
        self.client.batch_exists(keys)

    def close(self) -> None:
        self.client.close()
        self.node.stop()
        self.master.stop()


def _mooncake_storage(master: str, size: int) -> None:
    """A Mooncake store process contributing ``size`` bytes until its stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", size, 16 << 20, "tcp", "", master)
    print("ready" if rc == 0 else f"setup failed with {rc}", flush=True)
    sys.stdin.read()
    store.close()


class MooncakeSide:
    """``mooncake_master``, a store process contributing the pool's memory, and a client
    store holding none, moving bytes from and to registered buffers."""

    def __init__(self, pool_size: int, buffers: list[np.ndarray]) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master = MooncakeMaster(rpc_port=50051, metrics_port=9003)
        self.store: Any = None
        code = (
            "from bench.vs_mooncake_sides import _mooncake_storage as s;"
            f" s({self.master.rpc_address!r}, {pool_size})"
        )
        self.storage = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": pythonpath()},
        )
        try:
            assert self.storage.stdout is not None
            line = self.storage.stdout.readline().decode().strip()  # Mooncake bounds setup
            if line != "ready":
                raise RuntimeError(f"the Mooncake store process did not start: {line!r}")
            self.store = MooncakeDistributedStore()
            rc = self.store.setup(
                "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.master.rpc_address
            )
            _check(rc, "client setup")
            for b in buffers:
                _check(self.store.register_buffer(b.ctypes.data, b.nbytes), "register_buffer")
        except BaseException:
            self.close()
            raise

    def put(self, keys: list[str], buffers: list[np.ndarray]) -> None:
        if len(keys) == 1:
            _check(self.store.put_from(keys[0], buffers[0].ctypes.data, buffers[0].nbytes), "put")
        else:
            ptrs = [b.ctypes.data for b in buffers]
            _check(self.store.batch_put_from(keys, ptrs, [b.nbytes for b in buffers]), "put")

    def get(self, keys: list[str], buffers: list[np.ndarray]) -> None:
        if len(keys) == 1:
            _check(self.store.get_into(keys[0], buffers[0].ctypes.data, buffers[0].nbytes), "get")
        else:
            ptrs = [b.ctypes.data for b in buffers]
            _check(self.store.batch_get_into(keys, ptrs, [b.nbytes for b in buffers]), "get")

    def keep(self, keys: list[str]) -> None:
        """Nothing to do: Mooncake has no pins, and put rows clean up after themselves."""

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys)

    def exists(self, key: str) -> None:
        self.store.is_exist(key)

    def batch_exists(self, keys: list[str]) -> None:
        self.store.batch_is_exist(keys)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.storage.stdin is not None:
            self.storage.stdin.close()
        try:
            self.storage.wait(20)
        except subprocess.TimeoutExpired:
            self.storage.kill()
            self.storage.wait(10)
        self.master.stop()


def pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


Side = KvpoolSide | MooncakeSide

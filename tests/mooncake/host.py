"""The Mooncake harness's two halves: what runs in the private namespace, and the engine
the tests hold, which forwards each call there through the pipe.

The engine under test is a real :class:`~kvpool.mooncake.engine.MooncakeEngine` against a
real ``mooncake_master``, both in a namespace that :class:`kvpool.testing.mooncake.Namespace`
created; buffers cross the pipe as bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.errors import KVPoolError
from kvpool.mooncake.engine import HEADER_SIZE, MooncakeEngine
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.testing.mooncake import Namespace, Ref

if TYPE_CHECKING:  # the store worker brings torch, which most users of this module skip
    from kvpool.connectors.store.worker import StoreWorker

Caches = dict[str, Any]  # layer name → torch tensor


# ------------------------------------------------------------- in the namespace
def open_engine(config: dict[str, Any], *, put_retry_s: float = 0.2) -> MooncakeEngine:
    return MooncakeEngine(parse_mooncake_config(config), timeout_s=5, put_retry_s=put_retry_s)


def open_store_pool(config: dict[str, Any], path: str, *, lookups: bool = False) -> Any:
    """The pool vLLM's store connector opens for ``"backend": "mooncake"`` when
    MOONCAKE_CONFIG_PATH names ``config`` (written to ``path``): the connector's own
    settings parse and opener, as in an instance (``lookups``: its scheduler half's)."""
    import json
    import os

    from kvpool.config.kv_transfer import parse_store_config
    from kvpool.connectors.store.pool import open_pool
    from kvpool.mooncake.settings import load_any_node_config

    with open(path, "w") as out:
        json.dump(config, out)
    os.environ.pop("KVPOOL_CONFIG_PATH", None)
    os.environ["MOONCAKE_CONFIG_PATH"] = path
    settings = parse_store_config(
        "kv_both", {"backend": "mooncake"}, env=os.environ, load_node=load_any_node_config
    )
    return open_pool(settings, lookups=lookups)


def get_parts(engine: MooncakeEngine, keys: list[str], sizes: list[list[int]]) -> tuple[list, list]:
    parts = [[bytearray(n) for n in ns] for ns in sizes]
    got = engine.batch_get_parts(keys, parts)
    return got, [[bytes(p) for p in ps] if n >= 0 else [] for ps, n in zip(parts, got, strict=True)]


def corrupt(engine: MooncakeEngine, key: str) -> None:
    """Flip one payload byte of a stored object with Mooncake's own calls (as a bad
    segment would), leaving kvpool's header as it was."""
    import numpy as np

    store = engine._open()
    size = int(store.get_size(key))
    assert size > HEADER_SIZE, (key, size)
    raw = np.zeros(size, dtype=np.uint8)
    assert store.register_buffer(raw.ctypes.data, size) == 0
    try:
        assert store.get_into(key, raw.ctypes.data, size) == size
        raw[HEADER_SIZE + 100] ^= 0xFF
        assert store.upsert_from(key, raw.ctypes.data, size) == 0
    finally:
        store.unregister_buffer(raw.ctypes.data)


# ------------------------------------------------------------------- in the test
class NamespacedEngine:
    """A :class:`~kvpool.engines.base.PoolEngine` whose every call runs in ``ns``."""

    def __init__(self, ns: Namespace, ref: Ref, *, owns_namespace: bool = False) -> None:
        self.ns, self.ref, self._owns = ns, ref, owns_namespace
        self.engine = ns.call(ref, "__getattribute__", "engine")

    # the engine's own traits (the store connector's view of it has none): asked when used
    @property
    def pins(self) -> bool:
        return self.ns.call(self.ref, "__getattribute__", "pins")

    @property
    def probes_lease(self) -> bool:
        return self.ns.call(self.ref, "__getattribute__", "probes_lease")

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.ns.call(self.ref, "batch_exists", list(keys))

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self.ns.call(self.ref, "prefix_lookup", list(keys))

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        data = [[bytes(byte_view(p)) for p in ps] for ps in parts]
        return self.ns.call(self.ref, "batch_put_parts", list(keys), data, parents=parents)

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        views = [[writable_byte_view(p) for p in ps] for ps in parts]
        got, data = self.ns.run(
            f"{__name__}:get_parts",
            self.ref,
            list(keys),
            [[len(v) for v in vs] for vs in views],
        )
        for vs, n, chunks in zip(views, got, data, strict=True):
            if n >= 0:
                for view, chunk in zip(vs, chunks, strict=True):
                    view[:] = chunk
        return got

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return self.ns.call(self.ref, "pin", list(keys), owner, ttl_ms)

    def release(self, owner: str) -> int:
        return self.ns.call(self.ref, "release", owner)

    def remove(self, key: str) -> bool:
        return self.ns.call(self.ref, "remove", key)

    def health(self) -> dict[str, Any]:
        return self.ns.call(self.ref, "health")

    def close(self) -> None:
        try:
            self.ns.call(self.ref, "close")
        finally:
            if self._owns:
                self.ns.close()


def mooncake_json(rpc_address: str, segment: int) -> dict[str, Any]:
    """A mooncake.json as vllm-ascend writes it, for a process that contributes
    ``segment`` bytes to the pool."""
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": segment,
        "local_buffer_size": 16 << 20,
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": rpc_address,
    }


def run_on_mooncake(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(engine, *args)`` in a fresh network namespace (Mooncake binds every interface)
    that holds a Mooncake master and ``engine``, opened on it with a 64 MiB segment."""
    with Namespace() as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster")
        config = mooncake_json("127.0.0.1:50051", 64 << 20)
        engine = ns.new("tests.mooncake.host:open_engine", config)
        result: dict[str, Any] = ns.run(f"{fn.__module__}:{fn.__name__}", engine, *args)
        return result


def save_then_load(
    saver: StoreWorker, loader: StoreWorker, keys: tuple[str, ...], src: Caches, dst: Caches
) -> bool:
    """``saver`` saves blocks 0-19 of ``src`` under ``keys`` and ``loader`` loads them into
    blocks 100-119 of ``dst``; whether every layer arrived byte-equal."""
    import torch

    saver.save(StorePlan(saves=(SaveSpec("r", tuple(range(20)), (keys,), (None,)),)))
    targets = tuple(range(100, 120))
    loader.start_loads(StorePlan(loads=(LoadSpec("r2", targets, (keys,), False),)))
    return all(torch.equal(dst[n][list(targets)], src[n][:20]) for n in src)


def kv_cache_round_trip(engine: MooncakeEngine) -> dict[str, Any]:
    """Pages of one KV-cache-sized CPU tensor, each one part, put and read back in place
    (zero-copy); a read into memory outside the cache (staged), one into room for two
    pages (another size), and a damaged copy read in place."""
    import torch

    pages = torch.zeros(256, 128 << 10, dtype=torch.uint8)  # 32 MiB: registered in place
    for i in range(4):
        pages[i].fill_(i + 1)
    keys = [f"page-{i}" for i in range(4)]
    put = engine.batch_put_parts(keys, [[pages[i]] for i in range(4)])
    got = engine.batch_get_parts(keys, [[pages[10 + i]] for i in range(4)])
    equal = all(torch.equal(pages[i], pages[10 + i]) for i in range(4))
    loose = bytearray(128 << 10)
    loose_got = engine.batch_get_parts(keys[:1], [[loose]])
    loose_equal = bytes(loose) == pages[0].numpy().tobytes()
    wide_got = engine.batch_get_parts(keys[:1], [[pages[20:22].reshape(-1)]])
    corrupt(engine, keys[1])
    damaged = engine.batch_get_parts(keys[1:2], [[pages[30]]])
    assert engine._registered is not None
    return {
        "put": put,
        "got": got,
        "equal": equal,
        "loose": loose_got,
        "loose_equal": loose_equal,
        "wide": wide_got,
        "damaged": damaged,
        "regions": len(engine._registered),
        "moved": dict(engine.moved),
    }

"""The store connector's load of one request's blocks, through each pool engine, against
memcpy of as many bytes in the same run.

    .venv/bin/python bench/store_load.py [--layers 4] [--blocks 24] [--rounds 10] [--markdown]

A KV cache of vLLM-CPU's layout (``--layers`` tensors ``[num_blocks, 4 kv heads, 128
tokens, 2 x 64]`` float32: 256 KiB per layer per block, each layer 20 MiB or more, so
Mooncake registers it in place) belongs to one
:class:`~kvpool.connectors.store.worker.StoreWorker`.  Per engine it saves ``--blocks``
blocks (one request of ``--blocks`` x 128 tokens) and loads them back into other blocks,
checked byte for byte.  Rows (GiB/s of page bytes, median of ``--rounds``):

- ``load``  the worker's synchronous load of the request (``start_loads``: every pool read,
  check and copy until the last page is in the KV cache);
- ``save``  the worker's save of a request (fresh keys each round, at most 5 rounds);
- ``memcpy``  ``bench.baselines.memcpy`` of the request's bytes (one copy);
- ``CPU ms``  median CPU time of this process (all threads) for one load and one memcpy:
  what the copies and checksums cost, less moved by other work on a shared host than
  the wall-clock rates.

Engines: ``embedded`` (in-process pool), ``kvpool`` (a ``kvpool master`` on 127.0.0.1,
its segment read over shared memory), ``mooncake`` (real Mooncake Store over TCP, the
worker's process mounting the segment).  Everything runs in one private network
namespace beside its own ``mooncake_master`` (:class:`kvpool.testing.mooncake.Namespace`).
For the Mooncake row the engine's ``moved`` counts say which path the pages took.

``KVPOOL_TREE=/path/to/other/checkout`` imports kvpool from there (the namespace helper
inherits ``PYTHONPATH``): the same bench against the code before a change.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_TREE = os.environ.get("KVPOOL_TREE")
_PATH = [p for p in (_TREE, str(REPO)) if p]
if __name__ == "__main__":  # as a script: kvpool from KVPOOL_TREE (or here), bench from here
    sys.path[:0] = _PATH
    os.environ["PYTHONPATH"] = os.pathsep.join([*_PATH, os.environ.get("PYTHONPATH", "")])

GIB = float(1 << 30)
ENGINES = ("embedded", "kvpool", "mooncake")
LAYER_PAGE = 4 * 128 * 128 * 4  # 4 kv heads x 128 tokens x (2 x 64) x float32
MASTER_RPC = "127.0.0.1:50051"
_SAVE_ROUNDS = 5  # each save stores a request's blocks anew


def _median_s(fn: Any, rounds: int) -> float:
    return _timed(fn, rounds)[0]


def _timed(fn: Any, rounds: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (this process, all its threads: the
    copies and checksums a load costs, whatever else the host runs) of ``fn``."""
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _open(engine: str, capacity: int, stack: Any) -> Any:
    from kvpool.engines import EmbeddedEngine, MasterEngine

    if engine == "embedded":
        return EmbeddedEngine.create(capacity)
    if engine == "kvpool":
        from kvpool.testing.processes import start_master

        proc = stack.enter_context(start_master("--segment_size", str(capacity)))
        return MasterEngine.connect(proc.address, timeout_s=10)
    from kvpool.mooncake.engine import MooncakeEngine
    from kvpool.mooncake.settings import parse_mooncake_config

    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": MASTER_RPC,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": capacity,
        "local_buffer_size": 64 << 20,
    }
    return MooncakeEngine(parse_mooncake_config(config), timeout_s=10)


def measure(engine_name: str, layers: int, blocks: int, rounds: int) -> dict[str, Any]:
    """In the namespace: one engine's rows."""
    import contextlib

    import torch

    import kvpool
    from bench.baselines import memcpy
    from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
    from kvpool.connectors.store.pool import PoolHandle
    from kvpool.connectors.store.worker import StoreWorker

    num_blocks = max(80, 3 * blocks)
    kv = {f"layer.{i}": torch.randn(num_blocks, 4, 128, 128) for i in range(layers)}
    nbytes = blocks * layers * LAYER_PAGE
    save_rounds = min(rounds, _SAVE_ROUNDS)
    # room for every save with the pool far below its eviction watermark
    capacity = 2 * (save_rounds + 1) * nbytes + (64 << 20)
    with contextlib.ExitStack() as stack:
        engine = _open(engine_name, capacity, stack)
        stack.callback(engine.close)

        def handle() -> PoolHandle:
            return PoolHandle(lambda: engine, reconnect_interval_s=60, describe=engine_name)

        worker = StoreWorker(
            tp_rank=0, pool=handle(), loader_pool=handle(), logger=logging.getLogger("bench")
        )
        worker.register(kv)
        source = tuple(range(blocks))
        target = tuple(range(blocks, 2 * blocks))
        saves = iter(range(save_rounds + 1))

        def save() -> tuple[str, ...]:
            n = next(saves)
            keys = tuple(f"{engine_name}-{n}-{i}" for i in source)
            worker.save(StorePlan(saves=(SaveSpec("r", source, (keys,), (None,)),)))
            return keys

        keys = save()  # warm-up: first touch of the pool's pages
        save_s = _median_s(save, save_rounds)
        plan = StorePlan(loads=(LoadSpec("r2", target, (keys,), False),))

        def load() -> None:
            worker.start_loads(plan)

        load()
        if worker.take_invalid_block_ids():
            raise RuntimeError(f"{engine_name}: the load failed ({worker.counters})")
        load_s, load_cpu_s = _timed(load, rounds)
        if worker.take_invalid_block_ids() or not all(
            torch.equal(t[: len(source)], t[blocks : 2 * blocks]) for t in kv.values()
        ):
            raise RuntimeError(f"{engine_name}: the pages did not come back intact")
        copy = memcpy(nbytes)
        copy()
        memcpy_s, memcpy_cpu_s = _timed(copy, rounds)
        moved = dict(getattr(engine, "moved", {}))
    return {
        "engine": engine_name,
        "bytes": nbytes,
        "load_gib_s": nbytes / load_s / GIB,
        "load_cpu_ms": load_cpu_s * 1000,
        "memcpy_cpu_ms": memcpy_cpu_s * 1000,
        "save_gib_s": nbytes / save_s / GIB,
        "memcpy_gib_s": nbytes / memcpy_s / GIB,
        "moved": moved,
        "kvpool": str(Path(kvpool.__file__).parent),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=24, help="blocks of one request")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--markdown", action="store_true")
    opts = p.parse_args(argv)
    if _TREE:  # the namespace helper puts its working folder first on sys.path
        os.chdir(_TREE)
    from kvpool.testing.mooncake import Namespace

    rows = []
    with Namespace(timeout_s=600) as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster", "--default_kv_lease_ttl=11000")
        for name in opts.engines.split(","):
            rows.append(
                ns.run("bench.store_load:measure", name, opts.layers, opts.blocks, opts.rounds)
            )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    trees = sorted({r["kvpool"] for r in rows})
    print(f"# {stamp}, {platform.node()}, {os.cpu_count()} cores, kvpool from {trees}")
    mib = rows[0]["bytes"] / (1 << 20) if rows else 0
    print(f"# one request: {opts.blocks} blocks x {opts.layers} layers = {mib:.0f} MiB")
    if opts.markdown:
        print(
            "| engine | load GiB/s | save GiB/s | memcpy GiB/s | load / memcpy"
            " | load CPU ms | memcpy CPU ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            ratio = r["load_gib_s"] / r["memcpy_gib_s"]
            print(
                f"| {r['engine']} | {r['load_gib_s']:.2f} | {r['save_gib_s']:.2f} |"
                f" {r['memcpy_gib_s']:.2f} | {ratio:.2f} | {r['load_cpu_ms']:.1f} |"
                f" {r['memcpy_cpu_ms']:.1f} |"
            )
    else:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

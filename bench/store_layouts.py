"""What keying the store connector's objects per KV-head group costs, against one object per
TP rank (the layout before head groups), in objects, round trips and load GiB/s.

    .venv/bin/python bench/store_layouts.py [--heads 4] [--layers 4] [--blocks 32]
        [--rounds 5] [--engines embedded,kvpool] [--markdown]

A model of ``--heads`` KV heads (vLLM-CPU's layout: ``[blocks, heads, 128 tokens, 2 x 64]``
float32, 64 KiB per head per layer per block) is read by TP 1 and TP 2 instances.  Layouts:

- ``per-rank``: one object per (chunk, rank) holding the rank's heads of every layer —
  what the connector stored before head groups (``HeadGroups.whole``: same objects and
  sizes, only the keys differ), readable only by the TP size that wrote it;
- ``head-group``: one object per (chunk, KV head) (``head_group_size`` 1, the default with
  a master), readable by every TP layout.

Per layout and reader TP: objects written per block (all ranks), the scheduler's lookup
(round trips and keys probed per request: one probe and one pin per rank), the workers'
load (pool calls and objects per block, all ranks), and the load rate in GiB/s of page
bytes (median of ``--rounds``, the ranks' loads one after another in this process).
Engines: ``embedded`` (in-process) and ``kvpool`` (a ``kvpool master`` on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

GIB = float(1 << 30)
BS, ROW = 128, 128  # tokens per block; floats per token per head (K and V of 64)
LOG = logging.getLogger("bench")


class Counting:
    """A pool engine that counts calls and keys (round trips, objects) per method."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if args and isinstance(args[0], (list, tuple)):
                self.keys[name] += len(args[0])
            return attr(*args, **kwargs)

        return call


def _open(engine: str, capacity: int, stack: contextlib.ExitStack) -> Any:
    from kvpool.engines import EmbeddedEngine, MasterEngine

    if engine == "embedded":
        return EmbeddedEngine.create(capacity)
    from kvpool.testing.processes import start_master

    proc = stack.enter_context(start_master("--segment_size", str(capacity)))
    return MasterEngine.connect(proc.address, timeout_s=10)


def measure(
    engine_name: str, heads: int, layers: int, blocks: int, rounds: int
) -> list[dict[str, Any]]:
    import torch

    from bench.lookup_pins import Req  # vLLM's Request, as far as the scheduler reads it
    from kvpool.connectors.store.groups import HeadGroups
    from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
    from kvpool.connectors.store.pool import PoolHandle
    from kvpool.connectors.store.scheduler import StoreScheduler
    from kvpool.connectors.store.worker import StoreWorker
    from kvpool.core.keys import KeyNamespace, chunk_keys

    num_blocks = 2 * blocks + 1
    full = {f"l{i}": torch.randn(num_blocks, heads, BS, ROW) for i in range(layers)}
    page_bytes = heads * layers * BS * ROW * 4
    rows = []
    with contextlib.ExitStack() as stack:
        engine = Counting(_open(engine_name, 4 * 2 * blocks * page_bytes + (64 << 20), stack))
        stack.callback(engine.close)

        def handle() -> PoolHandle:
            return PoolHandle(lambda: engine, reconnect_interval_s=60, describe=engine_name)

        tokens = list(range(blocks * BS + 1))
        for tp in (1, 2):
            n = heads // tp
            caches = [
                {k: t[:, r * n : (r + 1) * n].clone() for k, t in full.items()} for r in range(tp)
            ]
            for layout in ("per-rank", "head-group"):
                groups = (
                    HeadGroups.whole(heads, tp)
                    if layout == "per-rank"
                    else HeadGroups(heads, 1, tp)
                )
                ns = KeyNamespace("bench", "float32", BS, layout=f"{layout}:{tp}")
                chain = chunk_keys(tokens, ns)
                workers = []
                for rank in range(tp):
                    w = StoreWorker(
                        tp_rank=rank, pool=handle(), loader_pool=handle(), logger=LOG, groups=groups
                    )
                    w.register(caches[rank])
                    workers.append(w)
                source = tuple(range(blocks))
                engine.calls.clear(), engine.keys.clear()
                save = SaveSpec("w", source, groups.keys(chain), (None,) * groups.num_groups)
                for w in workers:
                    w.save(StorePlan(saves=(save,)))
                objects_written = engine.keys["batch_put_parts"]
                sched = StoreScheduler(
                    namespace=ns, pool=handle(), saves=False, load_async=False, logger=LOG,
                    groups=groups, pin_scope="bench",
                )  # fmt: skip
                engine.calls.clear(), engine.keys.clear()
                req = Req(f"{layout}{tp}", tokens)
                hit, _ = sched.get_num_new_matched_tokens(req, 0)
                assert hit == blocks * BS, (layout, tp, hit)
                lookup_calls, lookup_keys = sum(engine.calls.values()), sum(engine.keys.values())
                target = tuple(range(blocks, 2 * blocks))
                plan = StorePlan(loads=(LoadSpec("r", target, groups.keys(chain[:blocks]), False),))
                sched.request_finished(req)  # ends the lookup's pins

                def load(ws: list[Any] = workers, p: StorePlan = plan) -> None:
                    for w in ws:
                        w.start_loads(p)

                engine.calls.clear(), engine.keys.clear()
                load()
                load_calls = engine.calls["batch_get_parts"]
                load_objects = engine.keys["batch_get_parts"]
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    load()
                    times.append(time.perf_counter() - t0)
                for rank, w in enumerate(workers):
                    if w.take_invalid_block_ids():
                        raise RuntimeError(f"{layout} tp {tp}: a load failed")
                    c = caches[rank]
                    if not all(torch.equal(t[:blocks], t[blocks : 2 * blocks]) for t in c.values()):
                        raise RuntimeError(f"{layout} tp {tp}: pages did not come back intact")
                rows.append(
                    {
                        "engine": engine_name,
                        "layout": layout,
                        "reader_tp": tp,
                        "objects_per_block": objects_written / blocks,
                        "object_kib": workers[0].object_bytes / 1024,
                        "lookup_round_trips": lookup_calls,
                        "lookup_keys_per_block": lookup_keys / blocks,
                        "load_calls_per_block": load_calls / blocks,
                        "load_objects_per_block": load_objects / blocks,
                        "load_gib_s": blocks * page_bytes / statistics.median(times) / GIB,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--engines", default="embedded,kvpool")
    p.add_argument("--markdown", action="store_true")
    opts = p.parse_args(argv)
    rows = []
    for name in opts.engines.split(","):
        rows += measure(name, opts.heads, opts.layers, opts.blocks, opts.rounds)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"# {stamp}, {os.cpu_count()} cores, load average (1 min) {load}")
    print(f"# {opts.heads} KV heads, {opts.layers} layers, {opts.blocks} blocks of {BS} tokens")
    if not opts.markdown:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(
        "| engine | layout | reader TP | objects / block | object KiB | lookup round trips"
        " | keys probed / block | load calls / block | objects loaded / block | load GiB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['layout']} | {r['reader_tp']} | {r['objects_per_block']:g}"
            f" | {r['object_kib']:g} | {r['lookup_round_trips']} | {r['lookup_keys_per_block']:g}"
            f" | {r['load_calls_per_block']:.3g} | {r['load_objects_per_block']:g}"
            f" | {r['load_gib_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

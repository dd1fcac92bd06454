"""Device KV pages: vLLM-layout KV caches on a device, moved to kvpool's pool and back.

    .venv/bin/python bench/device_pages.py                    # CUDA, the default sizes
    .venv/bin/python bench/device_pages.py --markdown         # the table for the docs
    .venv/bin/python bench/device_pages.py --device cpu --layers 2 --blocks 4 --rounds 1

The KV caches are vLLM's layout, one tensor per layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` (bf16 by default; 32 layers of 8 heads of 128: 2 MiB pages).
``--blocks`` pages go device → pool → device through the store connector's own page path
(:class:`~kvpool.connectors.store.worker.StoreWorker` on kvpool's embedded pool, in
batches of 16 pages) and are checked byte for byte on the device.  Rows (GiB/s of page
bytes, median of ``--rounds`` after one warm-up round):

- ``save device→pool``     the worker's save: gather, copy to host, put (checksums too);
- ``load pool→device``     the worker's load: get into host staging, copy back, scatter;
- ``gather device→host``   the staging copy alone (``StagedCaches.gather``);
- ``scatter host→device``  the staging copy back alone (``StagedCaches.scatter``);
- ``torch d2h`` / ``torch h2d``  baselines: one ``copy_`` of the same bytes between a
  contiguous device tensor and pinned host memory (``non_blocking``, one wait);
- ``memcpy``               baseline: ``numpy.copyto`` of the same bytes, host to host.

``ratio`` is against the baseline in the ``vs`` column, measured in this run.  Without the
device (no CUDA here) it prints one line saying so and exits 1.  ``--device cpu`` runs the
same rows on CPU tensors forced through the staged path (plain host memory, nothing
pinned): a smoke test, not a measurement of a device.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._timing import median_s
from kvpool.connectors.device_pages import StagedCaches
from kvpool.connectors.pages import block_pages
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.engines import PoolEngine, open_engine

GiB = 1 << 30
BATCH = 16  # the store worker's batch
ROWS = (
    ("save device→pool", "torch d2h"),
    ("load pool→device", "torch h2d"),
    ("gather device→host", "torch d2h"),
    ("scatter host→device", "torch h2d"),
    ("torch d2h", "memcpy"),
    ("torch h2d", "memcpy"),
    ("memcpy", ""),
)


def available(device: torch.device) -> str | None:
    """Why ``device`` cannot be measured here (None: it can)."""
    if device.type == "cpu":
        return None
    try:
        module: Any = torch.get_device_module(device)
    except (AttributeError, RuntimeError) as exc:
        return f"torch {torch.__version__} has no {device.type} support ({exc})"
    if not module.is_available():
        return f"no {device.type.upper()} device here (torch {torch.__version__})"
    return None


def wait(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def kv_caches(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """vLLM's layout: twice ``--blocks`` blocks per layer, so loads land elsewhere."""
    dtype = getattr(torch, args.dtype)
    shape = (2 * args.blocks, args.heads, args.block_size, 2 * args.head_size)
    g = torch.Generator(device=device).manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            shape, generator=g, device=device, dtype=torch.float32
        ).to(dtype)
        for i in range(args.layers)
    }


def worker(pool: PoolEngine, caches: dict[str, torch.Tensor]) -> StoreWorker:
    def handle() -> PoolHandle:
        return PoolHandle(lambda: pool, reconnect_interval_s=60, describe="embedded")

    w = StoreWorker(
        tp_rank=0, pool=handle(), loader_pool=handle(), logger=logging.getLogger("bench")
    )
    w.register(caches)  # a device cache is staged by its device
    w.paged = block_pages(caches, staged=True)  # and a CPU one is forced to be
    return w


def measure(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, float], int, bool]:
    """Seconds per row, the bytes each row moves, and whether the loads were byte-equal."""
    caches = kv_caches(args, device)
    n = args.blocks
    probe = block_pages(caches, staged=True)
    assert isinstance(probe, StagedCaches)
    nbytes = n * probe.page_bytes
    pool = open_engine("embedded", capacity=2 * nbytes + (64 << 20))
    try:
        w = worker(pool, caches)
        paged = w.paged
        assert isinstance(paged, StagedCaches)
        src, dst = tuple(range(n)), tuple(range(2 * n - 1, n - 1, -1))
        keys = tuple(f"bench{i:027d}" for i in range(n))
        save = StorePlan(saves=(SaveSpec("bench", src, (keys,), (None,)),))
        load = StorePlan(loads=(LoadSpec("bench", dst, (keys,), False),))

        def round_trip_save() -> None:
            for key in keys:  # a fresh put each round, not a write conflict
                pool.remove(key)
            w.save(save)

        seconds = {"save device→pool": median_s(round_trip_save, args.rounds)}
        seconds["load pool→device"] = median_s(lambda: w.start_loads(load), args.rounds)
        equal = not w.take_invalid_block_ids() and all(
            torch.equal(t[list(dst)].view(torch.uint8), t[list(src)].view(torch.uint8))
            for t in caches.values()
        )
        pages = paged.new_pages(BATCH)

        batches = [list(src[i : i + BATCH]) for i in range(0, n, BATCH)]

        def each_batch(op: Callable[[list[int], Any], None]) -> Callable[[], None]:
            def run() -> None:
                for batch in batches:
                    op(batch, pages)

            return run

        seconds["gather device→host"] = median_s(each_batch(paged.gather), args.rounds)
        seconds["scatter host→device"] = median_s(each_batch(paged.scatter), args.rounds)
        seconds.update(baselines(nbytes, device, args.rounds))
        return seconds, nbytes, equal
    finally:
        pool.close()


def baselines(nbytes: int, device: torch.device, rounds: int) -> dict[str, float]:
    on_device = torch.ones(nbytes, dtype=torch.uint8, device=device)
    pinned = device.type != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    a, b = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)

    def d2h() -> None:
        host.copy_(on_device, non_blocking=True)
        wait(device)

    def h2d() -> None:
        on_device.copy_(host, non_blocking=True)
        wait(device)

    return {
        "torch d2h": median_s(d2h, rounds),
        "torch h2d": median_s(h2d, rounds),
        "memcpy": median_s(lambda: np.copyto(b, a), rounds),
    }


def table(seconds: dict[str, float], nbytes: int, markdown: bool) -> list[str]:
    rate = {name: nbytes / GiB / s for name, s in seconds.items()}
    rows = [("row", "GiB/s", "ratio", "vs")]
    for name, vs in ROWS:
        ratio = f"{rate[name] / rate[vs]:.3g}×" if vs else ""
        rows.append((name, f"{rate[name]:.3g}", ratio, vs))  # the smoke test's are tiny
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        return [lines[0], "|---|---:|---:|---|", *lines[1:]]
    return [f"{r[0]:<22} {r[1]:>8} {r[2]:>7}  {r[3]}" for r in rows]


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:g} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, npu, ... or cpu")
    parser.add_argument("--blocks", type=int, default=256, help="pages moved per round")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8, help="KV heads of this rank")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    why = available(device)
    if why is not None:
        print(f"device_pages: {why}; nothing measured (--device cpu runs a smoke test)")
        return 1
    args.rounds = max(1, args.rounds)
    seconds, nbytes, equal = measure(args, device)
    page = nbytes // args.blocks
    print(
        f"device {device} ({'pinned' if device.type != 'cpu' else 'plain'} host staging),"
        f" torch {torch.__version__}: {args.blocks} pages of {_size(page)}"
        f" ({args.layers} layers, {args.heads} heads, block {args.block_size},"
        f" head {args.head_size}, {args.dtype}), {args.rounds} rounds"
    )
    print(f"loads byte-equal on the device: {equal}")
    print("\n".join(table(seconds, nbytes, args.markdown)))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

"""P→D pull benchmark: kvpool's TCP and Mooncake's Transfer Engine, side by side, one run.

    .venv/bin/python bench/pd_transfer.py                      # plain table
    .venv/bin/python bench/pd_transfer.py --markdown           # for docs/benchmarks.md
    .venv/bin/python bench/pd_transfer.py --blocks 16,256 --rounds 5

One request of ``--blocks`` blocks is pulled again and again from a prefill worker (its
real pull server, holds and admission) into a decode rank's KV cache (the transfer
connector's own transport: :func:`kvpool.connectors.transfer.transport.make_transport`),
on each transport:

- ``kvpool tcp``             kvpool's TCP: page slices ``sendall`` / ``recv_into`` in place;
- ``transfer engine (tcp)``  the Transfer Engine with its own ``tcp`` protocol (the node
  config's ``"transport": "transfer_engine"``): the control conversation on kvpool's TCP,
  the pages read by the engine from P's registered caches.

Block ids are a random permutation, as vLLM's free list scatters them (the engine
transport merges page slices that lie back to back on both sides into one request;
scattered ids leave nothing to merge).  The layout is a small model's (``--layers``, 2 KV
heads per rank, 16 tokens per block, head size 128 in bf16: 8 KiB per head and block).
Both transports run in one private network namespace (the engine binds every
interface), interleaved ``--rounds`` times, and each row reports its median round;
``ratio`` is against ``kvpool tcp`` of the same size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.pages import PagedCaches
from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
from kvpool.connectors.transfer.transport import make_transport
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.protocol.pull import Pull

TRANSPORTS = {"kvpool tcp": "kvpool", "transfer engine (tcp)": "transfer_engine"}
HEADS, BLOCK, ROW = 2, 16, 2 * 128 * 2  # per rank; tokens per block; k+v bytes per token
GiB = 1 << 30


def _caches(layers: int, blocks: int, fill: bool) -> PagedCaches:
    shape = (blocks, HEADS, BLOCK, ROW)
    rng = np.random.default_rng(1)
    make = (
        (lambda: rng.integers(0, 256, shape, dtype=np.uint8))
        if fill
        else (lambda: np.zeros(shape, dtype=np.uint8))
    )
    return PagedCaches({f"model.layers.{i}.self_attn.attn": make() for i in range(layers)})


def measure(transport: str, layers: int, blocks: int, pulls: int, port: int) -> list[float]:
    """Seconds of each of ``pulls`` pulls of ``blocks`` blocks (runs in the namespace)."""
    base = TransferConfig("kv_producer", port, "bench", Topology(1, 1), transport=transport)
    p = TransferWorker(base, RankInfo(0, 1, 0, HEADS))
    d_transport = make_transport(replace(base, role="kv_consumer", kv_port=port + 100))
    try:
        p.register(_caches(layers, blocks, fill=True))
        d_caches = _caches(layers, blocks, fill=False)
        d_transport.register(d_caches)
        # vLLM's free list hands out scattered block ids: no two pages adjacent on both sides
        ids = [int(b) for b in np.random.default_rng(blocks).permutation(blocks)]
        page = HEADS * BLOCK * ROW
        times = []
        with d_transport.connect("127.0.0.1", port, 5.0) as link:
            for i in range(pulls):
                p.submit(TransferJobs(holds=[HoldJob(f"r{i}", tuple(ids))]))
                pull = Pull(f"r{i}", ids, 0, HEADS, d_caches.names, 0, 1, page, "bench")
                started = time.perf_counter()
                link.pull(pull, ids, 0, time.monotonic() + 30)
                times.append(time.perf_counter() - started)
                p.results()  # the served hold is freed, as vLLM's step would
        return times
    finally:
        d_transport.close()
        p.close()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvpool.testing.mooncake import Namespace

    rows: dict[tuple[str, int], list[float]] = {}
    with Namespace(timeout_s=600) as ns:
        port = 31000
        for _ in range(args.rounds):
            for blocks in args.blocks:
                for name, transport in TRANSPORTS.items():
                    port += 300
                    times = ns.run(
                        "bench.pd_transfer:measure",
                        transport,
                        args.layers,
                        blocks,
                        args.pulls,
                        port,
                    )
                    rows.setdefault((name, blocks), []).append(statistics.median(times))
    out = []
    for (name, blocks), medians in rows.items():
        nbytes = blocks * args.layers * HEADS * BLOCK * ROW
        seconds = statistics.median(medians)
        out.append({"name": name, "blocks": blocks, "bytes": nbytes, "seconds": seconds})
    return out


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    base = {r["blocks"]: r["seconds"] for r in rows if r["name"] == "kvpool tcp"}
    lines = []
    head = ("transport", "blocks", "MiB/pull", "ms/pull", "GiB/s", "ratio")
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("  ".join(f"{h:>22}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for r in rows:
        cells = (
            r["name"],
            str(r["blocks"]),
            f"{r['bytes'] / (1 << 20):.1f}",
            f"{r['seconds'] * 1000:.2f}",
            f"{r['bytes'] / GiB / r['seconds']:.2f}",
            f"{base[r['blocks']] / r['seconds']:.2f}×",
        )
        if markdown:
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append(
                "  ".join(f"{c:>22}" if i == 0 else f"{c:>9}" for i, c in enumerate(cells))
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="16,256", help="blocks per request, comma-separated")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pulls", type=int, default=20, help="pulls per round and row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",")]
    print(table(run(args), args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

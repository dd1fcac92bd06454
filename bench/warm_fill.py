"""First fill against second fill of a new pool, with the segment warmed and not.

A fresh segment's page costs a fault (and the kernel's zeroing) the first time a put
writes it; ``segment_warmup`` faults them in at start instead.  Per round, for each mode
(``off``, ``background``, ``sync``) and path (TCP, the same-host shared memory), a new
``kvpool master`` is started and filled twice with 64 KiB puts: fill 1 right after it
announces its port (what a user's first requests meet), then every key removed and fill 2
into the very same extents.  Ratios: fill 1 / fill 2 of the same pool (1.0 = no first-touch
cost), and fill 1 / fill 1 with warming off (same round).  Start-up: seconds from starting
the process to its port, and to ``/api/status`` saying warm; what warming adds is the time
to warm less a start with warming off (whose port is the baseline), per GiB of segment.

    python bench/warm_fill.py [--segment 512MiB] [--rounds 3] [--startup 1GiB] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _cli
from kvpool.client.client import Client
from kvpool.config.values import WARMUP_MODES, parse_size
from kvpool.net import http_get
from kvpool.testing.processes import PoolProcess

VALUE = 64 << 10
FILL = 0.8  # of the segment: below the 0.9 eviction watermark, so no fill evicts


def start(segment: int, mode: str) -> tuple[PoolProcess, float]:
    """A new master and the seconds it took to announce its port."""
    t = time.perf_counter()
    argv = ["master", "--port", "0", "--segment_size", str(segment), "--segment_warmup", mode]
    proc = PoolProcess(argv, ready_timeout_s=300)
    return proc, time.perf_counter() - t


def warm_state(master: PoolProcess) -> str:
    status = json.loads(http_get(f"http://{master.address}/api/status", 5.0).body)
    return str(status["segments"][0]["warm"])


def fill(c: Client, tag: str, count: int, value: np.ndarray) -> float:
    """MB/s of ``count`` fresh 64 KiB puts."""
    t = time.perf_counter()
    for i in range(count):
        c.put_from(f"{tag}-{i}", value)
    return count * VALUE / (time.perf_counter() - t) / 1e6


@dataclass
class Row:
    mode: str
    path: str
    first: list[float] = field(default_factory=list)  # MB/s
    second: list[float] = field(default_factory=list)
    vs_off: list[float] = field(default_factory=list)  # fill 1 / fill 1 with warming off


def one_pool(segment: int, mode: str, shm: bool, value: np.ndarray) -> tuple[float, float]:
    count = int(segment * FILL) // VALUE
    master, _ = start(segment, mode)
    with master, Client(master.address, allow_shm=shm, timeout_s=60) as c:
        first = fill(c, "a", count, value)
        for i in range(count):
            c.remove(f"a-{i}")
        second = fill(c, "b", count, value)
    return first, second


def startup(size: int, mode: str) -> tuple[float, float]:
    """Seconds to the port, and to warm (the port's time when off: nothing to warm)."""
    t = time.perf_counter()
    master, ready = start(size, mode)
    with master:
        while mode != "off" and warm_state(master) != "warm":
            time.sleep(0.01)
        return ready, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segment", default="512MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup", default="1GiB", help="segment size of the start-up rows")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    segment = parse_size(args.segment, key="--segment")
    value = np.random.default_rng(0).integers(0, 255, VALUE, dtype=np.uint8)
    rows = {(mode, path): Row(mode, path) for path in ("tcp", "shm") for mode in WARMUP_MODES}
    for _ in range(args.rounds):
        for path in ("tcp", "shm"):
            first_off = 0.0
            for mode in ("off", "background", "sync"):  # off first: the others' baseline
                first, second = one_pool(segment, mode, path == "shm", value)
                row = rows[(mode, path)]
                row.first.append(first)
                row.second.append(second)
                first_off = first if mode == "off" else first_off
                row.vs_off.append(first / first_off)
    size = parse_size(args.startup, key="--startup")
    starts: dict[str, list[tuple[float, float]]] = {mode: [] for mode in WARMUP_MODES}
    for _ in range(args.rounds):  # modes interleaved, so load from other jobs hits each
        for mode in WARMUP_MODES:
            starts[mode].append(startup(size, mode))
    print_tables(list(rows.values()), starts, size, args.markdown)
    return 0


def print_tables(
    rows: list[Row], starts: dict[str, list[tuple[float, float]]], size: int, markdown: bool
) -> None:
    med = statistics.median
    header = ("path", "segment_warmup", "fill 1 MB/s", "fill 2 MB/s", "fill 1 / fill 2", "vs off")
    lines = [
        (
            r.path,
            r.mode,
            f"{med(r.first):.0f}",
            f"{med(r.second):.0f}",
            f"{med(f / s for f, s in zip(r.first, r.second, strict=True)):.2f}",
            f"{med(r.vs_off):.2f}",
        )
        for r in rows
    ]
    gib = size / (1 << 30)
    base = med(r for r, _ in starts["off"])  # a start with nothing to warm
    start_header = (
        f"segment_warmup ({gib:g} GiB)",
        "to port s",
        "to warm s",
        "port later than off s",
        "warming s per GiB",
    )
    start_lines = [
        (
            mode,
            f"{med(r for r, _ in runs):.2f}",
            f"{med(w for _, w in runs):.2f}" if mode != "off" else "—",
            f"{med(r for r, _ in runs) - base:+.2f}",
            f"{(med(w for _, w in runs) - base) / gib:.2f}" if mode != "off" else "—",
        )
        for mode, runs in starts.items()
    ]
    for head, body in ((header, lines), (start_header, start_lines)):
        if markdown:
            _cli.markdown_table(head, body)
        else:
            for ln in [head, *body]:
                print("  ".join(f"{cell:>16}" for cell in ln))
        print()


if __name__ == "__main__":
    raise SystemExit(main())

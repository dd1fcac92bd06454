"""Where a single put's time goes, against raw TCP in the same run.

    .venv/bin/python bench/put_phases.py [--size 64KiB] [--count 2000] [--markdown]

A ``kvpool master`` (no memory of its own) and a ``kvpool node`` on 127.0.0.1, and a
client over TCP as another host's would be (no shared memory).  Each of ``--count``
single puts of a new key is timed phase by phase: the master's reservation (``PutStart``,
the value's checksum overlapped with it), the write to the node, the master's commit
(``PutEnd``).  Beside them, in the same process and rounds: raw TCP writing the same bytes
with a 1-byte acknowledgement, and a 1-byte round trip (one request/reply, no payload).
Medians, µs.  A put is three round trips where raw TCP's write is one: that is its floor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench.* and kvpool from this tree
    sys.path.insert(0, str(ROOT))

from bench.baselines import raw_tcp  # noqa: E402
from bench.master_scale import size_of, start_kvpool, stop  # noqa: E402

PHASES = ("reserve (PutStart)", "write to the node", "commit (PutEnd)")


def measure(size: int, count: int) -> dict[str, Any]:
    import numpy as np

    from kvpool.client.client import Client

    _, address, things = start_kvpool(size * count * 2 + (64 << 20), Path(tempfile.mkdtemp()))
    write_raw, _, close_raw = raw_tcp(size)
    _, rtt_raw, close_rtt = raw_tcp(1)
    try:
        client = Client(address, allow_shm=False, timeout_s=60.0)
        value = np.full(size, 7, dtype=np.uint8)
        spent: dict[str, list[float]] = {p: [] for p in (*PHASES, "put", "raw", "rtt")}
        link_call, path_of = client.link.call, client._path
        phase = iter(())

        def timed_call(request: Any, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return link_call(request, *args)
            finally:
                spent[next(phase)].append(time.perf_counter() - t0)

        def timed_path(placement: Any) -> Any:
            path = path_of(placement)
            run = path.run

            class Timed:
                def run(self, ops: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return run(ops)
                    finally:
                        spent[PHASES[1]].append(time.perf_counter() - t0)

            return Timed()

        client.link.call = timed_call  # type: ignore[method-assign]
        client._path = timed_path  # type: ignore[method-assign]
        for i in range(count):
            phase = iter((PHASES[0], PHASES[2]))
            t0 = time.perf_counter()
            client.put(f"put-phases-{i:08d}", value)
            spent["put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_raw()
            spent["raw"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rtt_raw()
            spent["rtt"].append(time.perf_counter() - t0)
        client.close()
    finally:
        close_raw()
        close_rtt()
        stop(things)
    return {name: statistics.median(v) * 1e6 for name, v in spent.items()}


def table(us: dict[str, float], size: int, count: int) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Date: {now}. Machine: {os.cpu_count()}-core {platform.machine()}, Python"
        f" {platform.python_version()}, load {os.getloadavg()[0]:.1f}. {count} single puts"
        f" of {size} B; medians.",
        "",
        "| phase | µs | share of the put | raw TCP 1-byte round trips |",
        "|---|---:|---:|---:|",
    ]
    for name in PHASES:
        lines.append(
            f"| {name} | {us[name]:.0f} | {us[name] / us['put']:.0%} | {us[name] / us['rtt']:.1f} |"
        )
    lines.append(f"| the whole put | {us['put']:.0f} | 100% | {us['put'] / us['rtt']:.1f} |")
    lines.append(f"| raw TCP: the same bytes, acknowledged | {us['raw']:.0f} | | "
                 f"{us['raw'] / us['rtt']:.1f} |")  # fmt: skip
    lines.append(f"| raw TCP: 1-byte round trip | {us['rtt']:.0f} | | 1.0 |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="64KiB")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    size = size_of(args.size)
    us = measure(size, min(args.count, 100_000))
    print(table(us, size, args.count) if args.markdown else json.dumps(us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

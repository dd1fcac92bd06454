"""The master at scale, beside ``mooncake_master``: fill rate, memory per object, lookups.

    .venv/bin/python bench/master_scale.py [--objects 100000,1000000] [--size 1KiB]
        [--clients 4] [--seconds 10] [--markdown]

Both engines run in one private network namespace (the script enters one with ``unshare
-n`` when it is not in one: Mooncake binds every interface), one after the other, each
with its storage in a process of its own: ``kvpool master --segment_size 0`` and a
``kvpool node`` contributing the pool's memory; ``mooncake_master`` and a store process
contributing ``global_segment_size``.  Per engine and size:

- **fill**: N objects of ``--size`` put in batches of 64 by one client process, puts/s;
- **master memory**: the master process's RSS after the fill less before it, per object
  (storage lives elsewhere: this is the index alone);
- **lookups**: ``--clients`` client processes each calling ``batch_exists`` on 64 random
  keys for ``--seconds``: keys/s in all, and each call's p50 and p99 (the worst client's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench.* and kvpool from this tree
    sys.path.insert(0, str(ROOT))

from bench import _cli  # noqa: E402

BATCH = 64
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def size_of(text: str) -> int:
    for unit in ("KiB", "MiB", "B"):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * UNITS[unit]
    return int(text)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def key(i: int) -> str:
    return f"{i:032x}"  # kvpool's keys are 32 hex digits


# -- the engines' clients (each in its own process) --------------------------------------


class KvpoolClient:
    def __init__(self, address: str) -> None:
        from kvpool.client.client import Client

        self.client = Client(address, allow_shm=False, timeout_s=120.0)

    def put(self, keys: list[str], buffers: list[Any]) -> None:
        errors = [e for e in self.client.batch_put(keys, buffers) if e is not None]
        if errors:
            raise errors[0]

    def exists(self, keys: list[str]) -> None:
        self.client.batch_exists(keys)

    def close(self) -> None:
        self.client.close()


class MooncakeClient:
    def __init__(self, address: str, buffers: list[Any] | None = None) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", address)
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup failed with {rc}")
        for b in buffers or []:
            self.store.register_buffer(b.ctypes.data, b.nbytes)

    def put(self, keys: list[str], buffers: list[Any]) -> None:
        codes = self.store.batch_put_from(
            keys, [b.ctypes.data for b in buffers], [b.nbytes for b in buffers]
        )
        if any(c < 0 for c in codes):
            raise RuntimeError(f"Mooncake batch put failed with {min(codes)}")

    def exists(self, keys: list[str]) -> None:
        self.store.batch_is_exist(keys)

    def close(self) -> None:
        self.store.close()


def _client(engine: str, address: str, buffers: list[Any] | None = None) -> Any:
    if engine == "kvpool":
        return KvpoolClient(address)
    return MooncakeClient(address, buffers)


def fill(engine: str, address: str, n: int, size: int, out: Any) -> None:
    """Put ``n`` objects in batches of 64; sends the seconds it took."""
    import numpy as np

    buffers = [np.full(size, i % 251, dtype=np.uint8) for i in range(BATCH)]
    client = _client(engine, address, buffers)
    started = time.perf_counter()
    for first in range(0, n, BATCH):
        keys = [key(i) for i in range(first, min(n, first + BATCH))]
        client.put(keys, buffers[: len(keys)])
    out.send(time.perf_counter() - started)
    client.close()


def lookups(engine: str, address: str, n: int, seconds: float, seed: int, out: Any) -> None:
    """``batch_exists`` of 64 random keys for ``seconds``; sends (calls, p50, p99) in s."""
    client = _client(engine, address)
    rng = random.Random(seed)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and len(times) < 1_000_000:
        keys = [key(rng.randrange(n)) for _ in range(BATCH)]
        t0 = time.perf_counter()
        client.exists(keys)
        times.append(time.perf_counter() - t0)
    times.sort()
    out.send((len(times), times[len(times) // 2], times[int(len(times) * 0.99)]))
    client.close()


def _in_process(target: Any, *args: Any) -> Any:
    here, there = mp.Pipe()
    proc = mp.Process(target=target, args=(*args, there))
    proc.start()
    result = here.recv()
    proc.join(60)
    return result


# -- the engines' servers ------------------------------------------------------------------


def start_kvpool(pool_bytes: int, workdir: Path) -> tuple[int, str, list[Any]]:
    from kvpool.testing.processes import start_master, start_node

    master = start_master("--segment_size", "0", "--host", "127.0.0.1")
    config = workdir / "kvpool.json"
    config.write_text(json.dumps({"local_hostname": "127.0.0.1",
                                  "metadata_server": master.address, "protocol": "tcp",
                                  "global_segment_size": pool_bytes}))  # fmt: skip
    node = start_node(config)
    from kvpool.client.client import Client

    with Client(master.address, allow_shm=False, timeout_s=60) as c:
        deadline = time.monotonic() + 60
        while c.stats()["tiers"]["memory"]["capacity"] < pool_bytes:
            if time.monotonic() > deadline:
                raise RuntimeError("the kvpool node did not register its memory")
            time.sleep(0.05)
    return master.proc.pid, master.address, [node, master]


def start_mooncake(pool_bytes: int) -> tuple[int, str, list[Any]]:
    from bench.vs_mooncake_sides import pythonpath
    from kvpool.testing.mooncake import MooncakeMaster

    master = MooncakeMaster(rpc_port=50051, metrics_port=9003)
    code = (
        "from bench.vs_mooncake_sides import _mooncake_storage as s;"
        f" s({master.rpc_address!r}, {pool_bytes})"
    )
    storage = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )  # fmt: skip
    assert storage.stdout is not None
    line = storage.stdout.readline().decode().strip()
    if line != "ready":
        raise RuntimeError(f"the Mooncake store process did not start: {line!r}")
    return master.proc.pid, master.rpc_address, [storage, master]


def stop(things: list[Any]) -> None:
    for thing in things:
        if isinstance(thing, subprocess.Popen):
            if thing.stdin is not None:
                thing.stdin.close()
            try:
                thing.wait(30)
            except subprocess.TimeoutExpired:
                thing.kill()
        else:
            thing.stop()


def measure(engine: str, n: int, size: int, args: argparse.Namespace) -> dict[str, Any]:
    pool_bytes = int(n * max(size, 64) * 1.5) + (64 << 20)
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-scale-"))
    if engine == "kvpool":
        pid, address, things = start_kvpool(pool_bytes, workdir)
    else:
        pid, address, things = start_mooncake(pool_bytes)
    try:
        time.sleep(1.0)
        before = rss(pid)
        seconds = _in_process(fill, engine, address, n, size)
        time.sleep(2.0)  # let the master settle (its tick cleans what a fill leaves)
        after = rss(pid)
        results = []
        pipes, procs = [], []
        for c in range(args.clients):
            here, there = mp.Pipe()
            proc = mp.Process(target=lookups, args=(engine, address, n, args.seconds, c, there))
            proc.start()
            pipes.append(here)
            procs.append(proc)
        for here, proc in zip(pipes, procs, strict=True):
            results.append(here.recv())
            proc.join(60)
        calls = sum(r[0] for r in results)
        return {
            "engine": engine,
            "objects": n,
            "size": size,
            "fill_per_s": n / seconds,
            "bytes_per_object": (after - before) / n,
            "keys_per_s": calls * BATCH / args.seconds,
            "p50_ms": statistics.median(r[1] for r in results) * 1000,
            "p99_ms": max(r[2] for r in results) * 1000,
            "p99_each_ms": [round(r[2] * 1000, 2) for r in results],
        }
    finally:
        stop(things)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Date: {now}. Machine: {os.cpu_count()}-core {platform.machine()}, Python"
        f" {platform.python_version()}. {args.clients} lookup clients for {args.seconds:g} s;"
        " batches of 64.",
        "",
        "| objects | engine | fill (puts/s) | master memory (B/object) | batch_exists keys/s"
        " | p50 per call (ms) | p99 per call, worst client (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['objects']:,} × {r['size']} B | {r['engine']} | {r['fill_per_s']:,.0f} |"
            f" {r['bytes_per_object']:,.0f} | {r['keys_per_s']:,.0f} | {r['p50_ms']:.2f} |"
            f" {r['p99_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    from kvpool.testing import mooncake

    parser = _cli.parser(__doc__)
    parser.add_argument("--objects", default="100000,1000000")
    parser.add_argument("--size", default="1KiB")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--engines", default="kvpool,mooncake")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if not mooncake.private_netns():  # Mooncake binds every interface: a private one
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                sys.executable, *sys.argv]  # fmt: skip
        # the namespace it comes from, for the check inside (as kvpool's Namespace does)
        env = {**os.environ, mooncake._HOST_NETNS_VAR: str(mooncake._netns())}
        return subprocess.run(argv, check=False, env=env).returncode
    rows = []
    for n in (int(x) for x in args.objects.split(",")):
        for engine in args.engines.split(","):
            rows.append(measure(engine, n, size_of(args.size), args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return _cli.report(rows, args, table)


if __name__ == "__main__":
    sys.exit(main())

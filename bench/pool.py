"""End-to-end pool benchmark: kvpool.Client put/get against a real master, side by side
with raw baselines measured in the same run.

Rows, per value size (64 KiB, 1 MiB, 16 MiB by default):
- raw memcpy (numpy.copyto) and raw TCP loopback (sendall + 1-byte ack / 1-byte request +
  recv_into, one value per round trip) — the baselines (``bench/baselines.py``);
- client put / get over the same-host path (the node's shared memory) and over TCP
  (``allow_shm=False``): a full put is PutStart (the value hashed meanwhile) + bytes +
  PutEnd; a full get is Get (lease) + bytes + checksum + Release, posted (its reply is
  read with the next call's);
- ``unpipelined``: the same with a client that waits for each Release's reply and hashes
  a put's value after PutStart's reply, as kvpool's did before 2026-11-29 — what
  pipelining saves, in the same run;
- the same with two client processes at once (aggregate);
- ``client batch get x16``: ``batch_get_into`` of 16 values (sizes up to 1 MiB), in
  GiB/s of all the bytes moved, against memcpy / raw TCP read of one value;
- ``segment write``: the copy alone into a fresh segment's never-touched pages, through
  a second mapping as a client has (its own page tables), created and attached without
  populating (as before 2026-11-29: a page fault per 4 KiB in each process) and with
  (``MADV_POPULATE_WRITE`` at create and attach) — both in the same round; and the
  same over TCP into the owner's mapping (a data server's ``recv_into``).
Metadata latency: ``exists``, ``batch_exists`` of 64 keys, and the control paths of a put
and a get alone (a 1-byte value: PutStart + write + PutEnd, Get + read + Release), back to
back; and a 1-byte get pipelined and not, sampled alternately, back to back and after 1 ms
idle.  The master's own handler cost, in-process (no socket): ``Get`` + ``Release`` of a
hit, against ``Exists``.  The time to populate a 256 MiB segment, in the owner and in a
process attaching.

Rows of a size are interleaved round by round, and each ratio is the median over rounds of
the row divided by its baseline in the same round, so load from other jobs hits both sides.

    python bench/pool.py [--sizes 64KiB,1MiB,16MiB] [--rounds 7] [--seconds 0.2] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import multiprocessing.queues as mpq
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _cli, _timing
from bench.baselines import memcpy, raw_tcp
from kvpool.client.client import Client
from kvpool.core.objects import IndexConfig
from kvpool.datapath.data_ops import write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.errors import KVPoolError
from kvpool.master.service import MasterService
from kvpool.protocol import messages as m
from kvpool.security.peer import PeerSettings
from kvpool.storage.segment import Segment
from kvpool.testing.processes import PoolProcess

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
# values per batch row, and the largest size with batch rows (the pinned batch keys of
# each size and path stay in the master's segment for the whole run)
BATCH = 16
BATCH_MAX_SIZE = 1 << 20


class UnpipelinedClient(Client):
    """The client before pipelining: a get waits for its Release's reply, a put hashes
    its value after PutStart's reply."""

    overlap_checksum_max = 0

    def _finish_read(self, owner: str, key: str) -> None:
        with contextlib.suppress(KVPoolError):
            self.call(m.Release(owner, [key]))


@dataclass
class Row:
    name: str
    size: int
    baseline: str = ""
    ops: list[float] = field(default_factory=list)  # ops/s per round
    ratios: list[float] = field(default_factory=list)


def timed(op: Callable[[], object], seconds: float) -> float:
    """ops/s of ``op`` run for about ``seconds`` (bounded: at least 3, at most 100k ops)."""
    n, start = 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - start < seconds and n < 100_000):
        op()
        n += 1
    return n / (time.perf_counter() - start)


def timed_row(op: Callable[[], object], seconds: float) -> Callable[[], float]:
    """A row's measurement for one round."""
    return lambda: timed(op, seconds)


# ------------------------------------------------------------------- segment pages
def segment_write(size: int, *, populate: bool) -> float:
    """ops/s of ``size``-byte copies into a new segment's untouched pages, through an
    attached mapping (a client's); the segment is made and mapped outside the timing."""
    total = max(64 << 20, 8 * size)
    src = np.ones(size, dtype=np.uint8)
    with (
        Segment.create(total, populate=populate) as owner,
        Segment.attach(owner.name, populate=populate) as seg,
    ):
        offsets = range(0, total - size + 1, size)
        start = time.perf_counter()
        for offset in offsets:
            seg.write(offset, src)
        return len(offsets) / (time.perf_counter() - start)


def tcp_segment_write(size: int, *, populate: bool) -> float:
    """ops/s of ``size``-byte TCP writes into a new segment's untouched pages: the data
    server's ``recv_into`` lands in the owner's mapping (a server thread here)."""
    total = max(64 << 20, 8 * size)
    src = np.ones(size, dtype=np.uint8)
    with Segment.create(total, populate=populate) as owner:
        server = SegmentServer(timeout_s=30.0)
        server.add_segment("s", owner)
        conn = SegmentConnection(*server.start(), PeerSettings(30.0))
        try:
            write(conn, "s", 0, b"x")  # connected before the timing
            offsets = range(0, total - size + 1, size)
            start = time.perf_counter()
            for offset in offsets:
                write(conn, "s", offset, src)
            return len(offsets) / (time.perf_counter() - start)
        finally:
            conn.close()
            server.close()


def populate_latency(size: int = 256 << 20, count: int = 3) -> list[tuple[str, float, float]]:
    """Seconds (as µs) to create a populated segment, and to attach it populated."""
    owner_s: list[float] = []
    attach_s: list[float] = []
    for _ in range(count):
        t = time.perf_counter()
        with Segment.create(size) as owner:
            owner_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            with Segment.attach(owner.name):
                attach_s.append(time.perf_counter() - t)
    label = f"{size >> 20} MiB"
    return [
        _percentiles(f"create segment {label} (populated)", owner_s),
        _percentiles(f"attach segment {label} (populated)", attach_s),
    ]


def handler_latency(count: int = 20_000) -> list[tuple[str, float, float]]:
    """The master's handler alone, in this process: Get + Release of a hit, and Exists,
    sampled alternately."""
    service = MasterService(IndexConfig())
    for request in (
        m.Register("n", "127.0.0.1:1", "token"),
        m.AddSegment("n", "n/mem", 1 << 30, "memory", "shm"),
        m.PutStart("c", "k", 4096),
        m.PutEnd("c", "k", 1),
    ):
        service.handle(request)
    handle = service.handle
    get, release, exists = m.Get("o", "k"), m.Release("o", ["k"]), m.Exists("k")
    pair: list[float] = []
    alone: list[float] = []
    for _ in range(count):
        t = time.perf_counter()
        handle(get)
        handle(release)
        pair.append(time.perf_counter() - t)
        t = time.perf_counter()
        handle(exists)
        alone.append(time.perf_counter() - t)
    service.close()
    return [
        _percentiles("master handler: Get + Release", pair),
        _percentiles("master handler: Exists", alone),
    ]


# -------------------------------------------------------------------- client processes
def _worker(
    address: str,
    shm: bool,
    size: int,
    seconds: float,
    tag: str,
    out: mpq.Queue[float],
    ready: threading.Barrier,
) -> None:
    with Client(address, allow_shm=shm) as c:
        value = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        into = np.empty(size, dtype=np.uint8)
        c.put_from(tag, value)
        c.pin([tag], "bench", ttl_ms=3_600_000)
        # One get first: a put of a key that exists moves no bytes, so the first get is
        # where this process maps the segment (populating its pages: ~35 ms per 512 MiB
        # here).  Then both timed together, neither against the other's start-up.
        c.get_into(tag, into)
        ready.wait(timeout=120)
        out.put(timed(lambda: c.get_into(tag, into), seconds))


@dataclass
class Bench:
    address: str
    seconds: float

    def client_rows(self, size: int) -> dict[str, Callable[[], float]]:
        rows: dict[str, Callable[[], float]] = {}
        for path, shm in (("shm", True), ("tcp", False)):
            c = Client(self.address, allow_shm=shm)
            value = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
            into = np.empty(size, dtype=np.uint8)
            n = [0]

            def put(c: Client = c, value: np.ndarray = value, n: list[int] = n) -> None:
                # a fresh key each time: a put of an existing key is a no-op
                c.put_from(f"{c.client_id}-{size}-{n[0]}", value)
                n[0] += 1

            c.put_from(f"{c.client_id}-{size}-get", value)
            # pinned: the fresh keys of the put rows must not evict what the get rows read
            c.pin([f"{c.client_id}-{size}-get"], "bench", ttl_ms=3_600_000)

            def get(c: Client = c, into: np.ndarray = into) -> None:
                c.get_into(f"{c.client_id}-{size}-get", into)

            unpipelined = UnpipelinedClient(self.address, allow_shm=shm)

            def get_unpipelined(
                w: Client = unpipelined, c: Client = c, into: np.ndarray = into
            ) -> None:
                w.get_into(f"{c.client_id}-{size}-get", into)

            rows[f"client put ({path})"] = timed_row(put, self.seconds)
            rows[f"client put ({path}) unpipelined"] = timed_row(
                functools.partial(put, unpipelined), self.seconds
            )
            rows[f"client get ({path})"] = timed_row(get, self.seconds)
            rows[f"client get ({path}) unpipelined"] = timed_row(get_unpipelined, self.seconds)
            rows[f"client get ({path}) x2"] = functools.partial(self.parallel, shm, size)
            if size <= BATCH_MAX_SIZE:
                rows[f"client batch get x{BATCH} ({path})"] = self.batch_get_row(c, size)
        return rows

    def batch_get_row(self, c: Client, size: int) -> Callable[[], float]:
        """``batch_get_into`` of BATCH pinned keys; ops/s counts values, not calls."""
        keys = [f"{c.client_id}-{size}-batch-{i}" for i in range(BATCH)]
        value = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
        assert c.batch_put(keys, [value] * BATCH) == [None] * BATCH
        c.pin(keys, "bench", ttl_ms=3_600_000)
        into = [np.empty(size, dtype=np.uint8) for _ in keys]

        def batch_get() -> None:
            c.batch_get_into(keys, into)

        return lambda: BATCH * timed(batch_get, self.seconds)

    def parallel(self, shm: bool, size: int) -> float:
        ctx = mp.get_context("spawn")
        out: mpq.Queue[float] = ctx.Queue()
        ready = ctx.Barrier(2)
        procs = [
            ctx.Process(
                target=_worker,
                args=(self.address, shm, size, self.seconds, f"p{i}-{shm}-{size}", out, ready),
            )
            for i in range(2)
        ]
        for p in procs:
            p.start()
        total = sum(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
        return float(total)


def _percentiles(name: str, samples: list[float]) -> tuple[str, float, float]:
    samples.sort()
    n = len(samples)
    return name, samples[n // 2] * 1e6, samples[int(n * 0.99)] * 1e6


def metadata_latency(address: str, count: int = 3000) -> list[tuple[str, float, float]]:
    """p50/p99 of single calls back to back; and of 1-byte gets pipelined against
    unpipelined, sampled alternately so load from other jobs hits both alike — back to
    back (in blocks of 50 calls) and each after 1 ms idle (a connector loads between
    compute steps: the master has handled the previous release by then)."""
    out = []
    with Client(address) as c, UnpipelinedClient(address) as w:
        c.put("meta", b"x")
        keys = [f"meta{i}" for i in range(64)]
        n = [0]

        def control_path() -> None:
            c.put(f"ctl{n[0]}", b"x")  # PutStart + 1-byte write + PutEnd
            n[0] += 1

        for name, op in (
            ("exists", lambda: c.exists("meta")),
            ("batch_exists(64)", lambda: c.batch_exists(keys)),
            ("put control path (1 B)", control_path),
        ):
            out.append(_percentiles(name, _timing.samples(op, count, warmup=200)))
        for label, idle_s, block, calls in (
            ("get control path (1 B)", 0.0, 50, count),
            ("get (1 B) after 1 ms idle", 0.001, 1, count // 3),
        ):
            pair = {"": (c, list[float]()), ", unpipelined": (w, list[float]())}
            for client, _ in pair.values():
                for _ in range(200):
                    client.get("meta")
            for _ in range(calls // block):
                for client, samples in pair.values():
                    for _ in range(block):
                        if idle_s:
                            time.sleep(idle_s)
                        t = time.perf_counter()
                        client.get("meta")
                        samples.append(time.perf_counter() - t)
            out.extend(_percentiles(label + suffix, s) for suffix, (_, s) in pair.items())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    biggest = max(sizes)
    # room for every fresh put key of the run (evictions keep it bounded anyway)
    # a loaded host takes more than the default 30 s to start and populate the segment
    segment = str(max(512 << 20, biggest * 24))
    with PoolProcess(
        ["master", "--port", "0", "--segment_size", segment], ready_timeout_s=180
    ) as master:
        bench = Bench(master.address, args.seconds)
        table: list[Row] = []
        for size in sizes:
            copy = memcpy(size)
            write, read, close = raw_tcp(size)
            baselines: dict[str, Callable[[], float]] = {
                "memcpy": timed_row(copy, args.seconds),
                "raw tcp write": timed_row(write, args.seconds),
                "raw tcp read": timed_row(read, args.seconds),
            }
            rows = {n: Row(n, size) for n in baselines}
            clients: dict[str, Callable[[], float]] = {
                "segment write (lazy pages)": functools.partial(
                    segment_write, size, populate=False
                ),
                "segment write (populated)": functools.partial(segment_write, size, populate=True),
                "segment write over tcp (lazy pages)": functools.partial(
                    tcp_segment_write, size, populate=False
                ),
                "segment write over tcp (populated)": functools.partial(
                    tcp_segment_write, size, populate=True
                ),
                **bench.client_rows(size),
            }
            base_of = {
                "segment write (lazy pages)": "memcpy",
                "segment write (populated)": "memcpy",
                "segment write over tcp (lazy pages)": "raw tcp write",
                "segment write over tcp (populated)": "raw tcp write",
                "client put (shm)": "memcpy",
                "client get (shm)": "memcpy",
                "client get (shm) x2": "client get (shm)",
                "client get (shm) unpipelined": "client get (shm)",
                "client put (shm) unpipelined": "client put (shm)",
                "client put (tcp) unpipelined": "client put (tcp)",
                "client get (tcp) unpipelined": "client get (tcp)",
                "client put (tcp)": "raw tcp write",
                "client get (tcp)": "raw tcp read",
                "client get (tcp) x2": "client get (tcp)",
                f"client batch get x{BATCH} (shm)": "memcpy",
                f"client batch get x{BATCH} (tcp)": "raw tcp read",
            }
            for n in clients:
                rows[n] = Row(n, size, base_of[n])
            every = {**baselines, **clients}
            for _ in range(args.rounds):
                this: dict[str, float] = {}
                for name, fn in every.items():
                    this[name] = fn()
                    rows[name].ops.append(this[name])
                for row in rows.values():
                    if row.baseline:
                        row.ratios.append(this[row.name] / this[row.baseline])
            close()
            table.extend(rows.values())
        meta = metadata_latency(master.address) + handler_latency() + populate_latency()
    print_table(table, meta, args.markdown)
    return 0


def print_table(rows: list[Row], meta: list[tuple[str, float, float]], markdown: bool) -> None:
    header = ("size", "path", "GiB/s", "ops/s", "ratio", "vs")
    lines = []
    for r in rows:
        ops = statistics.median(r.ops)
        ratio = f"{statistics.median(r.ratios):.0%}" if r.ratios else ""
        label = f"{r.size >> 10} KiB" if r.size < (1 << 20) else f"{r.size >> 20} MiB"
        lines.append(
            (label, r.name, f"{ops * r.size / (1 << 30):.2f}", f"{ops:,.0f}", ratio, r.baseline)
        )
    if markdown:
        _cli.markdown_table(header, lines)
        print("\n| metadata op | p50 µs | p99 µs |\n|---|---|---|")
        for name, p50, p99 in meta:
            print(f"| {name} | {p50:.0f} | {p99:.0f} |")
    else:
        for ln in [header, *lines]:
            print(f"{ln[0]:>8} {ln[1]:<30} {ln[2]:>7} {ln[3]:>10} {ln[4]:>6}  {ln[5]}")
        for name, p50, p99 in meta:
            print(f"{name:<40} p50 {p50:8.1f} µs   p99 {p99:8.1f} µs")


if __name__ == "__main__":
    raise SystemExit(main())

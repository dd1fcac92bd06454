"""Transfer benchmark: kvpool's data paths side by side with raw baselines, one run.

    .venv/bin/python bench/transfer.py                 # all sizes, plain table
    .venv/bin/python bench/transfer.py --markdown      # the table for docs/benchmarks.md
    .venv/bin/python bench/transfer.py --sizes 1MiB --seconds 1

Rows (each value size: 64 KiB, 1 MiB, 16 MiB by default):

- ``memcpy``            baseline: ``numpy.copyto`` between two preallocated buffers.
- ``raw tcp stream``    reference: one-way ``sendall`` / ``recv_into`` stream, no replies.
- ``raw tcp write``     baseline: ``sendall`` a value, peer ``recv_into`` + 1-byte ack.
- ``raw tcp read``      baseline: 1-byte request, peer ``sendall`` the value, ``recv_into``.
- ``tcp write/read``    kvpool: :class:`SegmentConnection` against a :class:`SegmentServer`
  in another process (framing, msgpack, bounds checks, error replies included).
- ``shm write/read``    kvpool: :class:`ShmConnection` on the node's segment (same host).
- ``tcp ... pipelined``  16 values per batch (``write_many`` / ``read_many_into``): one
  round trip per batch instead of per value.
- ``... xN``            the same from ``--clients`` processes at once (aggregate; ratio
  against one client).

Every peer runs in its own process, as a storage node would.  The rows of one size
run interleaved, ``--rounds`` times ``--seconds`` each, and each reports its median
round; ``ratio`` is against the baseline named in its ``vs`` column, measured in this
same run under the same load.

To add rows (e.g. full ``Client.put``/``get`` and metadata latency), write a
``*_cases`` function returning :class:`Case` objects (an ``op`` callable each; set
``vs`` to name the row it is compared to) and add them to ``cases`` in :func:`main`;
:func:`table` prints µs/op, so latency rows need nothing else (use ``size=0``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.baselines import recv_exactly
from kvpool.datapath.data_ops import read_into, read_many_into, write, write_many
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.datapath.shm import ShmConnection, host_token
from kvpool.security.peer import PeerSettings
from kvpool.storage.segment import Segment

GiB = 1 << 30
_CMD = struct.Struct("!cQQ")  # raw peer command: op, value size, count


@dataclass(frozen=True)
class Result:
    """One row: ``ops`` operations of ``size`` bytes in ``seconds``."""

    name: str
    size: int
    ops: int
    seconds: float
    vs: str = ""  # name of the baseline row (same size) the ratio is against
    per_round: tuple[float, ...] = ()  # GiB/s of each interleaved round, in order

    @property
    def gib_per_s(self) -> float:
        return self.ops * self.size / GiB / self.seconds

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds

    @property
    def latency_us(self) -> float:
        return self.seconds / self.ops * 1e6


@dataclass(frozen=True)
class Case:
    """One thing to measure: ``op`` moves ``per_op`` values of ``size`` bytes."""

    name: str
    size: int
    op: Callable[[], object]
    vs: str = ""
    per_op: int = 1


def run_once(case: Case, seconds: float) -> Result:
    """Run ``case.op`` for about ``seconds``."""
    ops = 0
    start = time.perf_counter()
    end = start + seconds
    while True:
        case.op()
        ops += 1
        now = time.perf_counter()
        if now >= end:
            break
    return Result(case.name, case.size, ops * case.per_op, now - start, case.vs)


def measure(cases: list[Case], seconds: float, rounds: int) -> list[Result]:
    """Interleave the cases for ``rounds`` rounds; each row is its median round.

    Interleaving puts a baseline and the path compared to it under the same machine
    conditions (other load drifts over seconds), and :func:`ratio` compares them
    round by round, so a burst of load hits both sides of a ratio alike.
    """
    for case in cases:  # warm-up: page faults, connections, caches
        for _ in range(3):
            case.op()
    runs: dict[str, list[Result]] = {case.name: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            runs[case.name].append(run_once(case, seconds))
    rows = []
    for case in cases:
        mid = sorted(runs[case.name], key=lambda r: r.gib_per_s)[rounds // 2]
        per_round = tuple(r.gib_per_s for r in runs[case.name])
        rows.append(Result(mid.name, mid.size, mid.ops, mid.seconds, mid.vs, per_round))
    return rows


# -- peers (each in its own process) ---------------------------------------------


def _raw_peer(ready: Connection, max_size: int) -> None:
    """A minimal TCP peer: no framing library, just the socket calls."""
    buf = memoryview(bytearray(max_size))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ready.send(listener.getsockname()[1])
        listener.settimeout(1.0)
        while not ready.poll():  # a thread per connection, until told to stop
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve_raw, args=(conn, buf), daemon=True).start()


def _serve_raw(conn: socket.socket, buf: memoryview) -> None:
    """One connection = one op at one size (sent first), so the loop is bare socket calls."""
    cmd = memoryview(bytearray(_CMD.size))
    if conn.recv_into(cmd, _CMD.size, socket.MSG_WAITALL) != _CMD.size:
        return
    op, size, batch = _CMD.unpack(cmd)
    value, ack = buf[:size], memoryview(bytearray(1))
    try:
        while True:
            if op == b"W":  # receive a value, ack it
                recv_exactly(conn, value)
                conn.sendall(b"k")
            elif op == b"R":  # a 1-byte request, answer with a value
                recv_exactly(conn, ack)
                conn.sendall(value)
            else:  # "S": a one-way stream of `batch` values, one ack at the end
                for _ in range(batch):
                    recv_exactly(conn, value)
                conn.sendall(b"k")
    except ConnectionError:
        return
    finally:
        conn.close()


def _segment_node(ready: Connection, size: int) -> None:
    """A storage node: one segment served over TCP, attachable by name on this host."""
    with Segment.create(size) as segment, SegmentServer(host_token=host_token()) as server:
        server.add_segment("bench", segment)
        ready.send((server.address[1], segment.name))
        ready.recv()  # run until the benchmark says stop


@contextmanager
def peer(target: Callable[[Connection, int], None], size: int) -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, size), daemon=True)
    proc.start()
    try:
        if not here.poll(60):
            raise RuntimeError(f"{target.__name__} did not start")
        yield here.recv()
    finally:
        here.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# -- measurements -------------------------------------------------------------------


def memcpy_cases(size: int) -> list[Case]:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    return [Case("memcpy", size, lambda: np.copyto(dst, src))]


def raw_tcp_cases(stack: ExitStack, port: int, size: int) -> list[Case]:
    value = memoryview(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    into = memoryview(bytearray(size))
    ack = memoryview(bytearray(1))
    batch = max(1, (16 << 20) // size)

    def connect(op: bytes) -> socket.socket:
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_CMD.pack(op, size, batch))
        return sock

    w, r, st = connect(b"W"), connect(b"R"), connect(b"S")

    def write() -> None:
        w.sendall(value)
        recv_exactly(w, ack)

    def read() -> None:
        r.sendall(b"r")
        recv_exactly(r, into)

    def stream() -> None:
        for _ in range(batch):
            st.sendall(value)
        recv_exactly(st, ack)

    return [
        Case("raw tcp stream", size, stream, per_op=batch),
        Case("raw tcp write", size, write),
        Case("raw tcp read", size, read),
    ]


def segment_tcp_cases(stack: ExitStack, port: int, size: int) -> list[Case]:
    value = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    into = np.empty_like(value)
    conn = stack.enter_context(SegmentConnection("127.0.0.1", port, PeerSettings(30)))
    # Pipelined batches of 16 values (one round trip per batch), as a batch_put would.
    writes: list[tuple[str, int, Any]] = [("bench", 0, value)] * 16
    reads: list[tuple[str, int, Any]] = [("bench", 0, into)] * 16
    return [
        Case("tcp write", size, lambda: write(conn, "bench", 0, value), "raw tcp write"),
        Case("tcp read", size, lambda: read_into(conn, "bench", 0, into), "raw tcp read"),
        Case(
            "tcp write x16 pipelined", size, lambda: write_many(conn, writes), "raw tcp write", 16
        ),
        Case(
            "tcp read x16 pipelined", size, lambda: read_many_into(conn, reads), "raw tcp read", 16
        ),
    ]


def segment_shm_cases(stack: ExitStack, shm_name: str, size: int) -> list[Case]:
    value = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    into = np.empty_like(value)
    shm = stack.enter_context(ShmConnection())
    shm.attach("bench", shm_name)
    return [
        Case("shm write", size, lambda: shm.write("bench", 0, value), "memcpy"),
        Case("shm read", size, lambda: shm.read_into("bench", 0, into), "memcpy"),
    ]


def _client_worker(
    conn: Connection, path: str, op_name: str, target: Any, size: int, offset: int
) -> None:
    """A client process for the parallel rows: its own connection, ops on request."""
    value = np.random.default_rng(offset).integers(0, 256, size, dtype=np.uint8)
    into = np.empty_like(value)
    with ExitStack() as stack:
        data: SegmentConnection | ShmConnection
        if path == "tcp":
            data = stack.enter_context(SegmentConnection("127.0.0.1", target, PeerSettings(30)))
        else:
            data = stack.enter_context(ShmConnection())
            data.attach("bench", target)

        def op() -> None:
            if isinstance(data, ShmConnection):  # a direct copy, not an op list
                if op_name == "write":
                    data.write("bench", offset, value)
                else:
                    data.read_into("bench", offset, into)
            elif op_name == "write":
                write(data, "bench", offset, value)
            else:
                read_into(data, "bench", offset, into)

        op()
        conn.send("ready")
        while (count := conn.recv()) is not None:
            for _ in range(count):
                op()
            conn.send(count)


def _stop_worker(proc: BaseProcess, pipe: Connection) -> None:
    pipe.send(None)
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def parallel_cases(stack: ExitStack, clients: int, path: str, target: Any, size: int) -> list[Case]:
    """``path`` ("tcp" or "shm") write and read from ``clients`` processes at once.

    Each client owns a disjoint ``size``-byte region of the segment.  One ``op`` tells
    every client to do a batch and waits for all of them, so the row is the aggregate
    throughput; its ratio is against the same path from one client (scaling).
    """
    ctx = mp.get_context("spawn")
    batch = max(1, (8 << 20) // size)
    cases = []
    for op_name in ("write", "read"):
        pipes: list[Connection] = []
        for i in range(clients):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_client_worker,
                args=(there, path, op_name, target, size, i * size),
                daemon=True,
            )
            proc.start()
            stack.callback(_stop_worker, proc, here)
            pipes.append(here)
        for pipe in pipes:
            if not pipe.poll(120):
                raise RuntimeError("a client process did not start")
            pipe.recv()

        def op(pipes: list[Connection] = pipes) -> None:
            for pipe in pipes:
                pipe.send(batch)
            for pipe in pipes:
                pipe.recv()

        name = f"{path} {op_name}"
        cases.append(Case(f"{name} x{clients}", size, op, name, per_op=batch * clients))
    return cases


# -- report ----------------------------------------------------------------------


def _size_label(size: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= div and size % div == 0:
            return f"{size // div} {unit}"
    return f"{size} B"


def ratio(row: Result, rows: list[Result]) -> float | None:
    """Median over rounds of ``row`` / its baseline in the same round (``None``: no baseline)."""
    base = next((r for r in rows if r.name == row.vs and r.size == row.size), None)
    if base is None:
        return None
    if len(base.per_round) == len(row.per_round) > 0:
        return statistics.median(c / b for c, b in zip(row.per_round, base.per_round, strict=True))
    return row.gib_per_s / base.gib_per_s


def table(rows: list[Result], markdown: bool) -> str:
    """Rows as a fixed-width (or Markdown) table with ratios to their baselines."""
    head = ["size", "path", "GiB/s", "ops/s", "µs/op", "ratio", "vs"]
    body = [
        [
            _size_label(r.size),
            r.name,
            f"{r.gib_per_s:.2f}",
            f"{r.ops_per_s:,.0f}",
            f"{r.latency_us:.1f}",
            "" if (q := ratio(r, rows)) is None else f"{q:.0%}",
            r.vs,
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in [head, *body]
    )


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    lower = text.strip().lower()
    for unit, mult in units.items():
        if lower.endswith(unit):
            return int(float(lower[: -len(unit)]) * mult)
    return int(lower)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB", help="comma-separated sizes")
    parser.add_argument("--seconds", type=float, default=0.1, help="time per row per round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--clients", type=int, default=2, help="also run tcp/shm from this many processes"
    )
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    largest = max(sizes)

    rows: list[Result] = []
    segment_size = largest * max(1, args.clients)
    with peer(_raw_peer, largest) as raw_port, peer(_segment_node, segment_size) as node:
        seg_port, shm_name = node
        for size in sizes:
            with ExitStack() as stack:
                cases = memcpy_cases(size)
                cases += segment_shm_cases(stack, shm_name, size)
                cases += raw_tcp_cases(stack, raw_port, size)
                cases += segment_tcp_cases(stack, seg_port, size)
                if args.clients > 1:
                    cases += parallel_cases(stack, args.clients, "shm", shm_name, size)
                    cases += parallel_cases(stack, args.clients, "tcp", seg_port, size)
                rows += measure(cases, args.seconds, args.rounds)
    cpu = platform.processor() or platform.machine()
    print(
        f"# {time.strftime('%Y-%m-%d')} · Python {platform.python_version()} · "
        f"{mp.cpu_count()} CPUs · {cpu}"
    )
    print(table(rows, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""kvpool and Mooncake Store side by side: the same put/get/batch/exists workload through
both, in one run, inside one private network namespace.

Mooncake binds every interface, so the bench makes one namespace
(:class:`kvpool.testing.mooncake.Namespace`: ``unshare -n``, only ``lo``) and runs all of
it there: kvpool's master (hosting no memory) and a ``kvpool node`` contributing the
pool's memory; ``mooncake_master`` and a store process contributing
``global_segment_size``; and the clients — kvpool's :class:`~kvpool.client.client.Client`
over its TCP transport (as a separate host would) and a ``MooncakeDistributedStore``
holding no memory, its buffers registered (``put_from`` / ``get_into`` /
``batch_put_from`` / ``batch_get_into``).  Both go over the same loopback.

Rows, per value size (64 KiB, 1 MiB, 16 MiB by default): put and get, single and batch
(×16 by default), in GiB/s for each engine, with kvpool/Mooncake and each engine against
raw TCP (sendall + 1-byte ack / 1-byte request + recv_into, one value per round trip) and
memcpy, measured in the same rounds.  Rows of a size are interleaved round by round and
each ratio is the median over rounds of the two sides' ratio in that round (as
``bench/pool.py`` does), the engines going first in turn, so load from other jobs hits
both alike.  Metadata: ``exists``
and ``batch_exists(64)`` p50/p99, sampled alternately with a raw TCP 1-byte round trip.

Without the Mooncake wheel the Mooncake columns are skipped with a line saying why, and
kvpool's rows run alone (kvpool binds only 127.0.0.1).  Every row is bounded in time
(``--seconds``) and in count (at most 100k calls, a put row at most ``3 × batch ×
biggest size`` bytes: what it stored is removed after it, outside the timing).

    python bench/vs_mooncake.py [--sizes 64KiB,1MiB,16MiB] [--batch 16] [--rounds 9]
                                [--seconds 0.2] [--meta-count 2000] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench.* and kvpool from this tree
    sys.path.insert(0, str(ROOT))

from bench import _cli  # noqa: E402
from bench.pool import _percentiles, raw_tcp  # noqa: E402
from bench.vs_mooncake_sides import KvpoolSide, MooncakeSide, Side, pythonpath  # noqa: E402
from kvpool.testing.mooncake import MooncakeMissing, Namespace, mooncake_binary  # noqa: E402

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
MAX_OPS = 100_000
META_KEYS = 64
_PUT_ROWS = itertools.count()


def parse_size(text: str) -> int:
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * scale
    return int(text)


def label(size: int) -> str:
    return f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"


@dataclass(frozen=True)
class Options:
    sizes: tuple[int, ...]
    batch: int
    rounds: int
    seconds: float
    meta_count: int

    @property
    def put_cap(self) -> int:
        """Bytes one put row may store before it is cleaned up."""
        return 3 * self.batch * max(self.sizes)

    @property
    def pool_size(self) -> int:
        """Memory each engine's storage process contributes: a put row's worth, the
        values the get rows read, and room for the allocators."""
        return max(256 << 20, (self.put_cap + self.batch * max(self.sizes)) * 5 // 4)


@dataclass
class Row:
    size: int
    op: str  # "put", "get", "batch×16 put", ...
    count: int  # values per call
    kvpool: list[float] = field(default_factory=list)  # bytes/s per round
    mooncake: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)  # raw TCP, same direction
    memcpy: list[float] = field(default_factory=list)


@dataclass
class Result:
    rows: list[Row]
    meta: list[tuple[str, float, float, float, float]]  # op, kvpool p50/p99, Mooncake p50/p99
    raw_rtt: tuple[float, float]  # raw TCP 1-byte round trip p50/p99, µs
    mooncake: bool


def timed(op: Callable[[], object], seconds: float, max_ops: int = MAX_OPS) -> float:
    """Calls/s of ``op`` run for about ``seconds`` (at least 3 calls, at most ``max_ops``)."""
    n, start = 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - start < seconds and n < max_ops):
        op()
        n += 1
    return n / (time.perf_counter() - start)


# ------------------------------------------------------------------------ measuring


def _put_row(side: Side, tag: str, count: int, buffers: list[np.ndarray], opts: Options) -> float:
    """Bytes/s of puts of fresh keys (a put of a stored key moves nothing); what they
    stored is removed afterwards, outside the timing."""
    done: list[str] = []
    size = buffers[0].nbytes
    tag = f"{tag}-{next(_PUT_ROWS)}"  # a key a failed removal left is never put again

    def op() -> None:
        keys = [f"{tag}-{len(done) + i}" for i in range(count)]
        side.put(keys, buffers[:count])
        done.extend(keys)

    rate = timed(op, opts.seconds, max(3, opts.put_cap // (count * size)))
    side.remove(done)
    return rate * count * size


def _get_row(get: Callable[[], None], nbytes: int, seconds: float) -> float:
    """Bytes/s of gets of stored keys, ``nbytes`` a call."""
    return timed(get, seconds) * nbytes


def measure(opts: Options, with_mooncake: bool) -> Result:
    """Every row, in this process's network namespace (a private one with Mooncake)."""
    biggest = max(opts.sizes)
    src = [np.random.default_rng(i).integers(0, 255, biggest, np.uint8) for i in range(opts.batch)]
    dst = [np.empty(biggest, np.uint8) for _ in range(opts.batch)]
    sides: dict[str, Side] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-vs-mooncake-") as workdir:
        try:
            sides["kvpool"] = KvpoolSide(opts.pool_size, Path(workdir))
            if with_mooncake:
                sides["mooncake"] = MooncakeSide(opts.pool_size, src + dst)
            rows = [row for size in opts.sizes for row in _size_rows(opts, sides, size, src, dst)]
            meta, rtt = _metadata(opts, sides)
        finally:
            for side in reversed(list(sides.values())):
                side.close()
    return Result(rows, meta, rtt, with_mooncake)


def measure_fields(fields: dict[str, Any]) -> Result:
    """:func:`measure` with Mooncake, called in the namespace."""
    return measure(Options(**fields), with_mooncake=True)


def _size_rows(
    opts: Options, sides: dict[str, Side], size: int, src: list[np.ndarray], dst: list[np.ndarray]
) -> list[Row]:
    srcs, dsts = [a[:size] for a in src], [a[:size] for a in dst]
    get_keys = [f"get-{size}-{i}" for i in range(opts.batch)]
    for side in sides.values():
        side.put(get_keys, srcs)
        side.keep(get_keys)
    write, read, close = raw_tcp(size)
    baseline: dict[str, Callable[[], float]] = {
        "raw put": lambda: timed(write, opts.seconds) * size,
        "raw get": lambda: timed(read, opts.seconds) * size,
        "memcpy": lambda: (
            timed(functools.partial(np.copyto, dsts[0], srcs[0]), opts.seconds) * size
        ),
    }
    rows: list[tuple[Row, dict[str, Callable[[], float]]]] = []
    for count in (1, opts.batch):
        prefix = "" if count == 1 else f"batch×{count} "
        put_fns: dict[str, Callable[[], float]] = {}
        get_fns: dict[str, Callable[[], float]] = {}
        for name, side in sides.items():
            put_fns[name] = functools.partial(
                _put_row, side, f"{name}-put-{size}-{count}", count, srcs, opts
            )
            get = functools.partial(side.get, get_keys[:count], dsts[:count])
            get_fns[name] = functools.partial(_get_row, get, count * size, opts.seconds)
        rows.append((Row(size, prefix + "put", count), put_fns))
        rows.append((Row(size, prefix + "get", count), get_fns))
    try:
        for n in range(opts.rounds):
            base = {name: fn() for name, fn in baseline.items()}
            for row, fns in rows:
                # the engines take turns going first: a load that rises or falls during a
                # round does not favour the same side every time
                for name, fn in sorted(fns.items(), reverse=n % 2 == 1):
                    getattr(row, name).append(fn())
                row.raw.append(base["raw put" if row.op.endswith("put") else "raw get"])
                row.memcpy.append(base["memcpy"])
    finally:
        close()
        for side in sides.values():
            side.remove(get_keys)
    return [row for row, _ in rows]


def _metadata(
    opts: Options, sides: dict[str, Side]
) -> tuple[list[tuple[str, float, float, float, float]], tuple[float, float]]:
    """exists / batch_exists(64) of stored keys, the engines and a raw TCP 1-byte round
    trip sampled alternately in blocks of 50 calls."""
    keys = [f"meta-{i}" for i in range(META_KEYS)]
    one = [np.ones(1, np.uint8)] * META_KEYS
    for side in sides.values():
        side.put(keys, one)
    _, rtt, close = raw_tcp(1)
    ops: dict[str, dict[str, Callable[[], object]]] = {
        "exists": {n: functools.partial(s.exists, keys[0]) for n, s in sides.items()},
        f"batch_exists({META_KEYS})": {
            n: functools.partial(s.batch_exists, keys) for n, s in sides.items()
        },
    }
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        for op, fns in ops.items():
            fns = {**fns, "raw": rtt}
            for fn in fns.values():
                for _ in range(100):  # warm
                    fn()
            for _ in range(max(1, opts.meta_count // 50)):
                for name, fn in fns.items():
                    got = samples.setdefault((op, name), [])
                    for _ in range(50):
                        t = time.perf_counter()
                        fn()
                        got.append(time.perf_counter() - t)
    finally:
        close()
        for side in sides.values():
            side.remove(keys)
    meta = []
    for op in ops:
        _, k50, k99 = _percentiles(op, samples[(op, "kvpool")])
        m50, m99 = _percentiles(op, samples.get((op, "mooncake"), [float("nan")]))[1:]
        meta.append((op, k50, k99, m50, m99))
    raw = samples[("exists", "raw")] + samples[(f"batch_exists({META_KEYS})", "raw")]
    return meta, _percentiles("raw", raw)[1:]


# ------------------------------------------------------------------------ the table
def _ratio(a: list[float], b: list[float]) -> str:
    pairs = [x / y for x, y in zip(a, b, strict=False) if y]
    if not pairs:
        return "—"
    ratio = statistics.median(pairs)
    return f"{ratio:.2f}×" if ratio >= 0.1 else f"{ratio:.3f}×"


def _gib(samples: list[float]) -> str:
    return f"{statistics.median(samples) / (1 << 30):.2f}" if samples else "—"


HEADER = (
    "size",
    "op",
    "kvpool GiB/s",
    "Mooncake GiB/s",
    "kvpool / Mooncake",
    "kvpool / raw TCP",
    "Mooncake / raw TCP",
    "raw TCP GiB/s",
    "kvpool / memcpy",
)
META_HEADER = (
    "op",
    "kvpool p50 µs",
    "kvpool p99 µs",
    "Mooncake p50 µs",
    "Mooncake p99 µs",
    "kvpool / Mooncake (p50)",
    "kvpool / raw TCP RTT (p50)",
)


def table(result: Result) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    rows: list[tuple[str, ...]] = [
        (
            label(r.size),
            r.op,
            _gib(r.kvpool),
            _gib(r.mooncake),
            _ratio(r.kvpool, r.mooncake),
            _ratio(r.kvpool, r.raw),
            _ratio(r.mooncake, r.raw),
            _gib(r.raw),
            _ratio(r.kvpool, r.memcpy),
        )
        for r in result.rows
    ]
    raw50 = result.raw_rtt[0]
    meta = [
        (
            op,
            f"{k50:.0f}",
            f"{k99:.0f}",
            *((f"{m50:.0f}", f"{m99:.0f}", f"{k50 / m50:.2f}×") if result.mooncake else "———"),
            f"{k50 / raw50:.1f}×",
        )
        for op, k50, k99, m50, m99 in result.meta
    ]
    meta.append(
        ("raw TCP 1-byte round trip", f"{raw50:.0f}", f"{result.raw_rtt[1]:.0f}", "", "", "", "")
    )
    return rows, meta


def print_table(result: Result, markdown: bool) -> None:
    rows, meta = table(result)
    for header, lines in ((HEADER, rows), (META_HEADER, meta)):
        if markdown:
            _cli.markdown_table(header, lines)
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
            for ln in (header, *lines):
                print("  ".join(str(x).rjust(w) for x, w in zip(ln, widths, strict=True)))
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--meta-count", type=int, default=2000)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    opts = Options(
        tuple(parse_size(s) for s in args.sizes.split(",")),
        max(2, args.batch),
        max(1, args.rounds),
        args.seconds,
        max(50, args.meta_count),
    )
    os.environ["PYTHONPATH"] = pythonpath()  # the namespace's processes import this tree
    try:
        mooncake_binary()
    except MooncakeMissing as exc:
        print(f"Mooncake rows skipped: {exc}", flush=True)
        result = measure(opts, with_mooncake=False)
    else:
        # one row takes ~seconds; the whole run is bounded by rows × rounds
        with Namespace(timeout_s=1800.0) as ns:
            # as fields: this script's own classes pickle as __main__'s
            result = ns.run("bench.vs_mooncake:measure_fields", dataclasses.asdict(opts))
    print_table(result, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

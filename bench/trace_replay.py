"""Trace replay: prefix hit ratio and replay speed of the eviction policies on a real trace.

    .venv/bin/python bench/trace_replay.py                    # table, all policies/capacities
    .venv/bin/python bench/trace_replay.py --json             # one JSON object per line
    .venv/bin/python bench/trace_replay.py --policy prefix_aware --capacity 10000 --mode direct
    .venv/bin/python bench/trace_replay.py --repeat 3         # fastest of 3 replays per row
    .venv/bin/python bench/trace_synth.py                     # other traces: policy vs LRU
    .venv/bin/python bench/policy_matrix.py                   # every policy, every trace

The trace is Mooncake's (``../shared/data/mooncake_conversation_trace.jsonl`` by default;
format in ``../shared/data/README.md``): one request per line with ``timestamp`` (ms) and
``hash_ids``, chained prefix hashes of 512-token blocks.  Requests are replayed in order
against a pool of ``--capacity`` blocks.  A request's hits are its leading blocks already
cached (one prefix lookup); its hit blocks are read, its other blocks written.  The hit
ratio is hit blocks / all blocks.

Modes:

- ``direct`` (default): the policy alone, fed exactly the calls the index makes (a set of
  cached keys stands in for the index).  Hit ratios are identical to ``index`` (a test
  checks it); the speed is the eviction policy's own.
- ``index``: through the core, as the master runs it: one
  :class:`~kvpool.core.index.ObjectIndex` with one memory segment of
  ``capacity * BLOCK_BYTES`` bytes; per request ``prefix_lookup``, ``get`` (a read lease,
  ``now_ms`` = the trace timestamp) per hit, ``put_start``/``put_end`` per missing block
  (inline eviction makes room; the request's leased hits cannot be evicted), then
  ``release_owner``.  ``belady`` cannot run inside the index (it needs the future), so
  its row always comes from ``direct``.  Not the default because it is several times
  slower than ``direct`` for the same hit ratios (about 120-300 thousand blocks per
  CPU-second on a 2-core VM, against 0.4-2 million; docs/benchmarks.md says where the
  time goes).

``belady`` is the offline optimum reference: evict the cached block whose next use is
farthest in the future (next uses precomputed from the whole trace).  ``vs_belady`` and
``vs_lru`` are ratios of hit ratios measured in this same run; ``blocks_per_s`` is
trace blocks replayed per second of the replay loop (loading excluded).  With
``--repeat N`` each row is replayed N times and the replay that used the least CPU time is
reported (on a shared host one replay's speed can be off by 2x); the hits of every replay
must agree, since policies are deterministic.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool.core.eviction import (
    EVICTION_POLICIES,
    EVICTION_POLICY_ALIASES,
    EvictionPolicy,
    canonical_eviction_policy,
    make_eviction_policy,
)
from kvpool.core.index import ObjectIndex
from kvpool.core.objects import IndexConfig
from kvpool.errors import NoSpace

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_CAPACITIES",
    "DEFAULT_TRACE",
    "BeladyPolicy",
    "Request",
    "Result",
    "load_trace",
    "main",
    "replay_direct",
    "replay_index",
    "run",
]

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_conversation_trace.jsonl"
)
DEFAULT_CAPACITIES = (2000, 5000, 10000, 20000)
ALL_POLICIES = (*EVICTION_POLICIES, "belady")
MODES = ("direct", "index")
BLOCK_BYTES = 64 * 1024  # any fixed size: every block of the trace is one full chunk


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    capacity: int
    hit_ratio: float
    blocks_per_s: float
    mode: str
    hits: int
    blocks: int
    seconds: float
    cpu_blocks_per_s: float  # per second of this process's CPU time: steadier on a busy host


def load_trace(path: Path) -> list[Request]:
    """Parse a Mooncake-format JSONL trace; a bad line is a ValueError naming it."""
    requests: list[Request] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ts = obj["timestamp"]
                ids = obj["hash_ids"]
                if not isinstance(ts, int) or isinstance(ts, bool) or ts < 0:
                    raise ValueError("timestamp must be a non-negative integer")
                if not isinstance(ids, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in ids
                ):
                    raise ValueError("hash_ids must be a list of integers")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from exc
            requests.append(Request(ts, tuple(ids)))
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    return requests


# ------------------------------------------------------------------------------- Belady
class BeladyPolicy:
    """Offline optimum: evicts the cached key whose next use is farthest away.

    Follows the eviction protocol plus :meth:`begin_request`, which the replay calls
    before each request so the policy knows "now".  Keys never used again go first.
    This is the classic block-level optimum; with prefix hits it is a near-optimal
    reference, not a bound (a cached block after a request's first miss counts for
    nothing, and on small synthetic traces LRU can beat it by a block or two).
    """

    name = "belady"

    def __init__(self, requests: Sequence[Request]) -> None:
        self._uses: dict[Hashable, list[int]] = {}
        for i, req in enumerate(requests):
            for key in req.blocks:
                self._uses.setdefault(key, []).append(i)
        self._ptr: dict[Hashable, int] = {}
        self._next: dict[Hashable, int] = {}  # cached key -> its next use
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, seq, key), lazy
        self._seq = 0
        self._now = -1
        self._never = len(requests)

    def begin_request(self, index: int) -> None:
        self._now = index

    def _touch(self, key: Hashable) -> None:
        uses = self._uses.get(key, ())
        i = self._ptr.get(key, 0)
        while i < len(uses) and uses[i] <= self._now:
            i += 1
        self._ptr[key] = i
        nxt = uses[i] if i < len(uses) else self._never
        self._next[key] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        self._touch(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._next:
            self._touch(key)

    def on_remove(self, key: Hashable) -> None:
        self._next.pop(key, None)

    def choose_victims(self, count: int, can_evict: Callable[[Any], bool]) -> list[Any]:
        out: list[Any] = []
        held: list[tuple[int, int, Hashable]] = []
        heap = self._heap
        while heap and len(out) < count:
            entry = heapq.heappop(heap)
            key = entry[2]
            if self._next.get(key) != -entry[0]:
                continue  # stale: removed or touched since
            held.append(entry)
            if can_evict(key):
                out.append(key)
        for entry in held:  # choosing removes nothing
            heapq.heappush(heap, entry)
        return out


# ------------------------------------------------------------------------------ replays
def replay_direct(
    requests: Sequence[Request], policy: EvictionPolicy[Any], capacity: int
) -> tuple[int, int, float, float]:
    """Replay with the policy alone; returns (hit blocks, all blocks, wall s, CPU s)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    begin: Callable[[int], None] | None = getattr(policy, "begin_request", None)
    cached: set[int] = set()
    on_access, on_insert, on_remove = policy.on_access, policy.on_insert, policy.on_remove
    choose = policy.choose_victims
    hits = blocks = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(requests):
        if begin is not None:
            begin(i)
        keys = req.blocks
        n = len(keys)
        blocks += n
        h = 0
        while h < n and keys[h] in cached:
            h += 1
        hits += h
        for k in keys[:h]:
            on_access(k)
        leased = keys[:h]

        def can_evict(k: int, leased: tuple[int, ...] = leased) -> bool:
            return k not in leased

        for j in range(h, n):
            k = keys[j]
            if k in cached:
                continue  # duplicate put of a READY key: a no-op
            if len(cached) >= capacity:
                victims = choose(1, can_evict)
                if not victims:
                    break  # everything is leased: the put fails with NoSpace
                cached.discard(victims[0])
                on_remove(victims[0])
            cached.add(k)
            on_insert(k, keys[j - 1] if j else None)
    return hits, blocks, time.perf_counter() - t0, time.process_time() - c0


def replay_index(
    requests: Sequence[Request], policy: str, capacity: int
) -> tuple[int, int, float, float]:
    """Replay through :class:`ObjectIndex`; returns (hit blocks, all blocks, wall s, CPU s)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    names = [tuple(str(b) for b in req.blocks) for req in requests]
    idx = ObjectIndex(IndexConfig(policy=policy))
    idx.register_client("bench", 0)
    idx.add_segment("bench", "bench/mem", capacity * BLOCK_BYTES)
    hits = blocks = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(requests):
        keys = names[i]
        now = req.timestamp_ms
        owner = f"r{i}"
        blocks += len(keys)
        h = idx.prefix_lookup(keys)
        hits += h
        for k in keys[:h]:
            idx.get(k, owner, now)
        parent = keys[h - 1] if h else None
        try:
            for k in keys[h:]:
                res, _ = idx.put_start(k, BLOCK_BYTES, owner, now, parent)
                if res is not None:
                    idx.put_end(k, owner, now)
                parent = k
        except NoSpace:
            pass  # every cached block is leased by this request: the rest is not cached
        idx.release_owner(owner)
    return hits, blocks, time.perf_counter() - t0, time.process_time() - c0


def _replay_once(
    requests: Sequence[Request], name: str, capacity: int, mode: str
) -> tuple[tuple[int, int, float, float], str]:
    if name == "belady":
        return replay_direct(requests, BeladyPolicy(requests), capacity), "direct"
    if mode == "index":
        return replay_index(requests, name, capacity), "index"
    return replay_direct(requests, make_eviction_policy(name), capacity), "direct"


def run(
    requests: Sequence[Request],
    policies: Sequence[str],
    capacities: Sequence[int],
    mode: str,
    repeat: int = 1,
) -> list[Result]:
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    results: list[Result] = []
    for capacity in capacities:
        for name in policies:
            (hits, blocks, secs, cpu), used = _replay_once(requests, name, capacity, mode)
            for _ in range(repeat - 1):
                (h, b, s, c), _ = _replay_once(requests, name, capacity, mode)
                if (h, b) != (hits, blocks):
                    raise RuntimeError(f"{name} at {capacity}: replays disagree ({h} != {hits})")
                if c < cpu:
                    secs, cpu = s, c
            results.append(
                Result(
                    name,
                    capacity,
                    hits / blocks,
                    blocks / secs,
                    used,
                    hits,
                    blocks,
                    secs,
                    blocks / max(cpu, 1e-9),
                )
            )
    return results


def _ratios(results: Sequence[Result]) -> list[dict[str, Any]]:
    by = {(r.policy, r.capacity): r.hit_ratio for r in results}
    rows = []
    for r in results:
        row: dict[str, Any] = asdict(r)
        for ref in ("belady", "lru"):
            base = by.get((ref, r.capacity))
            row[f"vs_{ref}"] = r.hit_ratio / base if base else None
        rows.append(row)
    return rows


def _table(rows: Sequence[dict[str, Any]]) -> str:
    def ratio(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    lines = [
        f"{'policy':<12} {'capacity':>8} {'hit ratio':>9} {'vs belady':>9} {'vs lru':>7} "
        f"{'blocks/s':>10} {'per cpu-s':>10}  mode"
    ]
    for r in rows:
        lines.append(
            f"{r['policy']:<12} {r['capacity']:>8} {r['hit_ratio']:>9.4f} "
            f"{ratio(r['vs_belady']):>9} {ratio(r['vs_lru']):>7} "
            f"{r['blocks_per_s']:>10,.0f} {r['cpu_blocks_per_s']:>10,.0f}  {r['mode']}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument(
        "--capacity", type=int, nargs="+", default=list(DEFAULT_CAPACITIES), help="in blocks"
    )
    p.add_argument(
        "--policy",
        nargs="+",
        choices=(*ALL_POLICIES, *EVICTION_POLICY_ALIASES),
        default=list(ALL_POLICIES),
        help="policies to replay (all by default; the name default is an alias of prefix_aware)",
    )
    p.add_argument("--mode", choices=MODES, default="direct", help="see the module docstring")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--repeat", type=int, default=1, help="replays per row; the least CPU time is kept"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if any(c <= 0 for c in args.capacity):
        print("error: --capacity values must be positive", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("error: --repeat must be at least 1", file=sys.stderr)
        return 2
    try:
        requests = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # an alias replays (and is reported as) the policy it means
    policies = list(
        dict.fromkeys(p if p == "belady" else canonical_eviction_policy(p) for p in args.policy)
    )
    rows = _ratios(run(requests, policies, args.capacity, args.mode, args.repeat))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        blocks = rows[0]["blocks"]
        print(f"{args.trace.name}: {len(requests):,} requests, {blocks:,} blocks")
        print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

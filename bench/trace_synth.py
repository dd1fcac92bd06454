"""Other traces of the Mooncake format: synthetic ones with different reuse patterns and
slices of the real trace, and the default policy against LRU (and Belady) on each.

    .venv/bin/python bench/trace_synth.py                   # every trace, table
    .venv/bin/python bench/trace_synth.py --json            # one JSON object per line
    .venv/bin/python bench/trace_synth.py --trace chat scan --requests 4000
    .venv/bin/python bench/trace_synth.py --write chat --out chat.jsonl   # the trace itself

A policy tuned on one trace can lose to LRU on another; this is where "never below LRU"
is checked.  Every trace replays from an empty pool at capacities given as fractions of
its distinct blocks (the real trace's 2,000 / 5,000 / 10,000 / 20,000 blocks are 1.1 /
2.7 / 5.5 / 11 % of its 182,790), so small and large traces are compared alike.

The synthetic traces (deterministic: each is made from its own numbered random stream):

- ``chat``: multi-turn conversations under a few shared system prompts; a turn repeats
  the previous turn's blocks (except the last, partial one) and adds new ones; a
  conversation comes back with probability 0.55 after a gap of about 300 requests;
- ``docs``: one-turn requests over documents of Zipf popularity (exponent 1.1), each a
  document's blocks plus one to three blocks of its own: frequency matters;
- ``scan``: a working set of conversations, larger than most capacities, visited in a
  fixed round robin between one-shot requests (LRU's worst case);
- ``recent``: conversations that come back soon (a gap of about 20 requests) and rarely
  late, between one-shot requests (LRU's best case: recency is all there is);
- ``real-1/3``, ``real-2/3``, ``real-3/3``: the real trace cut in three, each replayed
  alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ is sys.path[0]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trace_replay import DEFAULT_TRACE, BeladyPolicy, Request, load_trace, replay_direct
from kvpool.core.eviction import make_eviction_policy

__all__ = [
    "FRACTIONS",
    "SYNTHETIC",
    "chat",
    "compare",
    "docs",
    "main",
    "real_slices",
    "recent",
    "scan",
    "write_trace",
]

FRACTIONS = (0.01, 0.025, 0.05, 0.1)
BLOCK_TOKENS = 512


class _Ids:
    """Fresh block ids, one counter per trace."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _geometric(rng: random.Random, mean: float) -> int:
    """1, 2, 3, ... with the given mean."""
    n = 1
    while rng.random() > 1.0 / mean:
        n += 1
    return n


def _finish(slots: dict[int, list[tuple[int, ...]]], n: int) -> list[Request]:
    """Requests in slot order, 10 ms apart, at most ``n``."""
    out: list[Request] = []
    for slot in sorted(slots):
        for blocks in slots[slot]:
            out.append(Request(len(out) * 10, blocks))
            if len(out) >= n:
                return out
    return out


def chat(n: int = 6000, stream: int = 1) -> list[Request]:
    rng = random.Random(stream)
    ids = _Ids()
    prompts = [ids.take(2) for _ in range(4)]
    slots: dict[int, list[tuple[int, ...]]] = {}
    for start in range(n):
        turn = rng.choice(prompts) + ids.take(_geometric(rng, 8))
        slot = start
        while slot < 4 * n:
            slots.setdefault(slot, []).append(tuple(turn))
            if rng.random() > 0.55:
                break
            slot += 1 + int(rng.expovariate(1 / 300))
            turn = turn[:-1] + ids.take(_geometric(rng, 4) + 1)
        if sum(map(len, slots.values())) >= 2 * n:
            break
    return _finish(slots, n)


def docs(n: int = 6000, stream: int = 2) -> list[Request]:
    rng = random.Random(stream)
    ids = _Ids()
    root = ids.take(1)
    library = [root + ids.take(rng.randint(8, 32)) for _ in range(2000)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(library))]
    picks = rng.choices(library, weights, k=n)
    return [
        Request(i * 10, tuple(doc + ids.take(rng.randint(1, 3)))) for i, doc in enumerate(picks)
    ]


def scan(n: int = 6000, stream: int = 3) -> list[Request]:
    rng = random.Random(stream)
    ids = _Ids()
    loop = [tuple(ids.take(rng.randint(4, 16))) for _ in range(100)]
    out: list[Request] = []
    i = 0
    while len(out) < n:
        if rng.random() < 0.5:
            out.append(Request(len(out) * 10, loop[i % len(loop)]))
            i += 1
        else:
            out.append(Request(len(out) * 10, tuple(ids.take(rng.randint(4, 16)))))
    return out


def recent(n: int = 6000, stream: int = 4) -> list[Request]:
    rng = random.Random(stream)
    ids = _Ids()
    slots: dict[int, list[tuple[int, ...]]] = {}
    for start in range(n):
        turn = ids.take(_geometric(rng, 6))
        slot = start
        while slot < 4 * n:
            slots.setdefault(slot, []).append(tuple(turn))
            if rng.random() > 0.6:
                break
            gap = rng.expovariate(1 / 20) if rng.random() < 0.9 else rng.expovariate(1 / 2000)
            slot += 1 + int(gap)
            turn = turn[:-1] + ids.take(_geometric(rng, 3) + 1)
        if sum(map(len, slots.values())) >= 2 * n:
            break
    return _finish(slots, n)


SYNTHETIC: dict[str, Callable[[int, int], list[Request]]] = {
    "chat": chat,
    "docs": docs,
    "scan": scan,
    "recent": recent,
}
REAL_SLICES = ("real-1/3", "real-2/3", "real-3/3")


def real_slices(requests: Sequence[Request], parts: int = 3) -> list[list[Request]]:
    """The trace cut in ``parts`` consecutive pieces of (nearly) equal request count."""
    step = -(-len(requests) // parts)
    return [list(requests[i : i + step]) for i in range(0, len(requests), step)]


def write_trace(requests: Sequence[Request], path: Path) -> None:
    """Write requests as a Mooncake-format JSONL trace (lengths from the block counts)."""
    with path.open("w", encoding="utf-8") as f:
        for req in requests:
            line = {
                "timestamp": req.timestamp_ms,
                "input_length": len(req.blocks) * BLOCK_TOKENS,
                "output_length": 1,
                "hash_ids": list(req.blocks),
            }
            f.write(json.dumps(line) + "\n")


def compare(
    name: str,
    requests: Sequence[Request],
    policy: str = "prefix_aware",
    fractions: Sequence[float] = FRACTIONS,
    belady: bool = True,
) -> list[dict[str, Any]]:
    """``policy`` against LRU (and Belady) on one trace, one row per capacity."""
    distinct = len({k for r in requests for k in r.blocks})
    rows: list[dict[str, Any]] = []
    for frac in fractions:
        capacity = max(1, round(frac * distinct))
        row: dict[str, Any] = {"trace": name, "fraction": frac, "capacity": capacity}
        for label, make in (
            ("lru", lambda: make_eviction_policy("lru")),
            ("policy", lambda: make_eviction_policy(policy)),
            ("belady", lambda: BeladyPolicy(requests)),
        ):
            if label == "belady" and not belady:
                continue
            hits, blocks, _, _ = replay_direct(requests, make(), capacity)
            row[label] = hits / blocks
        row["vs_lru"] = row["policy"] / row["lru"] if row["lru"] else None
        if belady:
            row["vs_belady"] = row["policy"] / row["belady"] if row["belady"] else None
            row["lru_vs_belady"] = row["lru"] / row["belady"] if row["belady"] else None
        rows.append(row)
    return rows


def _traces(names: Sequence[str], n: int, real: Path) -> list[tuple[str, list[Request]]]:
    out: list[tuple[str, list[Request]]] = []
    slices: list[list[Request]] | None = None
    for name in names:
        if name in SYNTHETIC:
            out.append((name, SYNTHETIC[name](n, list(SYNTHETIC).index(name) + 1)))
        else:
            if slices is None:
                slices = real_slices(load_trace(real))
            out.append((name, slices[REAL_SLICES.index(name)]))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choices = (*SYNTHETIC, *REAL_SLICES)
    p.add_argument("--trace", nargs="+", choices=choices, default=list(choices))
    p.add_argument("--requests", type=int, default=6000, help="per synthetic trace")
    p.add_argument("--real", type=Path, default=DEFAULT_TRACE, help="the trace to slice")
    p.add_argument("--policy", default="prefix_aware", help="compared with lru")
    p.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--write", choices=tuple(SYNTHETIC), help="write this trace and stop")
    p.add_argument("--out", type=Path, help="where --write writes (JSONL)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.requests < 1:
        print("error: --requests must be at least 1", file=sys.stderr)
        return 2
    if args.write:
        if args.out is None:
            print("error: --write needs --out FILE", file=sys.stderr)
            return 2
        gen = SYNTHETIC[args.write]
        write_trace(gen(args.requests, list(SYNTHETIC).index(args.write) + 1), args.out)
        return 0
    try:
        make_eviction_policy(args.policy)
        traces = _traces(args.trace, args.requests, args.real)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    belady = not args.no_belady
    rows = [r for name, reqs in traces for r in compare(name, reqs, args.policy, FRACTIONS, belady)]
    below = [r for r in rows if r["policy"] < r["lru"]]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'trace':<9} {'capacity':>8} {'lru':>7} {'policy':>7} {'× lru':>6} {'belady':>7}")
    for r in rows:
        bel = f"{r['belady']:>7.4f}" if "belady" in r else "      -"
        vs = f"{r['vs_lru']:>6.3f}" if r["vs_lru"] is not None else "     -"
        print(f"{r['trace']:<9} {r['capacity']:>8} {r['lru']:>7.4f} {r['policy']:>7.4f} {vs} {bel}")
    print("below LRU: " + (", ".join(f"{r['trace']}@{r['capacity']}" for r in below) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

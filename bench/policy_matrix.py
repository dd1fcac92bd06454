"""Every eviction policy on every trace at two capacities, against LRU and Belady.

    .venv/bin/python bench/policy_matrix.py                  # markdown table
    .venv/bin/python bench/policy_matrix.py --json           # one JSON object per line
    .venv/bin/python bench/policy_matrix.py --trace real chat --policy s3fifo arc
    .venv/bin/python bench/policy_matrix.py --mode index --trace real   # with per-put speed

Traces: ``real`` (the shared Mooncake conversation trace, whole) and the synthetic shapes
of ``bench/trace_synth.py`` (``chat``, ``docs``, ``scan``, ``recent``).  Capacities: a
fixed number of blocks (``--blocks``, 10,000) and a share of each trace's distinct blocks
(``--fraction``, 5 %).  Each row is :func:`bench.trace_replay.run` on one trace and
capacity, so LRU, Belady and the policies are measured in the same run; ``vs_lru`` and
``vs_belady`` are ratios of hit ratios.  ``met`` says which of the targets a row meets:
at the fixed size ≥ 0.7 × Belady, at the share ≥ 1.15 × LRU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ is sys.path[0]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trace_replay import DEFAULT_TRACE, MODES, Request, _ratios, load_trace, run
from bench.trace_synth import SYNTHETIC
from kvpool.core.eviction import EVICTION_POLICIES

__all__ = ["TARGET_VS_BELADY", "TARGET_VS_LRU", "main", "matrix"]

TARGET_VS_BELADY = 0.7  # at --blocks
TARGET_VS_LRU = 1.15  # at --fraction
TRACES = ("real", *SYNTHETIC)
_REFS = ("lru", "belady")


def matrix(
    traces: Sequence[tuple[str, Sequence[Request]]],
    policies: Sequence[str],
    blocks: int,
    fraction: float,
    mode: str = "direct",
) -> list[dict[str, Any]]:
    """One row per trace, capacity and policy (LRU and Belady included)."""
    names = list(dict.fromkeys(["lru", *policies, "belady"]))
    rows: list[dict[str, Any]] = []
    for trace, requests in traces:
        distinct = len({k for r in requests for k in r.blocks})
        share = max(1, round(fraction * distinct))
        for label, capacity in (("blocks", blocks), ("fraction", share)):
            for row in _ratios(run(requests, names, [capacity], mode)):
                row["trace"] = trace
                row["distinct"] = distinct
                row["size"] = "fixed" if label == "blocks" else f"{fraction:.0%}"
                if label == "blocks":
                    row["met"] = (row["vs_belady"] or 0) >= TARGET_VS_BELADY
                elif row["vs_lru"] is None:  # LRU hit nothing: any hit is infinitely more
                    row["met"] = row["hit_ratio"] > 0
                else:
                    row["met"] = row["vs_lru"] >= TARGET_VS_LRU
                rows.append(row)
    return rows


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def _markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One line per trace and capacity; a policy's cell is its hit ratio, × LRU, ×
    Belady, and a check mark where it meets that capacity's target."""
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] not in _REFS))
    speed = any(r["mode"] == "index" for r in rows)
    head = ["trace", "capacity", "LRU", "Belady", *policies]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    by_case: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault((r["trace"], r["capacity"]), {})[r["policy"]] = r
    for (trace, capacity), case in by_case.items():
        any_row = next(iter(case.values()))
        size = (
            f"{capacity:,}" if any_row["size"] == "fixed" else f"{capacity:,} ({any_row['size']})"
        )
        cells = [
            trace,
            size,
            f"{case['lru']['hit_ratio']:.4f}",
            f"{case['belady']['hit_ratio']:.4f}",
        ]
        for name in policies:
            r = case[name]
            cell = f"{r['hit_ratio']:.4f} · {_x(r['vs_lru'])} · {_x(r['vs_belady'])}"
            if r["met"]:
                cell += " ✓"
            if speed:
                cell += f" · {r['cpu_blocks_per_s'] / 1000:,.0f}k/s"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", nargs="+", choices=TRACES, default=list(TRACES))
    p.add_argument("--policy", nargs="+", choices=EVICTION_POLICIES, default=EVICTION_POLICIES)
    p.add_argument("--blocks", type=int, default=10_000, help="the fixed capacity")
    p.add_argument("--fraction", type=float, default=0.05, help="of each trace's distinct blocks")
    p.add_argument("--requests", type=int, default=6000, help="per synthetic trace")
    p.add_argument("--real", type=Path, default=DEFAULT_TRACE, help="the real trace")
    p.add_argument("--mode", choices=MODES, default="direct", help="as bench/trace_replay.py")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.blocks < 1 or not 0 < args.fraction <= 1 or args.requests < 1:
        print(
            "error: --blocks and --requests must be positive, --fraction in (0, 1]", file=sys.stderr
        )
        return 2
    traces: list[tuple[str, Sequence[Request]]] = []
    for name in args.trace:
        if name == "real":
            try:
                traces.append((name, load_trace(args.real)))
            except (OSError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        else:
            traces.append((name, SYNTHETIC[name](args.requests, list(SYNTHETIC).index(name) + 1)))
    rows = matrix(traces, args.policy, args.blocks, args.fraction, args.mode)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

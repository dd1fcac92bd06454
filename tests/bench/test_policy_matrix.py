from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.policy_matrix import TARGET_VS_BELADY, TARGET_VS_LRU, matrix
from bench.trace_synth import chat, scan

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "policy_matrix.py"


def test_rows_cover_every_policy_and_both_capacities_with_same_run_ratios() -> None:
    traces = [("chat", chat(300, 1)), ("scan", scan(300, 3))]
    rows = matrix(traces, ["s3fifo", "arc"], blocks=200, fraction=0.05)
    keys = {(r["trace"], r["policy"], r["size"]) for r in rows}
    sizes = {r["size"] for r in rows}
    assert sizes == {"fixed", "5%"}
    assert keys == {
        (t, p, s)
        for t in ("chat", "scan")
        for p in ("lru", "s3fifo", "arc", "belady")
        for s in sizes
    }
    for r in rows:
        distinct = r["distinct"]
        if r["size"] == "5%":
            assert r["capacity"] == max(1, round(0.05 * distinct))
            if r["vs_lru"] is not None:
                assert r["met"] == (r["vs_lru"] >= TARGET_VS_LRU)
            else:  # LRU hit nothing: any hit beats it
                assert r["met"] == (r["hit_ratio"] > 0)
        else:
            assert r["capacity"] == 200
            assert r["met"] == (r["vs_belady"] >= TARGET_VS_BELADY)
        if r["policy"] == "lru" and r["hit_ratio"]:
            assert r["vs_lru"] == 1.0


def test_cli_prints_markdown_and_json() -> None:
    base = [sys.executable, str(SCRIPT), "--trace", "chat", "--requests", "200", "--blocks", "50"]
    md = subprocess.run([*base, "--policy", "arc"], capture_output=True, text=True, timeout=120)
    assert md.returncode == 0, md.stderr
    lines = md.stdout.splitlines()
    assert lines[0] == "| trace | capacity | LRU | Belady | arc |"
    assert len(lines) == 4 and lines[2].startswith("| chat | 50 | ")
    assert lines[3].startswith("| chat | ") and " (5%) | " in lines[3]
    js = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    assert js.returncode == 0, js.stderr
    assert all("vs_belady" in json.loads(ln) for ln in js.stdout.splitlines())
    bad = subprocess.run([*base, "--fraction", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--fraction" in bad.stderr

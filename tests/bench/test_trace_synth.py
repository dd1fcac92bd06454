"""bench/trace_synth.py: other traces of the Mooncake format, and the default policy
against LRU on them (hit ratios only; nothing here is timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace_replay import Request, load_trace, replay_direct
from bench.trace_synth import SYNTHETIC, compare, main, real_slices, write_trace
from kvpool.core.eviction import make_eviction_policy


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_a_synthetic_trace_is_the_same_every_time_and_reads_back(name: str, tmp_path: Path) -> None:
    gen = SYNTHETIC[name]
    trace = gen(300, 1)
    assert trace == gen(300, 1)
    assert len(trace) == 300
    assert gen(300, 2) != trace  # another stream, another trace
    write_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


@pytest.mark.parametrize("name", ["chat", "recent", "scan", "docs"])
def test_the_default_policy_is_at_least_lru_on_small_synthetic_traces(name: str) -> None:
    trace = SYNTHETIC[name](1500, list(SYNTHETIC).index(name) + 1)
    rows = compare(name, trace, "prefix_aware", (0.02, 0.05, 0.1), belady=False)
    for row in rows:
        assert row["policy"] >= row["lru"], row


def test_real_slices_cover_the_trace_in_order() -> None:
    trace = [Request(i, (i,)) for i in range(10)]
    parts = real_slices(trace)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert [r for p in parts for r in p] == trace


def test_compare_rows_carry_ratios_measured_in_the_same_run() -> None:
    trace = SYNTHETIC["chat"](400, 1)
    (row,) = compare("chat", trace, "prefix_aware", (0.05,))
    hits, blocks, _, _ = replay_direct(trace, make_eviction_policy("lru"), row["capacity"])
    assert row["lru"] == hits / blocks
    assert row["vs_lru"] == row["policy"] / row["lru"]
    assert row["vs_belady"] == row["policy"] / row["belady"]


def test_cli_writes_a_trace_and_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scan.jsonl"
    assert main(["--write", "scan", "--requests", "50", "--out", str(out)]) == 0
    assert len(load_trace(out)) == 50
    assert main(["--trace", "recent", "--requests", "200", "--json", "--no-belady"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["trace"] for r in rows] == ["recent"] * 4
    assert main(["--write", "scan"]) == 2  # no --out: a clear error, not a traceback
    assert "--out" in capsys.readouterr().err

"""bench/ttft.py's Mooncake rows run end to end with the smallest settings: kvpool's store
connector on real Mooncake and vLLM's own MooncakeStoreConnector, beside kvpool's
embedded pool, each with a hit, its load rate and memcpy.  What it measures is not
asserted: only that every row is there with sane values, and that each Mooncake row's
vLLM ran in a network namespace of its own; without the venv bench/lmcache_venv.sh makes,
the LMCache row is left out with a line (the venv is a bench's, not the suite's)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.ttft import table

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "ttft.py"
# 300 tokens: two full 128-token blocks come from the pool, the rest is computed
TINY = ("--tokens", "300", "--repeats", "1", "--layers", "1")
ROWS = ["pool hit (embedded)", "pool hit (Mooncake)", "Mooncake's own store connector"]
NUMBER = re.compile(r"^\d+\.\d+$")


def run_bench(*args: str, pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=800,
    )


def test_mooncake_rows_beside_kvpools_with_hits_load_rates_and_their_own_namespaces() -> None:
    done = run_bench(*TINY, "--rows", "embedded,mooncake,vllm-mooncake-store")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads(done.stdout)
    assert [r["name"] for r in results] == ROWS
    here = os.stat("/proc/self/ns/net").st_ino
    for r in results:
        assert r["prompt_tokens"] == 300 and r["cached"] == 256, r
        assert all(0 < t < 600 for t in (*r["cold"], *r["hit"])), r
        (load,) = r["loads"]
        assert load["loads"] >= 1 and load["seconds"] > 0, r
        assert load["bytes"] == 2 * (1 * 128 * 4 * 2 * 64 * 4), r  # 2 pages of 1 layer
        assert r["memcpy_gib_s"] > 0, r
        (at_once,) = r["repeat"]
        assert 0 < at_once < 600, r
    # kvpool's rows: sent again the moment its answer is back, the prompt hits the pool
    # (read-your-writes), and the hit's time is broken into its parts
    for r in results[:2]:
        assert r["repeat_cached"] == [256], r
        ((hit_phases),) = r["breakdown"]
        assert hit_phases["load"][0] >= 1 and hit_phases["lookup"][0] >= 1, r
        assert hit_phases["steps"][0] >= 1, r
    embedded, kvpool_mc, vllm_mc = (r["netns"] for r in results)
    assert embedded == here
    assert len({here, kvpool_mc, vllm_mc}) == 3, "each Mooncake row runs in its own namespace"

    args = argparse.Namespace(layers=1, repeats=1)
    lines = table(results, args).splitlines()
    assert lines[0].startswith("Date: ") and "Machine: " in lines[0], lines[0]
    end = lines.index("", 4)
    rows = {c[0]: c[1:] for c in (ln.strip("|").split("|") for ln in lines[4:end])}
    assert [name.strip() for name in rows] == ROWS
    for cells in rows.values():
        cold, hit, ratio, floor, cached, first, at_once, at_once_cached, *rest = cells
        assert at_once_cached.strip() in ("256", "0"), cells  # the peer may miss
        rate, memcpy, vs_memcpy, kv_tokens = (c.strip() for c in rest)
        assert re.match(r"^[\d,]+$", kv_tokens), cells
        numbers = (cold, hit, ratio, first, at_once, rate, memcpy, vs_memcpy)
        assert all(NUMBER.match(c.strip()) for c in numbers), cells
        assert cached.strip() == "256" and floor.strip() == "—", cells  # no floor row ran
    breakdown = [ln for ln in lines[end:] if ln.startswith("| pool hit")]
    assert [ln.split("|")[1].strip() for ln in breakdown] == ROWS[:2]


def test_without_the_wheel_the_mooncake_rows_are_left_out_with_a_line(tmp_path: Path) -> None:
    # a "mooncake" package without the wheel's binaries, found first
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    done = run_bench(
        *TINY,
        "--rows",
        "mooncake,vllm-mooncake-store",
        "--markdown",
        pythonpath=os.pathsep.join((str(tmp_path), str(ROOT))),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert re.search(r"^Mooncake rows skipped: .*mooncake_master", done.stdout, re.M), done.stdout
    assert "|" not in done.stdout


def test_an_unknown_row_is_refused_by_name() -> None:
    done = run_bench("--rows", "embedded,mooncak")
    assert done.returncode == 2
    assert "--rows: unknown mooncak; choose from local,embedded" in done.stderr, done.stderr


def test_without_the_lmcache_venv_its_row_is_left_out_with_a_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--rows", "lmcache", "--markdown"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVPOOL_LMCACHE_VENV": str(tmp_path / "no")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert re.search(r"^LMCache row skipped: no .*bench/lmcache_venv\.sh", done.stdout, re.M), (
        done.stdout
    )
    assert "|" not in done.stdout

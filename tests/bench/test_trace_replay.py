from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.trace_replay import (
    BeladyPolicy,
    Request,
    load_trace,
    replay_direct,
    replay_index,
)
from kvpool.core.eviction import EVICTION_POLICIES, make_eviction_policy

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trace_replay.py"


def crafted() -> list[Request]:
    """A conversation read every fourth request between one-shot requests: LRU loses it
    to the one-shots at 8 blocks, prefix-aware keeps it once it has been read, and the
    offline optimum keeps it from the start."""
    requests: list[Request] = []
    hot = (0, 1, 2, 3)
    new = 100
    for _ in range(40):
        requests.append(Request(len(requests) * 10, hot))
        for _ in range(3):
            requests.append(Request(len(requests) * 10, (new, new + 1)))
            new += 2
    return requests


def synthetic(seed: int, n: int = 300) -> list[Request]:
    """Conversations that come back with longer prompts, plus one-shot requests."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    requests: list[Request] = []
    for i in range(n):
        if convs and rng.random() < 0.4:
            conv = rng.choice(convs)
            for _ in range(rng.randint(1, 3)):
                conv.append(next_id)
                next_id += 1
            blocks = [0, *conv]
        else:
            conv = []
            for _ in range(rng.randint(1, 6)):
                conv.append(next_id)
                next_id += 1
            if rng.random() < 0.5:
                convs.append(conv)
            blocks = [0, *conv]
        requests.append(Request(i * 100, tuple(blocks)))
    return requests


def write_trace(path: Path, requests: list[Request]) -> None:
    with path.open("w") as f:
        for r in requests:
            n = len(r.blocks)
            row = {"timestamp": r.timestamp_ms, "input_length": n * 512 - 7}
            f.write(json.dumps({**row, "output_length": 10, "hash_ids": list(r.blocks)}) + "\n")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_json_output_shape_and_policy_order(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, crafted())
    proc = run_script("--trace", str(trace), "--capacity", "8", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(r["policy"], r["capacity"]) for r in rows} == {
        (p, c) for p in (*EVICTION_POLICIES, "belady") for c in (8, 12)
    }
    for r in rows:
        assert {"policy", "capacity", "hit_ratio", "blocks_per_s"} <= r.keys()
        assert 0.0 <= r["hit_ratio"] <= 1.0
        assert r["blocks_per_s"] > 0
        assert r["blocks"] == 40 * 4 + 120 * 2
    ratio = {(r["policy"], r["capacity"]): r["hit_ratio"] for r in rows}
    assert ratio["lru", 8] < ratio["prefix_aware", 8] < ratio["belady", 8]
    for c in (8, 12):
        assert ratio["lru", c] <= ratio["prefix_aware", c] <= ratio["belady", c]
    by = {(r["policy"], r["capacity"]): r for r in rows}
    assert by["belady", 12]["vs_belady"] == 1.0 and by["lru", 12]["vs_lru"] == 1.0
    assert by["prefix_aware", 8]["vs_belady"] == pytest.approx(
        ratio["prefix_aware", 8] / ratio["belady", 8]
    )
    assert by["prefix_aware", 8]["vs_lru"] is None  # LRU hits nothing at 8 blocks: no ratio


def test_table_output_and_one_policy(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, crafted())
    proc = run_script("--trace", str(trace), "--capacity", "8", "--policy", "prefix_aware")
    assert proc.returncode == 0, proc.stderr
    assert "160 requests, 400 blocks" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("prefix_aware")]
    assert len(lines) == 1 and " 8 " in lines[0]


def test_the_default_alias_replays_prefix_aware_once(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, crafted())
    proc = run_script(
        "--trace", str(trace), "--capacity", "8", "--policy", "default", "prefix_aware", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["policy"] for line in proc.stdout.splitlines()] == ["prefix_aware"]


def test_repeat_keeps_the_hits_and_reports_one_row_per_policy_and_capacity(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, crafted())
    once = run_script("--trace", str(trace), "--capacity", "8", "--json")
    thrice = run_script("--trace", str(trace), "--capacity", "8", "--json", "--repeat", "3")
    assert once.returncode == 0 and thrice.returncode == 0, once.stderr + thrice.stderr
    hits_once = {r["policy"]: r["hits"] for r in map(json.loads, once.stdout.splitlines())}
    rows = [json.loads(line) for line in thrice.stdout.splitlines()]
    assert {r["policy"]: r["hits"] for r in rows} == hits_once
    assert len(rows) == len(EVICTION_POLICIES) + 1  # and belady


def test_repeat_below_one_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, crafted())
    proc = run_script("--trace", str(trace), "--repeat", "0")
    assert proc.returncode == 2 and "--repeat" in proc.stderr


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("capacity", [5, 20, 60])
def test_index_mode_gives_the_same_hits_as_direct_mode(policy: str, capacity: int) -> None:
    requests = synthetic(seed=capacity)
    direct = replay_direct(requests, make_eviction_policy(policy), capacity)
    through_index = replay_index(requests, policy, capacity)
    assert direct[:2] == through_index[:2]
    assert 0 < direct[0] < direct[1]


def test_unlimited_capacity_hits_everything_seen_before() -> None:
    requests = synthetic(seed=7)
    seen: set[int] = set()
    expected = 0
    for r in requests:
        n = 0
        while n < len(r.blocks) and r.blocks[n] in seen:
            n += 1
        expected += n
        seen.update(r.blocks)
    for policy in (
        make_eviction_policy("lru"),
        make_eviction_policy("prefix_aware"),
        BeladyPolicy(requests),
    ):
        assert replay_direct(requests, policy, 10**6)[0] == expected


def test_belady_evicts_the_block_used_farthest_in_the_future_first() -> None:
    requests = [
        Request(0, (1, 2, 3, 4)),
        Request(1, (9,)),
        Request(2, (3,)),
        Request(3, (1,)),
        Request(4, (2,)),
    ]
    belady = BeladyPolicy(requests)
    belady.begin_request(0)
    for k in (1, 2, 3, 4):
        belady.on_insert(k, None)
    # next uses: 3 -> request 2, 1 -> 3, 2 -> 4, 4 -> never
    assert belady.choose_victims(4, lambda k: True) == [4, 2, 1, 3]
    assert belady.choose_victims(2, lambda k: k != 4) == [2, 1]
    belady.begin_request(3)
    belady.on_access(1)  # 1 is not used again after request 3
    assert belady.choose_victims(1, lambda k: True) in ([1], [4])
    belady.on_remove(4)
    assert belady.choose_victims(1, lambda k: True) == [1]


def test_bad_trace_lines_are_named(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_trace(trace)
    proc = run_script("--trace", str(trace), "--json")
    assert proc.returncode == 2 and "bad.jsonl:2" in proc.stderr and proc.stdout == ""
    assert run_script("--trace", str(tmp_path / "missing.jsonl")).returncode == 2
    assert run_script("--trace", str(trace), "--capacity", "0").returncode == 2

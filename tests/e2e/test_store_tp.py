"""One prefix pool across TP layouts, in real vLLM-CPU: what a TP-2 instance saves is a hit
for a TP-1 instance, and the reverse.

Three offline engines run one after another against one real ``kvpool master``:

A. TP 1 computes prompt P2 (cold: saved) and P1 under a ``cache_salt`` (another key
   namespace: a plain TP-1 computation of P1 that leaves P1's keys unwritten);
B. TP 2 (ranks on cores 0 and 1) loads P2 as A wrote it, then computes P1 (saved);
C. TP 1 loads P1 as B wrote it.

Tolerance: greedy tokens must be equal to a plain TP-1 instance's.  Going from TP 1 to TP 2
changes the order of the row-parallel reductions, so the KV bytes differ in the last bits;
for this float32 model that never changes a greedy choice (the B-side cold computation of
P1 is compared too, and must be equal as well).

The TP-2 engine's worker processes outlive its main process's exit on a loaded host, so
each engine runs in its own process group, which is ended as soon as it printed its results.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.up.tiny_model import build_tiny_mla_model, sample_text
from kvpool.testing import lifetime, shm
from kvpool.testing.agent import kill_group
from kvpool.testing.processes import PoolProcess
from tests.e2e.conftest import REPO, RESULT_MARK, vllm_env

# Three engines one after another; the bound is generous for a TP-2 start on 2 busy cores.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3 * 600 + 60)]

P1 = sample_text(400, seed=21)  # ~400 tokens: three full 128-token blocks and a tail
P2 = sample_text(400, seed=22)
SALT = "plain-reference"
MAX_TOKENS = 12
# One engine, start to results: an upper bound only.  A TP-2 start spawns two worker
# processes that each import vLLM: minutes on 2 cores shared with other jobs.
RUN_TIMEOUT_S = 600.0


def gen(*prompts: str | dict[str, str]) -> dict[str, Any]:
    return {"op": "generate", "prompts": list(prompts), "max_tokens": MAX_TOKENS}


def run_engine(spec: dict[str, Any], workdir: Path, env: dict[str, str]) -> tuple[list[Any], str]:
    """Run one offline engine until it prints its results; then end its process group."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / "log.txt"
    before = shm.snapshot()
    with log_path.open("w") as log:
        proc = lifetime.popen(
            [sys.executable, "-m", "tests.e2e.vllm_offline", str(spec_path)],
            cwd=REPO,
            env=vllm_env(env),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # its own group: the TP workers end with it
        )
        assert proc.stdout is not None
        found: list[str] = []
        done = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if line.startswith(RESULT_MARK):
                    found.append(line[len(RESULT_MARK) :])
                    break
            done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            done.wait(RUN_TIMEOUT_S)
        finally:
            # killed, not stopped: its TP workers' shared memory is ours to remove
            if kill_group(proc, grace_s=30, leader_first=True):
                shm.remove_orphans(before)
            reader.join(timeout=10)
            proc.stdout.close()
    text = log_path.read_text()
    if not found:
        raise AssertionError(f"vLLM run failed (rc={proc.returncode}):\n{text[-6000:]}")
    return json.loads(found[0]), text


@pytest.fixture
def master(tmp_path: Path) -> Iterator[PoolProcess]:
    """A real ``kvpool master`` on 127.0.0.1 (given longer to start than the shared fixture's
    30 s: beside two TP ranks' imports a busy 2-core host needs it)."""
    proc = PoolProcess(
        ["master", "--port", "0", "--host", "127.0.0.1"],
        ready_timeout_s=120,
        log_path=tmp_path / "master.log",
    )
    try:
        yield proc
    finally:
        proc.kill()


def engine_spec(
    model: Path,
    master: PoolProcess,
    tp: int,
    steps: list[dict[str, Any]],
    role: str = "kv_both",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "model": str(model),
        "tensor_parallel_size": tp,
        "kv_transfer_config": {
            "kv_connector": "KVPoolStoreConnector",
            "kv_connector_module_path": "kvpool.connectors.store",
            "kv_role": role,
            "kv_load_failure_policy": "fail",  # a bad load must not hide as a recompute
            "kv_connector_extra_config": {"backend": "kvpool", "master": master.address, **extra},
        },
        "steps": steps,
    }


def test_a_prefix_saved_by_tp2_is_a_hit_for_tp1_and_the_reverse(
    tiny_model_dir: Path, master: PoolProcess, tmp_path: Path
) -> None:
    def spec(tp: int, steps: list[dict[str, Any]]) -> dict[str, Any]:
        return engine_spec(tiny_model_dir, master, tp, steps)

    stats = {"op": "stats"}
    salted_p1 = {"prompt": P1, "cache_salt": SALT}
    tp2_env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()

    (cold_p2, plain_p1, s_a), log_a = run_engine(
        spec(1, [gen(P2), gen(salted_p1), stats]), tmp_path / "a", {}
    )
    assert "backend=kvpool" in log_a
    assert cold_p2["cached"] == [0] and plain_p1["cached"] == [0]
    assert s_a["hit_tokens"] == 0 and s_a["saved_blocks"] >= 3

    (hit_p2, s_b1, cold_p1, s_b2), log_b = run_engine(
        spec(2, [gen(P2), stats, gen(P1), stats]), tmp_path / "b", tp2_env
    )
    assert "world_size=2" in log_b
    # TP 2 found all three blocks of P2 that TP 1 wrote, in both ranks' head groups.
    assert s_b1["hit_tokens"] == 384 and hit_p2["cached"] == [384]
    assert s_b1["loaded_blocks"] >= 3 and s_b1["failed_blocks"] == 0
    assert hit_p2["tokens"] == cold_p2["tokens"]
    # P1 was not in the pool under its own keys (A's copy is salted): computed and saved.
    assert cold_p1["cached"] == [0] and s_b2["hit_tokens"] == 384
    assert cold_p1["tokens"] == plain_p1["tokens"]  # TP 2 and TP 1 agree on this model
    assert s_b2["saved_blocks"] - s_b1["saved_blocks"] >= 3

    (hit_p1, s_c), _ = run_engine(spec(1, [gen(P1), stats]), tmp_path / "c", {})
    # TP 1 found the three blocks TP 2's two ranks wrote, one head group each.
    assert s_c["hit_tokens"] == 384 and hit_p1["cached"] == [384]
    assert s_c["loaded_blocks"] == 3 and s_c["failed_blocks"] == 0
    assert hit_p1["tokens"] == plain_p1["tokens"]


def test_mla_decode_write_back_at_tp2_is_a_hit_for_a_tp1_prefill(
    master: PoolProcess, tmp_path: Path
) -> None:
    """The guide's decode write-back (``consumer_is_to_put``) on a DeepSeek-V2-style MLA
    model: every rank holds the one latent head, so rank 0 alone writes it, and a prefill
    of another TP size reads it.  Dummy weights (vLLM's ``load_format="dummy"``) are drawn
    per weight shard, so a TP-2 and a TP-1 instance are not the same model and their answers
    differ: what is checked is that the TP-1 prefill finds and loads every block the TP-2
    decode wrote, from rank 0 alone, with none failing; its answer is compared with a plain
    TP-1 computation (weak evidence with near-zero dummy weights, stated in the docs)."""
    model = build_tiny_mla_model(tmp_path / "mla")
    prompt = sample_text(100, seed=23)  # ~100 tokens: six full 16-token MLA blocks
    for name in ("d", "p"):
        (tmp_path / name).mkdir()

    def spec(tp: int, role: str, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            **engine_spec(model, master, tp, steps, role, **extra),
            "load_format": "dummy",
            # on a CPU with AMX vLLM picks its AMX MLA backend, which takes bf16/fp16
            # weights only; these engines run float32, so ask for the reference backend
            "attention_backend": "CPU_MLA",
        }

    stats = {"op": "stats"}
    (cold, s_d), log_d = run_engine(
        spec(2, "kv_consumer", [gen(prompt), stats], consumer_is_to_put=True),
        tmp_path / "d",
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    assert "consumer_is_to_put=true" in log_d and "world_size=2" in log_d
    assert cold["cached"] == [0]
    # ~101 prompt + 12 answer tokens: 6 or 7 full blocks, saved by rank 0 only (the
    # counter sums the ranks: rank 1, holding the same latent head, would double it)
    assert 6 <= s_d["saved_blocks"] <= 7

    salted = {"prompt": prompt, "cache_salt": SALT}
    (hit, plain, s_p), _ = run_engine(
        spec(1, "kv_producer", [gen(prompt), gen(salted), stats]), tmp_path / "p", {}
    )
    (cached,) = hit["cached"]
    assert cached >= 6 * 16 and s_p["hit_tokens"] == cached
    assert s_p["loaded_blocks"] == cached // 16 and s_p["failed_blocks"] == 0
    assert hit["tokens"] == plain["tokens"]

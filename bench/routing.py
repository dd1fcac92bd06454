"""Routing policies on a shared-prefix workload: what the prefills compute, and TTFT.

    .venv/bin/python bench/routing.py [--tenants 6] [--requests 48] [--rate 0.5] [--markdown]

An llm-d-style workload scaled to this machine: ``--tenants`` tenants, each with a long
system prompt of its own (``--system-words``) and short questions (``--question-words``);
``--requests`` requests arrive open-loop at ``--rate`` per second (Poisson, seeded), each
from a tenant drawn at random, streamed, bounded by ``--timeout`` each.  They go through
the stack ``kvpool up --prefill-instances 3 --decode-instances 1`` starts (the bench
model: dummy weights, ``--layers`` layers), one row per routing policy, each row through
its own ``kvpool proxy`` in front of the same instances and with tenants of its own (no
row reuses another's prompts):

- ``round_robin``, ``least_inflight``, ``prefix_affinity``: the proxy's blind policies;
- ``kv_aware``: from the prefills' KV events, their own caches and the pool's holdings;
- ``kv_aware, no pool``: the same, weighing the instances' own caches only.

``--pool off`` runs the rows on a stack without kvpool's store connector (the transfer
connector alone, as a fleet without a shared pool has it), where a prefix an instance does
not hold itself is computed again.

Per row, from the prefills' own ``/metrics`` (deltas over the row): prompt tokens, those
their own prefix cache hit, those their store connector loaded from the pool, and the rest
— the tokens the prefills computed; hit ratio; client-side TTFT p50/p90; completed
requests and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: kvpool from this tree
    sys.path.insert(0, str(REPO))

from bench import _cli  # noqa: E402
from bench.pd_latency import launch_plan, percentile  # noqa: E402
from kvpool.net import free_port  # noqa: E402

ROWS: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "round_robin"),
    "least_inflight": ("--policy", "least_inflight"),
    "prefix_affinity": ("--policy", "prefix_affinity"),
    "kv_aware": ("--policy", "kv_aware"),
    "kv_aware, no pool": ("--policy", "kv_aware", "--kv-no-pool"),
}
# the targets of issue-level comparisons: kv_aware against the blind policies, same run
TARGET_VS_ROUND_ROBIN = 0.5
TARGET_VS_AFFINITY = 0.8
_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
)


def start_stack(args: argparse.Namespace, state: Path, adjust: Any = None) -> tuple[Any, Any]:
    """``kvpool up``'s plan (``args.prefills`` prefills, 1 decode) on the bench model,
    every stage up; ``adjust`` may change the plan first."""
    from kvpool.ops.up.lifecycle import resolve_ports, usable_cpus
    from kvpool.ops.up.options import UpOptions
    from kvpool.ops.up.plan import make_plan
    from kvpool.ops.up.tiny_model import PRESETS, build_from_spec

    model = build_from_spec(
        state / "model", replace(PRESETS["bench"], layers=args.layers), weights=False
    )
    opts = UpOptions(
        state_dir=state, model=model, served_model_name="bench", dtype="float32",
        master_port=0, proxy_port=0, prefill_port=0, decode_port=0,
        prefill_kv_port=0, decode_kv_port=0,
        prefill_instances=args.prefills, decode_instances=1,
        kv_cache_bytes=args.kv_cache_mib << 20, max_model_len=args.max_model_len,
        cpus=usable_cpus(), vllm_args=("--load-format", "dummy"), python=sys.executable,
    )  # fmt: skip
    plan = make_plan(resolve_ports(opts))
    if args.pool == "off":
        plan = without_store(plan)
    if adjust is not None:
        plan = adjust(plan)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return plan, launch_plan(plan, env, args.start_timeout)


def with_kv_config(plan: Any, change: Any) -> Any:
    """The plan with each vLLM instance's ``--kv-transfer-config`` replaced by
    ``change(config)``."""
    processes = []
    for spec in plan.processes:
        argv = list(spec.argv)
        if "--kv-transfer-config" in argv:
            i = argv.index("--kv-transfer-config") + 1
            argv[i] = json.dumps(change(json.loads(argv[i])))
        processes.append(replace(spec, argv=tuple(argv)))
    return replace(plan, processes=tuple(processes))


def without_store(plan: Any) -> Any:
    """The plan with each vLLM instance's MultiConnector down to its transfer child."""

    def transfer_only(config: dict[str, Any]) -> dict[str, Any]:
        children = config["kv_connector_extra_config"]["connectors"]
        (transfer,) = [c for c in children if "Transfer" in c["kv_connector"]]
        return {**transfer, "kv_load_failure_policy": "recompute"}

    return with_kv_config(plan, transfer_only)


def start_proxy(
    plan: Any, extra: tuple[str, ...], logs: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``kvpool proxy`` in front of the stack's instances, as ``kvpool up``'s, with
    ``extra`` flags (the row's policy) on a free port."""
    (spec,) = [s for stage in plan.stages for s in stage if s.role == "proxy"]
    argv = list(spec.argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    i = argv.index("--policy")
    del argv[i : i + 2]
    argv += list(extra)
    log = (logs / f"proxy-{port}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the proxy did not come up: see {log.name}")


def counters(urls: list[str]) -> dict[str, float]:
    """The prefills' prompt and hit counters, summed."""
    out = dict.fromkeys(_COUNTERS, 0.0)
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                name = line.split("{", 1)[0]
                if name in out:
                    out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def one(session: Any, url: str, prompt: str, timeout: float) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/completions", json=body) as resp:
                ttft = None
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {") and b'"choices"' in line:
                        ttft = time.perf_counter() - started
                if resp.status != 200 or ttft is None:
                    return {"error": f"HTTP {resp.status}"}
                return {"ttft": ttft}
    except Exception as exc:  # counted, never fatal
        return {"error": repr(exc)}


async def workload(url: str, row: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The row's requests, open-loop: each starts at its arrival time, whatever is still
    running."""
    import aiohttp

    from kvpool.ops.up.tiny_model import sample_text

    rng = random.Random(args.seed * 1000 + row)
    systems = [sample_text(args.system_words, seed=100_000 * (row + 1) + t)
               for t in range(args.tenants)]  # fmt: skip
    arrivals, t = [], 0.0
    for k in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        question = sample_text(args.question_words, seed=10_000_000 * (row + 1) + k)
        arrivals.append((t, systems[tenant] + " " + question))
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()

        async def at(when: float, prompt: str) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            return await one(session, url, prompt, args.timeout)

        return list(await asyncio.gather(*(at(when, p) for when, p in arrivals)))


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    state = Path(tempfile.mkdtemp(prefix="kvpool-routing-"))
    plan, sup = start_stack(args, state)
    prefills = [s.url for stage in plan.stages for s in stage if s.role == "prefill"]
    results = []
    try:
        for row, (name, flags) in enumerate(ROWS.items()):
            if args.rows and name not in args.rows:
                continue
            proc, url = start_proxy(plan, flags, state / "logs")
            try:
                before = counters(prefills)
                samples = asyncio.run(workload(url, row, args))
                time.sleep(1.0)  # the last steps' counters
                after = counters(prefills)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            delta = {k: after[k] - before[k] for k in _COUNTERS}
            prompt = delta["vllm:prompt_tokens_total"]
            local = delta["vllm:prefix_cache_hits_total"]
            pooled = delta["vllm:external_prefix_cache_hits_total"]
            ttfts = [s["ttft"] for s in samples if "ttft" in s]
            results.append(
                {
                    "name": name,
                    "prompt_tokens": prompt,
                    "local_hits": local,
                    "pool_hits": pooled,
                    "computed": prompt - local - pooled,
                    "hit_ratio": (local + pooled) / prompt if prompt else 0.0,
                    "ttft_p50": percentile(ttfts, 50) if ttfts else None,
                    "ttft_p90": percentile(ttfts, 90) if ttfts else None,
                    "completed": len(ttfts),
                    "errors": len(samples) - len(ttfts),
                }
            )
            print(f"{name}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        sup.stop_all()
    return results


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Date: {now}. Machine: {os.cpu_count()}-core {platform.machine()}, Python"
        f" {platform.python_version()}. {args.prefills} prefills + 1 decode (bench model,"
        f" {args.layers} layers, dummy weights); {args.tenants} tenants, system prompts of"
        f" {args.system_words} words, questions of {args.question_words}; {args.requests}"
        f" requests per row, open-loop at {args.rate}/s; the pool {args.pool}.",
        "",
        "| policy | prompt tokens | own-cache hits | pool hits | computed | hit ratio"
        " | TTFT p50 (s) | TTFT p90 (s) | completed | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p50 = "—" if r["ttft_p50"] is None else f"{r['ttft_p50']:.3f}"
        p90 = "—" if r["ttft_p90"] is None else f"{r['ttft_p90']:.3f}"
        lines.append(
            f"| {r['name']} | {r['prompt_tokens']:.0f} | {r['local_hits']:.0f} |"
            f" {r['pool_hits']:.0f} | {r['computed']:.0f} | {r['hit_ratio']:.2f} | {p50} |"
            f" {p90} | {r['completed']} | {r['errors']} |"
        )
    by = {r["name"]: r for r in results}
    kv, rr, pa = by.get("kv_aware"), by.get("round_robin"), by.get("prefix_affinity")
    if kv and rr and pa and rr["computed"] and pa["computed"]:
        lines += [
            "",
            f"- computed: kv_aware / round_robin = {kv['computed'] / rr['computed']:.2f}"
            f" (target ≤ {TARGET_VS_ROUND_ROBIN}), kv_aware / prefix_affinity ="
            f" {kv['computed'] / pa['computed']:.2f} (target ≤ {TARGET_VS_AFFINITY})",
        ]
        if kv["ttft_p90"] and rr["ttft_p90"]:
            lines.append(
                f"- TTFT p90: kv_aware / round_robin = {kv['ttft_p90'] / rr['ttft_p90']:.2f}"
                " (target ≤ 0.5)"
            )
    return "\n".join(lines)


def main() -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--prefills", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=500)
    parser.add_argument("--question-words", type=int, default=30)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pool", choices=("on", "off"), default="on", help="off: no store connector"
    )
    parser.add_argument(
        "--rows",
        type=lambda t: set(t.split(",")),
        default=set(),
        help="a subset of: " + ", ".join(ROWS),
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    results = measure(args)
    return _cli.report(results, args, table)


if __name__ == "__main__":
    sys.exit(main())

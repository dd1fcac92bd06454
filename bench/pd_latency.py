"""The P/D hop: streaming TTFT through ``kvpool up``'s proxy against straight to P and to D.

    .venv/bin/python bench/pd_latency.py                       # JSON of every sample + table
    .venv/bin/python bench/pd_latency.py --markdown            # the table for docs/benchmarks.md
    .venv/bin/python bench/pd_latency.py --requests 30 --words 300 --layers 2

It starts the stack ``kvpool up`` starts (:func:`kvpool.ops.up.plan.make_plan`: the kvpool
master, one prefill and one decode vLLM instance with the transfer and store connectors,
``kvpool proxy``), as subprocesses under :class:`kvpool.ops.up.supervisor.Supervisor`, on
the ``bench`` model preset (dummy weights, ``--layers`` layers) so that a prefill is real
work.  Then, ``--requests`` rounds, each round sending in a shuffled order to:

- ``proxy``   the whole P/D hop, first token from P (P leg ``max_tokens=1``, its token
              streamed at once, D pulls P's blocks and continues);
- ``proxy-seq`` the same stack through a second ``kvpool proxy --first-token-from
              decode`` (P leg, then D answers whole: the older, sequential way);
- ``P``       the prefill instance alone (the same server, no ``kv_transfer_params``);
- ``D``       the decode instance alone: a plain instance, the D-alone baseline;

one *repeated* prompt (the same every round, so prefix-cached everywhere after a warm-up),
one *fresh* prompt (never seen by any instance: a full prefill) and one *split* prompt, a
repeated one whose first answer token ends inside a multi-byte character (found at the
start among ``--split-tries`` prompts; the proxy mends D's first text).  TTFT is the time from
sending the streaming request to its first content chunk (the first SSE ``data:`` event
that carries a choice).  Each request has ``--timeout`` seconds; a failed or timed-out
request is counted, never waited on beyond that.

Each row gives p50/p99 and ``added``, the proxy's p50 less the direct p50 of the same
kind, and ``ratio`` (proxy p50 / direct p50) and ``p99/p50``, all from the same run.  The
proxy's ``Server-Timing`` header splits each proxied request into its P leg and the D
leg up to D's first bytes; D's log gives the pull's own duration.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: kvpool from this tree
    sys.path.insert(0, str(REPO))

TARGETS = ("proxy", "proxy-seq", "P", "D")
# the target of docs/benchmarks.md: first token through the proxy vs straight to P
TARGET_ADDED_MS = 5.0
TARGET_P99_OVER_P50 = 2.0
KINDS = ("repeated", "fresh", "split")
# the parts of a proxied request, as the table names them
PARTS = {
    "prefill": "P leg ms",
    "decode_first": "D leg to first bytes ms",
    "pull": "D's pull ms",
    "pull_to_report": "pull end → vLLM told, ms",
    "steps": "D engine steps, pull submitted → told",
}
_TIMING = re.compile(r"(\w+);dur=([0-9.]+)")
_REPORTED = re.compile(
    r"reported request (\S+): (\d+) engine steps after its pull was submitted, ([0-9.]+) ms"
)
_LOADED = re.compile(r"loaded request (\S+) from \S+: (\d+) blocks, (\d+) bytes in ([0-9.]+) ms")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sample."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def server_timing(header: str | None) -> dict[str, float]:
    """``{"prefill": 12.3, "decode_first": 4.5}`` from a ``Server-Timing`` header (ms)."""
    return {name: float(dur) for name, dur in _TIMING.findall(header or "")}


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, target): p50/p99 of the TTFTs, and against the direct rows of
    the same kind, the proxy's added ms and ratios."""
    rows = []
    for kind in KINDS:
        stats: dict[str, dict[str, Any]] = {}
        for target in TARGETS:
            ok = [s["ttft_ms"] for s in samples if s["kind"] == kind and s["target"] == target
                  and s.get("ttft_ms") is not None]  # fmt: skip
            failed = sum(
                1 for s in samples
                if s["kind"] == kind and s["target"] == target and s.get("ttft_ms") is None
            )  # fmt: skip
            if not ok:
                continue
            stats[target] = {
                "kind": kind,
                "target": target,
                "n": len(ok),
                "failed": failed,
                "p50": percentile(ok, 50),
                "p99": percentile(ok, 99),
                "mean": sum(ok) / len(ok),
            }
            stats[target]["p99_over_p50"] = stats[target]["p99"] / stats[target]["p50"]
        proxy = stats.get("proxy")
        for target, row in stats.items():
            if proxy is not None and target != "proxy":
                row["proxy_added_p50"] = proxy["p50"] - row["p50"]
                row["proxy_added_p99"] = proxy["p99"] - row["p99"]
                row["proxy_ratio_p50"] = proxy["p50"] / row["p50"]
            if target == "proxy":
                mine = [s for s in samples if s["kind"] == kind and s["target"] == "proxy"]
                # answered the sequential way (P's token inside a multi-byte character):
                # only those carry a D leg in their Server-Timing
                row["sequential"] = sum(
                    1 for s in mine if "decode_first" in (s.get("timing") or {})
                )
                parts = [s["timing"] for s in mine if s.get("timing")]
                for name in sorted({k for t in parts for k in t}):
                    values = [t[name] for t in parts if name in t]
                    row[f"{name}_p50"] = percentile(values, 50)
                    row[f"{name}_p99"] = percentile(values, 99)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| prompt | sent to | n | TTFT p50 ms | TTFT p99 ms | p99/p50 "
        "| proxy − this, p50 ms | proxy − this, p99 ms | proxy / this, p50 |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        added = (
            (f"{r['proxy_added_p50']:+.1f}", f"{r['proxy_added_p99']:+.1f}",
             f"{r['proxy_ratio_p50']:.2f}")
            if "proxy_added_p50" in r else ("", "", "")
        )  # fmt: skip
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        if r.get("sequential"):
            failed += f" ({r['sequential']} sequential)"
        lines.append(
            f"| {r['kind']} | {r['target']} | {r['n']}{failed} | {r['p50']:.1f} | "
            f"{r['p99']:.1f} | {r['p99_over_p50']:.2f} | {' | '.join(added)} |"
        )
    parts = [r for r in rows if r["target"] == "proxy" and "prefill_p50" in r]
    names = [n for n in PARTS if any(f"{n}_p50" in r for r in parts)]
    if parts:
        lines += ["", "| prompt | " + " | ".join(f"{PARTS[n]} p50 / p99" for n in names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for r in parts:
            cells = [
                f"{r[f'{n}_p50']:.1f} / {r[f'{n}_p99']:.1f}" if f"{n}_p50" in r else ""
                for n in names
            ]
            lines.append(f"| {r['kind']} | " + " | ".join(cells) + " |")
    lines.append("")
    for kind in KINDS:
        by = {r["target"]: r for r in rows if r["kind"] == kind}
        if "proxy" in by and "P" in by:
            added, spread = by["P"]["proxy_added_p50"], by["proxy"]["p99_over_p50"]
            ok = added <= TARGET_ADDED_MS and spread <= TARGET_P99_OVER_P50
            lines.append(
                f"- {kind}: proxy p50 − P p50 = {added:+.1f} ms (target ≤ {TARGET_ADDED_MS:g}), "
                f"proxy p99/p50 = {spread:.2f} (target ≤ {TARGET_P99_OVER_P50:g}): "
                f"{'met' if ok else 'not met'}"
            )
    return "\n".join(lines)


# -- the stack -------------------------------------------------------------------------


def start_stack(args: argparse.Namespace, state: Path) -> tuple[Any, Any]:
    """``kvpool up``'s plan on the bench model, every stage healthy; (plan, supervisor)."""
    from kvpool.ops.up.lifecycle import resolve_ports, usable_cpus
    from kvpool.ops.up.options import UpOptions
    from kvpool.ops.up.plan import make_plan
    from kvpool.ops.up.tiny_model import PRESETS, build_from_spec

    model = build_from_spec(
        state / "model", replace(PRESETS["bench"], layers=args.layers), weights=False
    )
    opts = UpOptions(
        state_dir=state,
        model=model,
        served_model_name="bench",
        dtype="float32",
        master_port=0, proxy_port=0, prefill_port=0, decode_port=0,
        prefill_kv_port=0, decode_kv_port=0,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        cpus=tuple(args.cpus) if args.cpus else usable_cpus(),
        vllm_args=("--load-format", "dummy", *args.vllm_args.split()),
        python=sys.executable,
    )  # fmt: skip
    plan = make_plan(resolve_ports(opts))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["KVPOOL_TRANSFER_TRACE"] = "1"  # D's log: steps between a pull's end and its report
    if args.idle_wait_ms is not None:  # the transfer connector's, on both instances
        env["KVPOOL_IDLE_WAIT_MS"] = str(args.idle_wait_ms)
    return plan, launch_plan(plan, env, args.start_timeout)


def launch_plan(plan: Any, env: dict[str, str], start_timeout: float) -> Any:
    """Lay out ``plan``'s folders and files, then start its stages in order, each one
    healthy before the next; the supervisor (everything started stopped on a failure)."""
    from kvpool.ops.up.supervisor import Supervisor

    for d in plan.dirs:
        d.mkdir(parents=True, exist_ok=True)
    for path, text in plan.files.items():
        path.write_text(text)
    sup = Supervisor(base_env=env)
    try:
        for stage in plan.stages:
            started = [sup.start(spec) for spec in stage]
            sup.wait_healthy(started, start_timeout)
    except BaseException:
        sup.stop_all()
        raise
    return sup


# -- the requests ----------------------------------------------------------------------


async def ttft(
    session: Any, url: str, prompt: str, args: argparse.Namespace, rid: str
) -> dict[str, Any]:
    """One streaming completion: ms to its first content chunk, and the proxy's timing."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out: dict[str, Any] = {"ttft_ms": None, "request_id": rid}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(args.timeout):
            async with session.post(
                url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                out["status"] = resp.status
                out["timing"] = server_timing(resp.headers.get("Server-Timing"))
                async for line in resp.content:
                    first = out["ttft_ms"] is None
                    if first and line.startswith(b"data: {") and b'"choices"' in line:
                        out["ttft_ms"] = (time.perf_counter() - started) * 1000
                if resp.status != 200:
                    out["ttft_ms"] = None
    except (TimeoutError, OSError, Exception) as exc:  # counted, reported, never fatal
        out["ttft_ms"] = None
        out["error"] = repr(exc)
    out["total_ms"] = (time.perf_counter() - started) * 1000
    return out


async def find_split(session: Any, url: str, args: argparse.Namespace) -> str | None:
    """A prompt whose first answer token (greedy, on ``url``) ends inside a character."""
    from kvpool.ops.up.tiny_model import sample_text

    for i in range(args.split_tries):
        prompt = sample_text(args.words, seed=20_000 + i)
        body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body) as resp:
            text = (await resp.json())["choices"][0]["text"]
        if not text or text.endswith("\ufffd"):
            return prompt
    return None


async def measure(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    import aiohttp

    from kvpool.ops.up.tiny_model import sample_text

    repeated = sample_text(args.words, seed=7)
    rng = random.Random(args.shuffle_seed)
    samples: list[dict[str, Any]] = []
    run = f"{os.getpid()}-{int(time.time())}"
    async with aiohttp.ClientSession() as session:
        split = await find_split(session, urls["P"], args)
        kinds = [k for k in KINDS if k != "split" or split is not None]
        if split is None:
            print(f"no split first token in {args.split_tries} prompts", file=sys.stderr)
        for target in TARGETS:  # warm-up: the repeated prompts cached everywhere, pools open
            for j in range(2):
                for name, prompt in (("r", repeated), ("s", split)):
                    if prompt is not None:
                        rid = f"warm-{run}-{target}-{name}{j}"
                        await ttft(session, urls[target], prompt, args, rid)
        for i in range(args.requests):
            order = [(k, t) for k in kinds for t in TARGETS]
            rng.shuffle(order)
            for kind, target in order:
                # fresh: a distinct prefix, no block in common with any other prompt
                seed = 10_000 + len(TARGETS) * i + TARGETS.index(target)
                fresh = f"{i} {target} " + sample_text(args.words, seed=seed)
                prompt = {"repeated": repeated, "fresh": fresh, "split": split}[kind]
                assert prompt is not None
                rid = f"b-{run}-{i}-{kind}-{target}"
                s = await ttft(session, urls[target], prompt, args, rid)
                s.update(kind=kind, target=target, round=i)
                samples.append(s)
                if args.gap_ms:
                    await asyncio.sleep(args.gap_ms / 1000)
    return samples


def start_sequential_proxy(urls: dict[str, str], state: Path) -> Any:
    """A second proxy on the same P and D, ``--first-token-from decode``; its URL goes in
    ``urls["proxy-seq"]``.  Returns the process (the caller stops it)."""
    import subprocess
    import urllib.request

    from kvpool.net import free_port

    port = free_port()
    log = (state / "proxy-seq.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "proxy", "--port", str(port), "--prefill", urls["P"],
         "--decode", urls["D"], "--first-token-from", "decode"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the sequential proxy did not start: {log.name}") from None
            time.sleep(0.2)
    urls["proxy-seq"] = url
    return proc


def stack_urls(plan: Any) -> dict[str, str]:
    decode = plan.by_role("decode")[0]
    return {
        "proxy": plan.proxy_url,
        "P": plan.by_role("prefill")[0].url,
        "D": decode.url,
        "decode_log": str(decode.log_path),
        "proxy_argv": json.dumps(list(plan.by_role("proxy")[0].argv)),
    }


def hold(args: argparse.Namespace, state: Path) -> int:
    """Start the stack and keep it until SIGINT/SIGTERM (for --attach runs)."""
    import signal

    state.mkdir(parents=True, exist_ok=True)
    plan, sup = start_stack(args, state)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    urls = stack_urls(plan)
    seq = start_sequential_proxy(urls, state)
    try:
        pids = {r.spec.name: r.pid for r in sup.running}
        (state / "stack.json").write_text(json.dumps({**urls, "pids": pids}))
        print(f"stack up: {state / 'stack.json'}", flush=True)
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        seq.terminate()
        seq.wait(timeout=30)
        sup.stop_all()
    return 0


def pull_times(log: Path) -> dict[str, dict[str, float]]:
    """request id → D's pull ms, and (with the trace) the engine steps from the pull's
    submission to its report and the ms from its end to its report, from D's log."""
    out: dict[str, dict[str, float]] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return out
    for m in _LOADED.finditer(text):
        out.setdefault(m.group(1), {})["pull"] = float(m.group(4))
    for m in _REPORTED.finditer(text):
        parts = out.setdefault(m.group(1), {})
        parts["steps"] = float(m.group(2))
        parts["pull_to_report"] = float(m.group(3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20, help="rounds (each: 12 requests)")
    p.add_argument("--words", type=int, default=300, help="prompt length in words")
    p.add_argument("--layers", type=int, default=2, help="layers of the bench preset")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--gap-ms", type=float, default=50.0, help="pause between requests")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--cpus", type=int, nargs="*", default=None)
    p.add_argument(
        "--idle-wait-ms", type=int, default=None, help="KVPOOL_IDLE_WAIT_MS of both instances"
    )
    p.add_argument("--vllm-args", default="", help="appended to both vLLM command lines")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument(
        "--hold",
        metavar="DIR",
        help="start the stack in DIR, write DIR/stack.json, wait for Ctrl-C",
    )
    p.add_argument("--attach", metavar="DIR", help="measure the stack a --hold run keeps")
    p.add_argument("--shuffle-seed", type=int, default=0)
    p.add_argument("--split-tries", type=int, default=60, help="prompts tried for 'split'")
    p.add_argument("--markdown", action="store_true", help="print the table only")
    p.add_argument("--keep", action="store_true", help="keep the state directory (logs)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.timeout <= 0:
        p.error("--requests must be >= 1 and --timeout positive")

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()
    if args.hold:
        return hold(args, Path(args.hold).absolute())
    if args.attach:
        state = Path(args.attach)
        urls = json.loads((state / "stack.json").read_text())
        samples = asyncio.run(measure(urls, args))
        pulls = pull_times(Path(urls["decode_log"]))
    else:
        state = Path(tempfile.mkdtemp(prefix="kvpool-pdlat-"))
        plan, sup = start_stack(args, state)
        seq = None
        try:
            urls = stack_urls(plan)
            seq = start_sequential_proxy(urls, state)
            samples = asyncio.run(measure(urls, args))
            pulls = pull_times(Path(urls["decode_log"]))
        finally:
            if seq is not None:
                seq.terminate()
                seq.wait(timeout=30)
            sup.stop_all()
    for s in samples:
        hit = [parts for rid, parts in pulls.items() if s["request_id"] in rid]
        if hit:
            s.setdefault("timing", {}).update(hit[0])
    rows = summarize(samples)
    meta = {
        "when": when,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores,"
        f" Python {platform.python_version()}",
        "args": {k: v for k, v in vars(args).items() if k != "markdown"},
        "state": str(state) if args.keep else None,
    }
    if not args.keep and not args.attach:
        import shutil

        shutil.rmtree(state, ignore_errors=True)
    text = table(rows)
    if args.markdown:
        print(f"{when}, load {meta['load_before'][0]:.2f} → {meta['load_after'][0]:.2f}\n")
        print(text)
    else:
        print(json.dumps({"meta": meta, "rows": rows, "samples": samples}))
        print(text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Read-your-writes across a fleet: a prompt answered by one prefill, sent to another.

    .venv/bin/python bench/fleet_repeat.py [--tokens 1650] [--prompts 6] [--markdown]

The stack ``kvpool up --prefill-instances 2`` starts (bench model, dummy weights,
``--layers`` layers; each instance's own prefix cache on, as ``kvpool up`` runs them), one
row per setting of the store connector's ``read_your_writes``.  Per prompt, straight to
the instances' own OpenAI endpoints (``max_tokens: 1``, a P/D prefill's request):

- prefill-0 answers a fresh prompt (cold), and the moment its answer is back the same
  prompt goes to prefill-1 (*at once*): what prefill-1 found cached, and its TTFT;
- another fresh prompt, answered by prefill-0, goes to prefill-1 one second later (*after
  1 s*): the same, when every save has long ended.

TTFT is the request's wall time (prefill plus one token).  Medians over ``--prompts``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: kvpool and bench from this tree
    sys.path.insert(0, str(REPO))

from bench import _cli  # noqa: E402
from bench.routing import start_stack, with_kv_config  # noqa: E402
from bench.ttft import _machine  # noqa: E402

ROWS = {"read_your_writes on (default)": True, "read_your_writes off": False}


def with_read_your_writes(plan: Any, on: bool) -> Any:
    """The plan with every store connector's ``read_your_writes`` set to ``on``."""

    def set_it(config: dict[str, Any]) -> dict[str, Any]:
        for child in config["kv_connector_extra_config"]["connectors"]:
            if "Store" in child["kv_connector"]:
                child["kv_connector_extra_config"]["read_your_writes"] = on
        return config

    return with_kv_config(plan, set_it)


def complete(url: str, prompt: str) -> tuple[float, int]:
    """(wall seconds, cached prompt tokens) of one ``max_tokens: 1`` completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        usage = json.loads(reply.read())["usage"]
    seconds = time.perf_counter() - t0
    return seconds, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def measure_row(args: argparse.Namespace, on: bool, row: int) -> dict[str, Any]:
    from kvpool.ops.up.tiny_model import sample_text

    state = Path(tempfile.mkdtemp(prefix="kvpool-fleet-repeat-"))
    stack_args = argparse.Namespace(
        layers=args.layers, prefills=2, pool="on", kv_cache_mib=args.kv_cache_mib,
        max_model_len=args.tokens + 512, start_timeout=args.start_timeout,
    )  # fmt: skip
    plan, sup = start_stack(stack_args, state, adjust=lambda p: with_read_your_writes(p, on))
    p0, p1 = [s.url for stage in plan.stages for s in stage if s.role == "prefill"]
    out: dict[str, list[float]] = {k: [] for k in ("cold", "at_once", "at_once_cached")}
    out |= {"later": [], "later_cached": []}
    try:
        complete(p0, sample_text(200, seed=9_999))  # warm-up, both instances
        complete(p1, sample_text(200, seed=9_998))
        for i in range(args.prompts):
            seed = 10_000 * (row + 1) + 2 * i
            prompt = sample_text(args.tokens, seed=seed)
            cold, _ = complete(p0, prompt)
            at_once, cached = complete(p1, prompt)
            out["cold"].append(cold)
            out["at_once"].append(at_once)
            out["at_once_cached"].append(cached)
            prompt = sample_text(args.tokens, seed=seed + 1)
            complete(p0, prompt)
            time.sleep(1.0)
            later, cached = complete(p1, prompt)
            out["later"].append(later)
            out["later_cached"].append(cached)
    finally:
        sup.stop_all()
    full = max(out["later_cached"])  # every full block, as a settled save gives
    result: dict[str, Any] = {k: statistics.median(v) for k, v in out.items()}
    result["at_once_short"] = sum(1 for c in out["at_once_cached"] if c < full)
    result["prompts"] = len(out["at_once_cached"])
    return result


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Date: {now}. Machine: {_machine()}. `kvpool up --prefill-instances 2`, bench"
        f" model with {args.layers} layers; ~{args.tokens}-token prompts, {args.prompts}"
        " per row, medians; TTFT = wall time of a `max_tokens: 1` completion.",
        "",
        "| setting | prefill-0 cold (s) | prefill-1 at once (s) | cached at once"
        " | at once, prompts short of every block | prefill-1 after 1 s (s)"
        " | cached after 1 s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['cold']:.3f} | {r['at_once']:.3f} | {r['at_once_cached']:.0f}"
            f" | {r['at_once_short']} of {r['prompts']} | {r['later']:.3f}"
            f" | {r['later_cached']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=1650)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    results = {}
    for row, (name, on) in enumerate(ROWS.items()):
        results[name] = measure_row(args, on, row)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    return _cli.report(results, args, table)


if __name__ == "__main__":
    sys.exit(main())

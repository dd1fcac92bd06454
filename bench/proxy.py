"""Benchmark: latency the P/D proxy adds, and sustained requests/s, side by side in one run.

Three ways to get the same answer, measured in one run against the same upstreams:

- ``direct D``    the client calls the decode endpoint alone (no disaggregation at all);
- ``P+D direct``  the client itself does the proxy's two legs (P with max_tokens=1, then D
                  with P's kv_transfer_params): the work of a P/D pair without a proxy;
- ``proxy``       the client calls ``kvpool proxy``, which does both legs.

Added latency = proxy − P+D direct, per percentile.  The upstreams are stub OpenAI servers
(tests/proxy/stub_upstream.py: no model, so the numbers are the HTTP path alone), each a
separate process, as is the proxy (started with the real ``kvpool proxy`` command).
Latency runs one request at a time, the three modes interleaved request by request so that
drift on a shared machine hits them alike; throughput runs ``--concurrency`` streaming
clients for ``--load-requests`` requests per mode.  Everything is bounded in count and time.

    .venv/bin/python bench/proxy.py [--requests 400] [--load-requests 1000] [--concurrency 16]
                                    [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.proxy.stub_upstream import reference_text  # noqa: E402

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
Call = Callable[[aiohttp.ClientSession, dict[str, Any]], Awaitable[str]]


async def _spawn(args: list[str], ready_prefix: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    if not line.startswith(ready_prefix):
        proc.kill()
        raise RuntimeError(f"{args} did not start: {line!r}")
    return proc, line


async def _stub(name: str) -> tuple[asyncio.subprocess.Process, str]:
    args = ["-m", "tests.proxy.stub_upstream", "--port", "0", "--name", name]
    if HAVE_UVLOOP:
        args.append("--uvloop")
    proc, line = await _spawn(args, "PORT ")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


async def _sse_text(resp: aiohttp.ClientResponse) -> str:
    pieces = []
    async for line in resp.content:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status} {await resp.text()}")
        if body.get("stream"):
            return await _sse_text(resp)
        return str((await resp.json())["choices"][0]["text"])


def _modes(p_url: str, d_url: str, proxy_url: str) -> dict[str, Call]:
    async def direct_d(s: aiohttp.ClientSession, body: dict[str, Any]) -> str:
        return await _post(s, d_url, body)

    async def p_then_d(s: aiohttp.ClientSession, body: dict[str, Any]) -> str:
        p_body = {**body, "max_tokens": 1, "stream": False}
        p_body["kv_transfer_params"] = {"do_remote_decode": True}
        async with s.post(p_url + "/v1/completions", json=p_body) as resp:
            kv = (await resp.json())["kv_transfer_params"]
        return await _post(s, d_url, {**body, "kv_transfer_params": kv})

    async def proxy(s: aiohttp.ClientSession, body: dict[str, Any]) -> str:
        return await _post(s, proxy_url, body)

    return {"direct D": direct_d, "P+D direct": p_then_d, "proxy": proxy}


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _latency(
    session: aiohttp.ClientSession, modes: dict[str, Call], n: int, stream: bool
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(n + n // 10):  # the first tenth warms connections and is dropped
        body = {"prompt": f"latency {i}", "max_tokens": 16, "stream": stream}
        for name, call in modes.items():
            t0 = time.perf_counter()
            text = await call(session, body)
            elapsed = time.perf_counter() - t0
            if text != reference_text(body):
                raise RuntimeError(f"{name}: wrong output for {body}")
            if i >= n // 10:
                times[name].append(elapsed)
    return times


async def _throughput(
    session: aiohttp.ClientSession, call: Call, total: int, concurrency: int
) -> float:
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            body = {"prompt": f"load {i}", "max_tokens": 16, "stream": True}
            if await call(session, body) != reference_text(body):
                raise RuntimeError(f"wrong output for {body}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[asyncio.subprocess.Process] = []
    load_start = os.getloadavg()[0]
    try:
        (p_proc, p_url), (d_proc, d_url) = await asyncio.gather(_stub("p0"), _stub("d0"))
        procs += [p_proc, d_proc]
        proxy_proc, line = await _spawn(
            ["-m", "kvpool", "proxy", "--port", "0", "--prefill", p_url, "--decode", d_url],
            "kvpool proxy listening on ",
        )
        procs.append(proxy_proc)
        modes = _modes(p_url, d_url, line.split()[4])
        timeout = aiohttp.ClientTimeout(total=30)
        connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
        results: dict[str, Any] = {"latency_ms": {}, "rps": {}}
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for stream in (False, True):
                times = await _latency(session, modes, args.requests, stream)
                kind = "stream" if stream else "whole"
                results["latency_ms"][kind] = {
                    name: {
                        "p50": 1000 * statistics.median(t),
                        "p99": 1000 * _pct(t, 0.99),
                    }
                    for name, t in times.items()
                }
            # rounds of the three modes in turn; the median round per mode is reported, so
            # a burst of load from elsewhere on the machine does not decide the comparison
            rounds: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(args.rounds):
                for name, call in modes.items():
                    rps = await _throughput(session, call, args.load_requests, args.concurrency)
                    rounds[name].append(rps)
            results["rps"] = {name: statistics.median(r) for name, r in rounds.items()}
            results["rps_rounds"] = rounds
        results["loadavg_1m"] = {"start": load_start, "end": os.getloadavg()[0]}
        return results
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def _report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "1-minute load average: {start:.2f} at start, {end:.2f} at end".format(
            **results["loadavg_1m"]
        ),
        f"latency: {args.requests} sequential requests per mode, 16 tokens each",
        "",
        "| answer | mode | p50 ms | p99 ms | proxy adds p50 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    for kind, by_mode in results["latency_ms"].items():
        base, prox = by_mode["P+D direct"], by_mode["proxy"]
        added = f"{prox['p50'] - base['p50']:+.2f} / {prox['p99'] - base['p99']:+.2f}"
        for name, v in by_mode.items():
            extra = added if name == "proxy" else ""
            lines.append(f"| {kind} | {name} | {v['p50']:.2f} | {v['p99']:.2f} | {extra} |")
    lines += [
        "",
        f"throughput: {args.load_requests} streamed requests per mode, "
        f"{args.concurrency} concurrent clients, median of {args.rounds} rounds",
        "",
        "| mode | requests/s, median (rounds) |",
        "|---|---|",
    ]
    for name, rps in results["rps"].items():
        each = ", ".join(f"{r:.0f}" for r in results["rps_rounds"][name])
        lines.append(f"| {name} | {rps:.0f} ({each}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="latency samples per mode")
    parser.add_argument("--load-requests", type=int, default=1000, help="requests per mode")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per mode")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if HAVE_UVLOOP:  # as the proxy does when it is there
        import uvloop

        results = uvloop.run(asyncio.wait_for(main(args), 900))
    else:
        results = asyncio.run(asyncio.wait_for(main(args), 900))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(_report(results, args))

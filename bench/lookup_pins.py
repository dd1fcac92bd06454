"""Looked-up blocks that vanish before their load: the store connector without pins and with.

A real ``kvpool master`` with a small memory segment, kept full by a second process that
writes fresh objects at a steady rate (other traffic: every put evicts something).  This
process runs the store connector's two halves without vLLM, as its unit tests drive them
(:class:`~kvpool.connectors.store.scheduler.StoreScheduler` and
:class:`~kvpool.connectors.store.worker.StoreWorker`, each with its own connection to the
master, as vLLM's scheduler and worker processes have).  Each request picks one of a set
of prompts (their blocks together exceed the pool, so hits come and go), is looked up,
waits ``--delay-steps`` scheduler steps of ``--step-ms`` (what a request admitted in one
step and loaded in a later one waits), is loaded, saves what it computed (what a failed
load recomputes, too) and finishes.

Reported per mode: the blocks the lookups matched and the fraction of them that failed
to load (evicted between lookup and load, then recomputed).  ``pins off`` is the
scheduler with ``pin_hits=False`` (the connector before request-owned pins); the two
modes alternate request by request in the same run, against the same traffic, so load
from other jobs hits both alike.  Bounded by ``--requests`` and ``--seconds``.

    python -m bench.lookup_pins [--requests 1000] [--seconds 240] [--eviction-policy lru]
        [--markdown]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing as mp
import multiprocessing.synchronize as mps
import os
import platform
import queue
import random
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvpool.client.client import Client
from kvpool.connectors.store.plan import StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.scheduler import StoreScheduler
from kvpool.connectors.store.worker import StoreWorker
from kvpool.core.keys import KeyNamespace
from kvpool.engines import MasterEngine, PoolEngine
from kvpool.errors import NoSpace
from kvpool.testing.processes import start_master

LOG = logging.getLogger("bench.lookup_pins")
BS = 16  # tokens per block
LAYERS, HEADS, ROW = 4, 2, 512  # a page (one block of every layer) of 64 KiB of bytes


@dataclass(frozen=True)
class Options:
    requests: int
    seconds: float
    segment_mib: int
    prompts: int
    prompt_blocks: int
    delay_steps: int
    step_ms: float
    writer_rate: int
    lease_ttl_ms: int
    policy: str
    seed: int


def page_bytes() -> int:
    return LAYERS * HEADS * BS * ROW


# ------------------------------------------------------------------ other traffic


def write_traffic(
    address: str, rate: int, chain: int, stop: mps.Event, deadline_s: float, out: Any
) -> None:
    """Other instances' traffic, from a second process, at ``rate`` puts per second until
    ``stop``: prompt chains of ``chain`` blocks saved with their parents, and every other
    chain read back once a few chains later (another instance's hit), so that its blocks
    compete in every reuse class of the eviction policy, as a real neighbour's do.  The
    pool stays full: each put evicts an old object."""
    value = os.urandom(page_bytes())
    counts: Counter[str] = Counter()
    buffers = [bytearray(page_bytes()) for _ in range(chain)]
    with Client(address, timeout_s=10) as client:
        start = time.monotonic()
        sent = 0
        for n in itertools.count():
            if stop.is_set() or time.monotonic() - start > deadline_s:
                break
            keys = [f"traffic-{os.getpid()}-{n}-{i}" for i in range(chain)]
            parents = [None, *keys[:-1]]
            for error in client.batch_put(keys, [value] * chain, parents=parents):
                kind = (
                    "ok" if error is None else "no_space" if isinstance(error, NoSpace) else "err"
                )
                counts[kind] += 1
            sent += chain
            if n >= 4 and n % 2 == 0:
                old = [f"traffic-{os.getpid()}-{n - 4}-{i}" for i in range(chain)]
                sizes = client.batch_get_into(old, buffers)
                counts["reads"] += 1
                counts["read_hits"] += sum(1 for size in sizes if size >= 0)
            ahead = sent / rate - (time.monotonic() - start)
            if ahead > 0:
                stop.wait(ahead)
        counts["seconds_x1000"] = int((time.monotonic() - start) * 1000)
    out.put(dict(counts))


# ------------------------------------------------------------------ the connector's halves


class Req:
    """vLLM's Request, as far as the scheduler half reads it."""

    def __init__(self, req_id: str, tokens: list[int]) -> None:
        self.request_id = req_id
        self.all_token_ids = tokens
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self.lora_request = None
        self.cache_salt = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def step(req_id: str, block_ids: list[int], computed: int, scheduled: int, *, new: bool) -> Any:
    """A SchedulerOutput with one request in it (new, or cached with no new blocks)."""
    news = [SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=computed)]
    cached = SimpleNamespace(
        req_ids=[] if new else [req_id],
        resumed_req_ids=set(),
        new_block_ids=[] if new else [None],
        num_computed_tokens=[] if new else [computed],
    )
    return SimpleNamespace(
        scheduled_new_reqs=news if new else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: scheduled},
    )


def handle(address: str) -> PoolHandle:
    def opener() -> PoolEngine:
        return MasterEngine.connect(address, timeout_s=10)

    return PoolHandle(opener, reconnect_interval_s=1, describe=address)


def make_scheduler(address: str, *, pins: bool) -> StoreScheduler:
    ns = KeyNamespace("bench", "uint8", BS, layout="bench:pins", tp_size=1)
    return StoreScheduler(
        namespace=ns,
        pool=handle(address),
        saves=True,
        load_async=False,
        logger=LOG,
        pin_hits=pins,
    )


def make_worker(address: str, num_blocks: int) -> StoreWorker:
    worker = StoreWorker(tp_rank=0, pool=handle(address), loader_pool=handle(address), logger=LOG)
    caches = {
        f"layer.{i}": torch.zeros(num_blocks, HEADS, BS, ROW, dtype=torch.uint8)
        for i in range(LAYERS)
    }
    worker.register(caches)
    return worker


def serve(sched: StoreScheduler, worker: StoreWorker, req: Req, opts: Options) -> tuple[int, int]:
    """One request, as vLLM runs it: (blocks matched, of which failed to load)."""
    n = req.num_tokens
    block_ids = list(range(n // BS + 1))
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, (block_ids,), hit)
    plan = sched.build_plan(step(req.request_id, block_ids, hit, n - hit, new=True))
    time.sleep(opts.delay_steps * opts.step_ms / 1000)  # admitted now, loaded steps later
    worker.start_loads(StorePlan(loads=plan.loads))
    failed = worker.take_invalid_block_ids()
    worker.save(StorePlan(saves=plan.saves))
    if failed:  # vLLM recomputes from the first failed block; the connector saves them
        sched.on_load_errors(failed)
        again = sched.build_plan(step(req.request_id, block_ids, n, 0, new=False))
        worker.save(again)
    sched.request_finished(req)
    return hit // BS, len(failed)


# ------------------------------------------------------------------ the run


def run(opts: Options) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    prompts = [
        [p * 1_000_000 + t for t in range(opts.prompt_blocks * BS + 1)] for p in range(opts.prompts)
    ]
    flags = (
        "--segment_size",
        f"{opts.segment_mib * 1024 * 1024}",
        "--default_kv_lease_ttl",
        f"{opts.lease_ttl_ms}",
        "--eviction_policy",
        opts.policy,
    )
    ctx = mp.get_context("spawn")
    results: dict[str, Counter[str]] = {"pins off": Counter(), "pins on": Counter()}
    with start_master(*flags) as master:
        stop, out = ctx.Event(), ctx.Queue()
        writer = ctx.Process(
            target=write_traffic,
            args=(
                master.address,
                opts.writer_rate,
                opts.prompt_blocks,
                stop,
                opts.seconds + 30,
                out,
            ),
            daemon=True,
        )
        writer.start()
        halves = {
            "pins off": make_scheduler(master.address, pins=False),
            "pins on": make_scheduler(master.address, pins=True),
        }
        worker = make_worker(master.address, opts.prompt_blocks + 2)
        try:
            # Warm-up: every prompt once, so the pool holds some of them when measuring.
            for i, tokens in enumerate(prompts):
                serve(halves["pins on"], worker, Req(f"warm-{i}", list(tokens)), opts)
            start = time.monotonic()
            for i in range(opts.requests):
                if time.monotonic() - start > opts.seconds:
                    break
                mode = ("pins off", "pins on")[i % 2]
                tokens = list(rng.choice(prompts))
                matched, failed = serve(halves[mode], worker, Req(f"r{i}", tokens), opts)
                counts = results[mode]
                counts["requests"] += 1
                counts["asked_blocks"] += opts.prompt_blocks
                counts["matched_blocks"] += matched
                counts["failed_blocks"] += failed
                counts["requests_with_a_failure"] += int(failed > 0)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            try:
                traffic = out.get(timeout=60)  # before join: a queue's data must be read
            except queue.Empty:
                traffic = {}
            writer.join(30)
            if writer.is_alive():
                writer.kill()
                writer.join(10)
            worker.shutdown()
            for sched in halves.values():
                sched.close()
        stats = Client(master.address, timeout_s=10)
        with stats:
            snapshot = stats.stats()
    return {
        "modes": results,
        "elapsed_s": elapsed,
        "traffic": traffic,
        "evictions": snapshot["stats"]["evictions"],
    }


def report(opts: Options, out: dict[str, Any], markdown: bool) -> str:
    traffic = out["traffic"]
    seconds = traffic.get("seconds_x1000", 0) / 1000 or 1
    pages = opts.segment_mib * 1024 * 1024 // page_bytes()
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores,"
        f" load average {os.getloadavg()[0]:.1f}",
        f"segment {opts.segment_mib} MiB = {pages} pages of {page_bytes() >> 10} KiB;"
        f" {opts.prompts} prompts x {opts.prompt_blocks} blocks;"
        f" delay {opts.delay_steps} x {opts.step_ms:g} ms; lease TTL {opts.lease_ttl_ms} ms;"
        f" eviction policy {opts.policy}",
        f"other traffic: {traffic.get('ok', 0) / seconds:.0f} puts/s stored"
        f" ({traffic.get('no_space', 0)} NoSpace, {traffic.get('err', 0)} other errors);"
        f" master evictions {out['evictions']}; measured {out['elapsed_s']:.1f} s",
    ]
    header = ("mode", "requests", "matched blocks", "loaded", "failed to load", "fraction failed")
    rows = []
    for mode, c in out["modes"].items():
        matched = c["matched_blocks"]
        fraction = c["failed_blocks"] / matched if matched else 0.0
        loaded = matched - c["failed_blocks"]
        rows.append(
            (
                mode,
                str(c["requests"]),
                str(matched),
                str(loaded),
                str(c["failed_blocks"]),
                f"{fraction:.1%}",
            )
        )
    if markdown:
        lines.append("")
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines.extend("| " + " | ".join(r) + " |" for r in rows)
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
        for r in (header, *rows):
            lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests measured (both modes)")
    p.add_argument("--seconds", type=float, default=240, help="stop measuring after this long")
    p.add_argument("--segment-mib", type=int, default=16)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-blocks", type=int, default=8)
    p.add_argument("--delay-steps", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=15.0)
    p.add_argument("--writer-rate", type=int, default=1000, help="other traffic, puts/s")
    p.add_argument("--lease-ttl-ms", type=int, default=11_000, help="the master's flag")
    p.add_argument("--eviction-policy", default="prefix_aware", help="the master's flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    LOG.setLevel(logging.ERROR)  # each failed load is counted; its warning line is noise here
    opts = Options(
        requests=a.requests,
        seconds=a.seconds,
        segment_mib=a.segment_mib,
        prompts=a.prompts,
        prompt_blocks=a.prompt_blocks,
        delay_steps=a.delay_steps,
        step_ms=a.step_ms,
        writer_rate=a.writer_rate,
        lease_ttl_ms=a.lease_ttl_ms,
        policy=a.eviction_policy,
        seed=a.seed,
    )
    print(report(opts, run(opts), a.markdown))


if __name__ == "__main__":
    main()

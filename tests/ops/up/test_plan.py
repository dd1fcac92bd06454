"""``kvpool up``'s plan: the whole stack as data (pure)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from kvpool.cli import build_parser
from kvpool.config import MasterConfig, parse_node_config
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.kvconfig import parse_kv_transfer_config
from kvpool.ops.up.options import UpOptions
from kvpool.ops.up.plan import (
    CHAT_TEMPLATE,
    cpu_sets,
    kv_transfer_config,
    make_plan,
    ready_text,
)


def test_default_plan_is_master_then_both_instances_then_the_proxy(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0, 1), python="py"))
    assert [[p.name for p in stage] for stage in plan.stages] == [
        ["master"],
        ["prefill-0", "decode-0"],
        ["proxy"],
    ]
    urls = {p.name: p.health_url for p in plan.processes}
    assert urls == {
        "master": "http://127.0.0.1:50088/health",
        "prefill-0": "http://127.0.0.1:8100/health",
        "decode-0": "http://127.0.0.1:8200/health",
        "proxy": "http://127.0.0.1:8000/health",
    }
    assert plan.proxy_url == "http://127.0.0.1:8000"
    assert plan.build_model and plan.model_dir == tmp_path / "model" / "tiny-llama"
    assert all(p.log_path.parent == tmp_path / "logs" for p in plan.processes)


def test_vllm_instances_get_the_cpu_flags_and_environment(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0, 1), python="py"))
    p, d = plan.by_role("prefill")[0], plan.by_role("decode")[0]
    for spec, core in ((p, "0"), (d, "1")):
        argv = list(spec.argv)
        assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--enforce-eager" in argv
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
        assert argv[argv.index("--model") + 1] == str(plan.model_dir)
        assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
        template = Path(argv[argv.index("--chat-template") + 1])
        assert plan.files[template] == CHAT_TEMPLATE
        assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == core
        assert spec.env["HF_HUB_OFFLINE"] == "1"
        assert spec.env["VLLM_NO_USAGE_STATS"] == "1"
        assert spec.env["KVPOOL_CONFIG_PATH"] == str(plan.node_config_path)
    # the node config the connectors read points at the plan's master
    node = parse_node_config(json.loads(plan.files[plan.node_config_path]))
    assert node.master_address == "127.0.0.1:50088"
    assert node.local_hostname == "127.0.0.1"


def test_the_connectors_are_the_guides_multiconnector_with_recompute(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0,), python="py"))
    configs = {}
    for spec in plan.by_role("prefill") + plan.by_role("decode"):
        argv = list(spec.argv)
        configs[spec.role] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = configs[role]
        assert config["kv_connector"] == "MultiConnector"
        assert config["kv_role"] == kv_role
        assert config["kv_load_failure_policy"] == "recompute"  # top level, the guide's §8.3
        children = config["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children] == [
            "KVPoolTransferConnector",  # first: for a P/D request it claims the whole prompt
            "KVPoolStoreConnector",
        ]
        assert all(c["kv_role"] == kv_role for c in children)
        parsed = parse_kv_transfer_config(config)
        assert parsed.top.kind == "multi"
        assert [c.kind for c in parsed.children] == ["transfer", "store"]
    assert configs["prefill"]["kv_connector_extra_config"]["connectors"][0]["kv_port"] == "30000"
    assert configs["decode"]["kv_connector_extra_config"]["connectors"][0]["kv_port"] == "30100"
    store = configs["decode"]["kv_connector_extra_config"]["connectors"][1]
    assert store["kv_connector_extra_config"]["load_async"] is True


def test_kvpool_doctor_passes_the_planned_pair(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, python="py"))
    plan.node_config_path.write_text(plan.files[plan.node_config_path])
    options = DoctorOptions(
        prefill_config=json.dumps(kv_transfer_config("prefill", 30000, "127.0.0.1")),
        decode_config=json.dumps(kv_transfer_config("decode", 30100, "127.0.0.1")),
        probe_keys=False,
    )
    env = {"KVPOOL_CONFIG_PATH": str(plan.node_config_path)}  # as the plan gives vLLM
    checks = [c for c in run_doctor(options, env=env) if c.name.startswith("connector")]
    report = format_text(checks)
    assert checks and [c for c in checks if c.status is Status.FAIL] == [], report


def test_the_master_gets_a_memory_segment_and_an_ssd_tier(tmp_path: Path) -> None:
    plan = make_plan(
        UpOptions(state_dir=tmp_path, segment_size=512 << 20, ssd_limit=2 << 30, python="py")
    )
    master = plan.by_role("master")[0]
    assert master.argv[:4] == ("py", "-m", "kvpool", "master")
    config = MasterConfig.from_argv(master.argv[3:])
    assert config.port == 50088 and config.host == "127.0.0.1"
    assert config.segment_size == 512 << 20
    assert config.enable_offload
    assert config.ssd_offload_path == str(tmp_path / "ssd")
    assert config.ssd_offload_limit == 2 << 30
    assert (config.eviction_high_watermark_ratio, config.default_kv_lease_ttl) == (0.9, 11000)
    assert tmp_path / "ssd" in plan.dirs


def test_the_proxy_fronts_every_instance(tmp_path: Path) -> None:
    plan = make_plan(
        UpOptions(state_dir=tmp_path, decode_instances=2, policy="least_inflight", python="py")
    )
    proxy = plan.by_role("proxy")[0]
    args = build_parser().parse_args(list(proxy.argv[3:]))
    assert args.prefill == ["http://127.0.0.1:8100"]
    assert args.decode == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert (args.port, args.policy) == (8000, "least_inflight")


def test_several_decode_instances_get_their_own_ports_and_cores(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, decode_instances=2, cpus=(0, 1), python="py"))
    decodes = plan.by_role("decode")
    assert [d.name for d in decodes] == ["decode-0", "decode-1"]
    assert [d.url for d in decodes] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    ports = []
    for d in decodes:
        config = json.loads(d.argv[list(d.argv).index("--kv-transfer-config") + 1])
        ports.append(config["kv_connector_extra_config"]["connectors"][0]["kv_port"])
    assert ports == ["30100", "30101"]
    cores = [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plan.by_role("prefill") + decodes]
    # two cores, three instances: the prefill keeps a core of its own, the decodes share
    assert cores == ["0", "1", "1"]


def test_cpu_sets() -> None:
    assert cpu_sets(range(8), 2) == ["0-3", "4-7"]
    assert cpu_sets((0, 1), 2) == ["0", "1"]
    assert cpu_sets((0, 1), 3) == ["0", "1", "0"]
    assert cpu_sets((0, 1), 3, dedicated=1) == ["0", "1", "1"]
    assert cpu_sets((0, 1, 2), 5, dedicated=1) == ["0", "1", "2", "1", "2"]
    assert cpu_sets((0,), 2, dedicated=1) == ["0", "0"]  # nothing left to share: round robin
    assert cpu_sets((0, 2, 4, 6), 2) == ["0,2", "4,6"]
    assert cpu_sets((5,), 2) == ["5", "5"]


def test_a_real_model_is_used_as_given(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    plan = make_plan(UpOptions(state_dir=tmp_path, model=model, python="py"))
    assert not plan.build_model and plan.model_dir == model and plan.model_name == "my-model"
    argv = list(plan.by_role("decode")[0].argv)
    assert argv[argv.index("--dtype") + 1] == "auto"
    assert "--chat-template" not in argv  # a real model brings its own
    named = make_plan(
        UpOptions(state_dir=tmp_path, model=model, served_model_name="glm", dtype="bfloat16")
    )
    argv = list(named.by_role("prefill")[0].argv)
    assert argv[argv.index("--served-model-name") + 1] == "glm"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def test_no_vllm_is_the_master_alone(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, no_vllm=True, python="py"))
    assert [p.name for p in plan.processes] == ["master"]
    assert not plan.build_model and plan.proxy_url is None
    labels = dict(ready_text(plan))
    assert labels["metrics"] == (
        'curl -s http://127.0.0.1:50088/metrics | grep -E "kv_cache|connected"'
    )
    assert "completion" not in labels


def test_ready_text_curls_are_one_pasteable_line(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, proxy_port=9000, python="py"))
    labels = dict(ready_text(plan))
    for label, path, stream in (
        ("completion", "/v1/completions", False),
        ("streamed chat", "/v1/chat/completions", True),
    ):
        line = labels[label]
        assert "\n" not in line
        argv = shlex.split(line)
        assert argv[0] == "curl" and argv[2] == "http://127.0.0.1:9000" + path
        assert ("-sN" in argv) is stream
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["model"] == "tiny-llama"
        assert body.get("stream", False) is stream


@pytest.mark.parametrize("source", ["KVPOOL_API_KEY_FILE", "KVPOOL_API_KEY"])
def test_ready_text_curls_carry_the_proxys_key_when_one_is_set(tmp_path: Path, source: str) -> None:
    # The proxy inherits the key from kvpool up's environment: the pasted curl must send
    # it (read where it is kept, never printed), or it gets 401.
    key = "k" * 32
    keys = tmp_path / "proxy.key"
    keys.write_text(f"# the proxy's keys\n\n  {key}\n{'x' * 32}\n")
    keys.chmod(0o600)
    env = {source: str(keys) if source.endswith("_FILE") else key}
    plan = make_plan(UpOptions(state_dir=tmp_path, proxy_port=9000, python="py"))
    labels = dict(ready_text(plan, env))
    assert "Authorization" not in dict(ready_text(plan))["completion"]  # none set: none sent
    for label in ("completion", "streamed chat"):
        assert key not in labels[label]
        # the line as a shell runs it, with curl swapped for a printer of its arguments
        done = subprocess.run(
            ["bash", "-c", "curl() { printf '%s\\n' \"$@\"; }; " + labels[label]],
            capture_output=True,
            text=True,
            env={"PATH": os.environ["PATH"], **env},
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert f"Authorization: Bearer {key}" in done.stdout.splitlines()

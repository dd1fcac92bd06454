"""``kvpool config render``: the inventory's validation, the files it writes, and the proof
that what it writes passes ``kvpool doctor``."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvpool.config import MasterConfig, Topology, load_node_config
from kvpool.config.node import node_engine
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.kvconfig import parse_kv_transfer_text, parse_vllm_command
from kvpool.ops.render import load_inventory, parse_inventory, render, write_rendered
from kvpool.testing.mooncake import Namespace
from tests.ops.helpers import MLA_MODEL, StandInMaster, free_port_range

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inventory.toml"


def example() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE.read_text())


def test_the_example_inventory_renders_the_guides_configs() -> None:
    files = render(parse_inventory(example()))
    assert set(files) == {
        "master.sh", "README.md", "secret",  # 10.x hosts: the cluster runs on a secret
        "p0/master.sh",  # beside p0's files: doctor --master-cmd master.sh runs there
        "proxy.sh", "proxy.key",  # beyond loopback the proxy needs an API key
        *(f"{h}/{f}" for h in ("p0", "d0") for f in (
            "mooncake.json", "kv-transfer-config.json", "env.sh", "node.sh", "serve.sh",
            "secret",
        )),
    }  # fmt: skip
    p0 = json.loads(files["p0/mooncake.json"])
    d0 = json.loads(files["d0/mooncake.json"])
    assert p0["metadata_server"] == d0["metadata_server"] == "10.0.0.1:50088"
    assert (p0["local_hostname"], d0["local_hostname"]) == ("10.0.0.1", "10.0.0.2")
    assert p0["enable_ssd_offload"] is True and "enable_ssd_offload" not in d0
    assert "--host 10.0.0.1 --port 50088" in files["master.sh"]
    assert "--enable_offload=true" in files["master.sh"]

    p = parse_kv_transfer_text(files["p0/kv-transfer-config.json"])
    d = parse_kv_transfer_text(files["d0/kv-transfer-config.json"])
    assert p.top.raw["kv_load_failure_policy"] == d.top.raw["kv_load_failure_policy"]
    assert p.top.raw["kv_load_failure_policy"] == "recompute"
    assert "kv_load_failure_policy" not in p.children[0].raw
    assert {e.role for e in p.entries} == {"kv_producer"}
    assert {e.role for e in d.entries} == {"kv_consumer"}
    assert p.transfer is not None and d.transfer is not None
    assert (p.transfer.port("kv_port"), d.transfer.port("kv_port")) == (30000, 30100)
    # the peer's layout, as the production guide's §5.4 requires
    assert p.transfer.topology("decode") == Topology(8, 4)
    assert d.transfer.topology("prefill") == Topology(4, 8)
    assert p.store is not None and d.store is not None
    assert p.store.port("lookup_rpc_port") == 0
    assert d.store.extra["load_async"] is True and "load_async" not in p.store.extra

    command = parse_vllm_command(files["d0/serve.sh"])
    assert command.topology == Topology(8, 4) and command.model == "/workspace/GLM-5.2-w8a8"
    assert command.kv_transfer_config is not None
    assert json.loads(command.kv_transfer_config) == json.loads(files["d0/kv-transfer-config.json"])
    assert "KVPOOL_CONNECT_TIMEOUT_MS=16000" in files["d0/env.sh"]  # 500 ms × 32 decode ranks


def test_rendered_node_configs_load_with_the_real_loader(tmp_path: Path) -> None:
    write_rendered(render(parse_inventory(example())), tmp_path)
    node = load_node_config(tmp_path / "p0" / "mooncake.json", env={})
    assert node.ssd_offload_limit == 1000 * 2**30
    assert node.global_segment_size == 64 * 2**30  # Mooncake's GB
    assert os.access(tmp_path / "master.sh", os.X_OK)


def _broken(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(example())
    for key, value in changes.items():
        if key.startswith("host0_"):
            data["hosts"][0][key.removeprefix("host0_")] = value
        elif key.startswith("host1_"):
            data["hosts"][1][key.removeprefix("host1_")] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (_broken(modle="/m"), "modle"),
        (_broken(host0_rol="prefill"), "hosts[0].rol"),
        (_broken(host1_role="router"), "hosts[1].role"),
        (_broken(host1_role="prefill"), "no decode host"),
        (_broken(hosts=[]), "no hosts"),
        (_broken(host0_tp_size=0), "hosts[0].tp_size"),
        (_broken(global_segment_size="lots"), "global_segment_size"),
        (_broken(master={"eviction_ratio": 2}), "--eviction_ratio"),
        (_broken(master={"default_kv_lease_ttl": 5000}), "default_kv_lease_ttl"),
        (_broken(host1_address="10.0.0.1", host1_kv_port=30010), "overlap"),
        (_broken(host1_address="10.0.0.1", host1_http_port=8100), "http_port"),
        (_broken(host1_name="p0"), "share a name"),
        (_broken(master={"secret_file": "/s"}), "master.secret_file: remove it"),
        (_broken(master={"insecure": True}), "master.insecure: remove it"),
        (_broken(master={"segmnt_size": "1GB"}), "--segmnt_size: unknown master flag"),
        (_broken(protocol="infiniband"), "protocol: unknown 'infiniband'"),
        (_broken(protocol="rdma"), "device_name: protocol rdma needs"),
    ],
)
def test_inventory_mistakes_are_errors_naming_the_key(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_inventory(data)
    assert fragment in str(err.value)


def test_hosts_of_one_role_with_different_layouts_are_refused() -> None:
    data = example()
    data["hosts"].append({**data["hosts"][1], "name": "d1", "address": "10.0.0.3", "tp_size": 2})
    with pytest.raises(ConfigError, match="differ in dp_size/tp_size"):
        parse_inventory(data)


def test_json_inventories_work_and_bad_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(example()))
    assert parse_inventory(load_inventory(path)).model == "/workspace/GLM-5.2-w8a8"
    bad = tmp_path / "bad.toml"
    bad.write_text("hosts = [")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_inventory(bad)


def _local_inventory(tmp_path: Path, master: StandInMaster) -> dict[str, Any]:
    """P and D on this host, as `kvpool up` runs them, with free ports and a real SSD dir."""
    base = free_port_range(102)
    ssd = tmp_path / "nvme"
    ssd.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MLA_MODEL))
    return {
        "model": str(model),
        "config_dir": str(tmp_path / "unused"),
        "master_port": master.port,
        "global_segment_size": "64MiB",
        "consumer_is_to_put": True,
        "prefill_kv_port": base,
        "decode_kv_port": base + 100,
        "hosts": [
            {"name": "p0", "address": "127.0.0.1", "role": "prefill", "tp_size": 2,
             "ssd_offload_path": str(ssd), "ssd_offload_limit": "1MB"},
            {"name": "d0", "address": "127.0.0.1", "role": "decode", "dp_size": 2},
        ],
    }  # fmt: skip


def test_rendered_configs_pass_doctor(tmp_path: Path, master: StandInMaster) -> None:
    inventory = _local_inventory(tmp_path, master)
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(inventory)), out)
    for name in ("p0", "d0"):  # doctor on each node, both instances on this one host
        env = {"KVPOOL_CONFIG_PATH": str(out / name / "mooncake.json")}
        for line in (out / name / "env.sh").read_text().splitlines():
            if line.startswith(("export KVPOOL_CONNECT", "export KVPOOL_TRANSFER")):
                key, _, value = line.removeprefix("export ").partition("=")
                env[key] = value
        options = DoctorOptions(
            prefill_config=str(out / "p0" / "serve.sh"),
            decode_config=str(out / "d0" / "serve.sh"),
            model=inventory["model"],
            master=master.address,
            master_cmd=str(out / "master.sh"),
            probe_keys=False,
        )
        checks = run_doctor(options, env=env)
        report = format_text(checks)
        assert [c for c in checks if c.status in (Status.FAIL, Status.WARN)] == [], report
        names = {c.name for c in checks if c.status is Status.PASS}
        assert {"connector.peer_topology[prefill]", "connector.peer_topology[decode]"} <= names
        assert {"master.health", "ssd.offload", "timeouts.lease", "config.master"} <= names


def test_the_render_command_writes_files_and_refuses_a_bad_inventory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvpool", "config", "render", str(EXAMPLE), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (out / "d0" / "kv-transfer-config.json").is_file()
    assert "master: 10.0.0.1:50088" in done.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "/m"\n[[hosts]]\naddress = "h"\nrole = "prefill"\n')
    done = subprocess.run(
        [*cmd[:5], str(bad), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "no decode host" in done.stderr


def test_config_check_prints_a_valid_file_and_names_a_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "m:50088"}))
    cmd = [sys.executable, "-m", "kvpool", "config", "check", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "master_port = 50088" in done.stdout
    path.write_text(json.dumps({"local_hostname": "h", "metadata_sever": "m:50088"}))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "metadata_sever" in done.stderr


# --------------------------------------------------------------------------- engine mooncake


def test_engine_mooncake_renders_mooncakes_master_and_configs() -> None:
    inv = parse_inventory(example(), engine="mooncake")
    files = render(inv)
    assert set(files) == {
        "master.sh",
        "p0/master.sh",
        "proxy.sh",
        "proxy.key",  # the proxy is kvpool's on both engines
        "README.md",  # no secret: Mooncake has no credentials
        *(
            f"{h}/{f}"
            for h in ("p0", "d0")
            for f in (
                "mooncake.json",
                "kv-transfer-config.json",
                "env.sh",
                "serve.sh",
            )
        ),
    }  # fmt: skip  (no node.sh: every vLLM process contributes its own segment)
    for name, address in (("p0", "10.0.0.1"), ("d0", "10.0.0.2")):
        data = json.loads(files[f"{name}/mooncake.json"])
        assert node_engine(data) == "mooncake"
        node = parse_mooncake_config(data)  # Mooncake's keys, as Mooncake reads them
        assert node.local_hostname == address and node.metadata_server == "P2PHANDSHAKE"
        assert node.master_server_address == "10.0.0.1:50088"
        assert node.global_segment_size == 64 << 30 and node.local_buffer_size == 1 << 30
        assert node.protocol == "tcp"
        env = files[f"{name}/env.sh"]
        assert "export MOONCAKE_CONFIG_PATH=/workspace/config/mooncake.json" in env
        assert "every interface" in env
        kv = parse_kv_transfer_text(files[f"{name}/kv-transfer-config.json"])
        assert kv.store is not None and kv.store.extra["backend"] == "mooncake"
        assert kv.top.raw["kv_load_failure_policy"] == "recompute"
    assert json.loads(files["p0/mooncake.json"])["ssd_offload_path"] == "/mnt/nvme/kvpool_ssd"
    assert "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES=1073741824000" in files["p0/env.sh"]
    master = shlex.split(files["master.sh"].splitlines()[-1])
    assert master[:2] == ["exec", "mooncake_master"]
    assert set(master[2:]) == {
        "--rpc_address=10.0.0.1",
        "--rpc_port=50088",
        "--metrics_port=9003",
        "--eviction_high_watermark_ratio=0.9",
        "--eviction_ratio=0.1",
        "--default_kv_lease_ttl=11000",
        "--client_ttl=120",
        "--enable_offload=true",
    }
    # the inventory's own key says the same; a bad one is named
    assert parse_inventory({**example(), "engine": "mooncake"}).engine == "mooncake"
    assert parse_inventory(example()).engine == "kvpool"
    with pytest.raises(ConfigError, match="engine: 'etcd' is not a pool engine"):
        parse_inventory({**example(), "engine": "etcd"})
    with pytest.raises(ConfigError, match="local_buffer_size"):
        parse_inventory({**example(), "local_buffer_size": "lots"}, engine="mooncake")


def test_mooncake_rendered_configs_pass_doctor_against_a_real_master(tmp_path: Path) -> None:
    """The files render --engine mooncake writes, checked by doctor on the node, against
    the wheel's mooncake_master started from the rendered master.sh's flags, all in a
    private network namespace (Mooncake binds every interface)."""
    inventory = {
        "engine": "mooncake",
        "model": str(tmp_path / "model"),
        "config_dir": str(tmp_path / "unused"),
        "master_port": 50051,
        "metrics_port": 9115,
        "global_segment_size": "64MB",
        "local_buffer_size": "16MB",
        "hosts": [
            {"name": "p0", "address": "127.0.0.1", "role": "prefill"},
            {"name": "d0", "address": "127.0.0.1", "role": "decode", "kv_port": 30100},
        ],
    }
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(inventory)), out)
    flags = shlex.split((out / "master.sh").read_text().splitlines()[-1])[2:]
    rpc = [f for f in flags if f.startswith("--rpc_port=")]
    metrics = [f for f in flags if f.startswith("--metrics_port=")]
    assert rpc == ["--rpc_port=50051"] and metrics == ["--metrics_port=9115"]
    guide = [f for f in flags if not f.startswith(("--rpc_", "--metrics_"))]
    with Namespace() as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster", *guide, rpc_port=50051, metrics_port=9115)
        for name in ("p0", "d0"):
            env = {
                k: v
                for line in (out / name / "env.sh").read_text().splitlines()
                if line.startswith("export ")
                for k, _, v in [line.removeprefix("export ").partition("=")]
            }
            env["MOONCAKE_CONFIG_PATH"] = env["KVPOOL_CONFIG_PATH"] = str(
                out / name / "mooncake.json"
            )
            options = DoctorOptions(
                prefill_config=str(out / "p0" / "serve.sh"),
                decode_config=str(out / "d0" / "serve.sh"),
                master="127.0.0.1:50051",
                master_cmd=str(out / "master.sh"),
                probe_keys=False,
            )
            checks = ns.run("kvpool.ops.doctor:run_doctor", options, env=env)
            report = format_text(checks)
            assert [c for c in checks if c.status is Status.FAIL] == [], report
            by_name = {c.name: c for c in checks}
            # what doctor warns of on any Mooncake node before vLLM starts: no credentials
            # on Mooncake's ports, no client registered yet, and P reached on loopback
            warned = {c.name for c in checks if c.status is Status.WARN}
            expected = {"security.credentials", "master.metrics", "connector.kv_host[prefill]"}
            assert warned <= expected, report
            # said plainly, with what to do: no credentials, so network isolation
            open_pool = by_name["security.credentials"]
            assert open_pool.status is Status.WARN and "network isolation" in open_pool.message
            assert not [c for c in checks if c.name.startswith("security.secret_file")], report
            assert "a Mooncake config" in by_name["config.file"].message, report
            for passed in ("config.master", "master.engine", "master.flags", "timeouts.lease"):
                assert by_name[passed].status is Status.PASS, report
            assert "lease 11000 ms" in by_name["master.flags"].message, report
            assert by_name["connector.settings[prefill]"].status is Status.PASS, report


def test_the_render_command_takes_engine_mooncake(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvpool", "config", "render", str(EXAMPLE), "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--engine", "mooncake"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "every interface" in done.stdout
    assert "mooncake_master" in (out / "master.sh").read_text()
    assert not (out / "p0" / "node.sh").exists()


def test_every_master_key_of_the_inventory_reaches_master_sh() -> None:
    # [master] keys beyond the guide's §3 flags used to be parsed and dropped
    data = _broken(
        master={
            "eviction_ratio": 0.2,
            "segment_size": "8GB",
            "eviction_policy": "lru",
            "open_metrics": True,
            "tenant_quota": "teamA=1GB",
            "ssd_offload_path": "/mnt/nvme/master_ssd",
        }
    )
    argv = shlex.split(render(parse_inventory(data))["master.sh"].splitlines()[-1])
    config = MasterConfig.from_argv(argv[1:])  # `exec kvpool master ...`
    assert argv[:3] == ["exec", "kvpool", "master"]
    assert config.eviction_ratio == 0.2 and config.segment_size == 8 << 30
    assert config.eviction_policy == "lru" and config.open_metrics
    assert config.tenant_quota == "teamA=1GB"
    assert config.ssd_offload_path == "/mnt/nvme/master_ssd"


def test_on_mooncake_a_master_key_mooncake_lacks_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"master\.eviction_policy: mooncake_master has no"):
        parse_inventory(_broken(master={"eviction_policy": "lru"}), engine="mooncake")


def test_rdma_renders_on_a_machine_without_infiniband_and_the_host_refuses_it(
    tmp_path: Path,
) -> None:
    # the machine that renders (an operator's box) never has the NIC: the host checks it
    data = _broken(protocol="rdma", device_name="ibp8s0f0")
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(data)), out)
    node = json.loads((out / "d0" / "mooncake.json").read_text())
    assert (node["protocol"], node["device_name"]) == ("rdma", "ibp8s0f0")
    with pytest.raises(ConfigError) as err:  # this host: no /sys/class/infiniband device
        load_node_config(out / "d0" / "mooncake.json", env={})
    assert "rdma" in str(err.value) and "tcp" in str(err.value)  # the fix is named


def test_mooncake_configs_carry_sizes_as_plain_bytes_mooncake_reads() -> None:
    from mooncake.mooncake_config import _parse_segment_size

    data = _broken(global_segment_size="64GiB", local_buffer_size="512MiB")
    files = render(parse_inventory(data, engine="mooncake"))
    node = json.loads(files["d0/mooncake.json"])
    assert (
        node["global_segment_size"]
        == 64 << 30
        == _parse_segment_size(str(node["global_segment_size"]))
    )
    assert node["local_buffer_size"] == 512 << 20


def test_the_rendered_proxy_command_carries_its_key_and_refuses_to_run_without(
    tmp_path: Path,
) -> None:
    # the proxy bound beyond loopback exits 2 without an API key: the documented command
    # used to crash-loop; render now writes proxy.sh with proxy.key
    from kvpool.cli import _run_proxy, build_parser
    from kvpool.proxy.auth import resolve_api_keys

    out = tmp_path / "out"
    write_rendered(render(parse_inventory(example())), out)
    argv = shlex.split((out / "proxy.sh").read_text().splitlines()[-1])[2:]  # exec kvpool
    assert argv[:3] == ["proxy", "--host", "0.0.0.0"]
    assert argv[argv.index("--prefill") + 1] == "http://10.0.0.1:8100"
    assert argv[argv.index("--decode") + 1] == "http://10.0.0.2:8200"
    key_file = argv[argv.index("--api-key-file") + 1]
    assert key_file == "/workspace/config/proxy.key"
    assert (out / "proxy.key").stat().st_mode & 0o777 == 0o600
    key = (out / "proxy.key").read_text().strip()
    here = [a if a != key_file else str(out / "proxy.key") for a in argv]
    assert resolve_api_keys([], str(out / "proxy.key"), {}) == (key,)
    args = build_parser().parse_args(here)
    assert args.api_key_file == str(out / "proxy.key")
    unkeyed = build_parser().parse_args([a for a in argv if a not in ("--api-key-file", key_file)])
    with pytest.raises(ConfigError, match="API key"):
        _run_proxy(unkeyed)


def test_the_rendered_pair_checks_out_from_the_machine_that_rendered_it(tmp_path: Path) -> None:
    # docs/multihost.md runs doctor on the pair where it was rendered: no node config
    # there (it is P's and D's), which used to FAIL config.file and the store's settings
    out = tmp_path / "out"
    write_rendered(render(parse_inventory(example())), out)
    options = DoctorOptions(
        prefill_config=str(out / "p0" / "serve.sh"),
        decode_config=str(out / "d0" / "serve.sh"),
        master_cmd=str(out / "master.sh"),
        separate_hosts=True,
        probe_keys=False,
    )
    checks = run_doctor(options, env={})
    assert [c for c in checks if c.status is Status.FAIL] == [], format_text(checks)
    by_name = {c.name: c for c in checks}
    assert by_name["config.file"].status is Status.SKIP
    assert by_name["connector.settings[decode]"].status is Status.PASS
    # on a host, a missing node config is still a failure
    alone = DoctorOptions(prefill_config=options.prefill_config, probe_keys=False)
    here = run_doctor(alone, env={})
    assert {c.name: c for c in here}["config.file"].status is Status.FAIL

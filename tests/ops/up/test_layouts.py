"""``kvpool up`` with P and D layouts (``--prefill-tp``/``--decode-tp``/``-dp``): each side's
command line and ``--kv-transfer-config``, checked by ``kvpool doctor`` as an operator
would paste them."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvpool.cli import build_parser
from kvpool.config import Topology
from kvpool.errors import ConfigError
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Check, Status
from kvpool.ops.up.options import UpOptions, options_from_args
from kvpool.ops.up.plan import ProcessSpec, make_plan, planned_ports, rank_binds


def _kv_config(spec: ProcessSpec) -> dict[str, Any]:
    argv = list(spec.argv)
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def _transfer_extra(spec: ProcessSpec) -> dict[str, Any]:
    child: dict[str, Any] = _kv_config(spec)["kv_connector_extra_config"]["connectors"][0]
    return child["kv_connector_extra_config"]  # type: ignore[no-any-return]


def _flag(spec: ProcessSpec, flag: str) -> str:
    return spec.argv[spec.argv.index(flag) + 1]


def test_the_flags_reach_the_options() -> None:
    args = build_parser().parse_args(
        ["up", "--prefill-tp", "2", "--decode-tp", "1", "--prefill_dp", "2", "--decode-dp", "1"]
    )
    opts = options_from_args(args, {}, (0, 1), "py")
    assert opts.prefill_layout == Topology(dp_size=2, tp_size=2)
    assert opts.decode_layout == Topology(dp_size=1, tp_size=1)
    defaults = options_from_args(build_parser().parse_args(["up"]), {}, (0,), "py")
    assert defaults.prefill_layout == defaults.decode_layout == Topology(1, 1)


@pytest.mark.parametrize("flag", ["prefill_tp", "decode_tp", "prefill_dp", "decode_dp"])
def test_a_bad_size_names_the_flag(tmp_path: Path, flag: str) -> None:
    with pytest.raises(ConfigError, match="--" + flag.replace("_", "-")):
        UpOptions(state_dir=tmp_path, **{flag: 0})  # type: ignore[arg-type]


def test_each_side_gets_its_own_layout_and_the_peers_in_its_config(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0, 1), prefill_tp=2, python="py"))
    (p,), (d,) = plan.by_role("prefill"), plan.by_role("decode")
    assert (_flag(p, "--tensor-parallel-size"), _flag(p, "--data-parallel-size")) == ("2", "1")
    assert (_flag(d, "--tensor-parallel-size"), _flag(d, "--data-parallel-size")) == ("1", "1")
    # both sides carry both layouts, as the guide's JSON does; P reads "decode", D "prefill"
    for spec in (p, d):
        extra = _transfer_extra(spec)
        assert extra["prefill"] == {"dp_size": 1, "tp_size": 2}
        assert extra["decode"] == {"dp_size": 1, "tp_size": 1}
    # one core list per rank: the TP 2 prefill's ranks on both cores, the decode on one
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert d.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_instances_kv_ports_leave_room_for_every_rank(tmp_path: Path) -> None:
    opts = UpOptions(
        state_dir=tmp_path, prefill_instances=2, prefill_tp=2, prefill_dp=2, python="py"
    )
    plan = make_plan(opts)
    ports = [_kv_config(s)["kv_connector_extra_config"]["connectors"][0]["kv_port"] for s in
             plan.by_role("prefill")]  # fmt: skip
    assert ports == ["30000", "30004"]  # 4 ranks each: 30000..30003, 30004..30007
    kv_uses = [u.port for u in planned_ports(opts) if u.flag == "--prefill-kv-port"]
    assert kv_uses == list(range(30000, 30008))
    # a decode kv_port inside a prefill's rank range is a clash, named by its flags
    with pytest.raises(ConfigError, match=r"--decode-kv-port.*--prefill-kv-port"):
        make_plan(UpOptions(state_dir=tmp_path, prefill_tp=2, decode_kv_port=30001, python="py"))


def test_rank_binds_deal_cores_per_rank() -> None:
    assert rank_binds((0, 1), [2, 1], dedicated=1) == ["0|1", "0"]
    assert rank_binds((0, 1), [1, 2], dedicated=1) == ["0", "1|1"]
    assert rank_binds((0, 1, 2, 3), [2, 2], dedicated=1) == ["0|1", "2|3"]
    assert rank_binds((0, 1, 2, 3), [1, 1], dedicated=1) == ["0-1", "2-3"]


def _doctor(prefill: str, decode: str, tmp_path: Path) -> list[Check]:
    plan = make_plan(UpOptions(state_dir=tmp_path, python="py"))
    plan.node_config_path.write_text(plan.files[plan.node_config_path])
    options = DoctorOptions(prefill_config=prefill, decode_config=decode, probe_keys=False)
    env = {"KVPOOL_CONFIG_PATH": str(plan.node_config_path)}
    return [c for c in run_doctor(options, env=env) if c.name.startswith("connector")]


@pytest.mark.parametrize(("ptp", "dtp", "pdp"), [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)])
def test_doctor_passes_the_planned_command_lines(
    tmp_path: Path, ptp: int, dtp: int, pdp: int
) -> None:
    opts = UpOptions(state_dir=tmp_path, prefill_tp=ptp, decode_tp=dtp, prefill_dp=pdp, python="py")
    plan = make_plan(opts)
    (p,), (d,) = plan.by_role("prefill"), plan.by_role("decode")
    checks = _doctor(shlex.join(p.argv), shlex.join(d.argv), tmp_path)
    report = format_text(checks)
    assert [c for c in checks if c.status is Status.FAIL] == [], report
    topology = {c.name: c for c in checks if c.name.startswith("connector.peer_topology")}
    assert {c.status for c in topology.values()} == {Status.PASS}, report


def test_doctor_fails_a_prefill_that_describes_itself_and_says_the_fix(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, prefill_tp=2, python="py"))
    (p,), (d,) = plan.by_role("prefill"), plan.by_role("decode")
    argv = list(p.argv)
    at = argv.index("--kv-transfer-config") + 1
    swapped = json.loads(argv[at])
    swapped["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["decode"] = {
        "dp_size": 1,
        "tp_size": 2,
    }  # P's own layout, not the decode's
    argv[at] = json.dumps(swapped)
    checks = _doctor(shlex.join(argv), shlex.join(d.argv), tmp_path)
    failed = [c for c in checks if c.status is Status.FAIL]
    assert [c.name for c in failed] == ["connector.peer_topology[prefill]"], format_text(checks)
    text = format_text(failed)
    assert "must describe the PEER" in text
    assert 'set "decode": {"dp_size": 1, "tp_size": 1}' in text


def test_doctor_reads_a_command_line_whose_json_is_longer_than_a_file_name(
    tmp_path: Path,
) -> None:
    # a pasted `vllm serve` line with no "/" near its JSON: taken for a path, it raised
    # "File name too long" instead of being read as the command it is
    plan = make_plan(UpOptions(state_dir=tmp_path, prefill_tp=2, python="py"))
    (p,), (d,) = plan.by_role("prefill"), plan.by_role("decode")

    def bare(spec: ProcessSpec) -> str:
        kv = _flag(spec, "--kv-transfer-config")
        tp, dp = _flag(spec, "--tensor-parallel-size"), _flag(spec, "--data-parallel-size")
        line = ["vllm", "serve", "model", "-tp", tp, "-dp", dp, "--kv-transfer-config", kv]
        return shlex.join(line)

    assert len(bare(p)) > 255 and "/" not in bare(p)
    checks = _doctor(bare(p), bare(d), tmp_path)
    topology = [c for c in checks if c.name.startswith("connector.peer_topology")]
    assert len(topology) == 2 and {c.status for c in topology} == {Status.PASS}, format_text(checks)

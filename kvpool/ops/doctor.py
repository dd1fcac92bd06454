"""``kvpool doctor``: the seed's troubleshooting table (§8.3) and checklist (§9) as one command.

    inputs (flags, files, env) ──gather──▶ facts ──pure checks──▶ [Check] ──▶ text | JSON

:func:`gather` is the only function here that touches files, sockets or the environment
(through :mod:`kvpool.ops.probes`); :func:`diagnose` turns gathered inputs into checks and
is what the tests drive with broken setups.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool import __version__
from kvpool.config import (
    CONFIG_PATH_VARS,
    MasterConfig,
    NodeConfig,
    Timeouts,
    config_path_from_env,
    env_lookup,
    load_node_config,
    parse_timeouts,
)
from kvpool.errors import ConfigError
from kvpool.ops import probes
from kvpool.ops.checks import Check, Status, fail
from kvpool.ops.checks_connector import ModelInfo, Side, connector_checks, model_info
from kvpool.ops.checks_host import (
    PortFacts,
    SsdFacts,
    check_peer_reachable,
    check_ports,
    check_ssd,
    check_timeouts,
)
from kvpool.ops.checks_node import (
    ConfigFileFacts,
    MasterFacts,
    check_config_file,
    check_cross_node,
    check_hashseed,
    check_key_agreement,
    check_local_hostname,
    check_master,
    check_master_address,
    check_master_flags,
    check_registered,
)
from kvpool.ops.checks_settings import settings_checks, transfer_settings
from kvpool.ops.kvconfig import (
    KVTransferConfig,
    command_argv,
    parse_kv_transfer_text,
    parse_vllm_command,
)

__all__ = [
    "DoctorOptions",
    "Gathered",
    "diagnose",
    "exit_code",
    "format_json",
    "format_text",
    "gather",
    "read_connector_input",
    "run_cli",
    "run_doctor",
]

_MAX_PORTS_PER_RANGE = 64


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What the operator gave on the command line (strings as typed)."""

    config: str | None = None
    kv_transfer_config: str | None = None  # JSON, a file, or a vLLM command line
    vllm_cmd: str | None = None
    prefill_config: str | None = None
    decode_config: str | None = None
    model: str | None = None
    master: str | None = None
    master_cmd: str | None = None
    prefill_host: str | None = None
    live: bool = False
    separate_hosts: bool = False
    probe_keys: bool = True


@dataclass(slots=True)
class Gathered:
    """Every fact doctor's checks need, already read from the outside world."""

    env: Mapping[str, str]
    input_errors: list[Check] = field(default_factory=list)
    sides: list[Side] = field(default_factory=list)
    local_sides: set[str] = field(default_factory=set)
    model: ModelInfo | None = None
    config_file: ConfigFileFacts | None = None
    hostname_error: str | None = None
    master: MasterFacts | None = None
    master_arg: str | None = None
    master_config: MasterConfig | None = None
    master_config_error: str | None = None
    timeouts: Timeouts | None = None
    ssd: SsdFacts | None = None
    ports: list[PortFacts] = field(default_factory=list)
    live: bool = False
    peer: tuple[str, int, str | None] | None = None
    key_probe: Mapping[str, Sequence[str] | str] = field(default_factory=dict)
    cross_node: tuple[Mapping[str, object] | None, bool, str | None] | None = None


def read_connector_input(value: str) -> tuple[KVTransferConfig, object]:
    """A ``--kv-transfer-config`` given as JSON, as a file (JSON or a shell script holding a
    ``vllm serve`` line), or as a vLLM command line.  Returns the config and, when it came
    from a command, the parsed command (its TP/DP and model)."""
    text = value.strip()
    if not text.startswith("{") and "\n" not in text and Path(text).is_file():
        text = Path(text).read_text(encoding="utf-8").strip()
    if text.startswith("{"):
        return parse_kv_transfer_text(text), None
    command = parse_vllm_command(text)
    if command.kv_transfer_config is None:
        raise ConfigError(
            "not JSON, not a readable file, and not a vLLM command with --kv-transfer-config:"
            f" {value[:60]!r}"
        )
    return parse_kv_transfer_text(command.kv_transfer_config), command


def _add_side(
    gathered: Gathered, label: str, value: str, side_name: str | None, local: bool
) -> str | None:
    """Parse one connector input into a Side; returns its model path when a command gave one."""
    try:
        config, command = read_connector_input(value)
    except (ConfigError, OSError) as exc:
        gathered.input_errors.append(
            fail(f"input.{label}", f"{label}: {exc}", "give valid JSON, a file, or a command")
        )
        return None
    topology = getattr(command, "topology", None)
    side = Side(side_name, config, topology) if side_name else Side.infer(config, topology)
    if any(s.side == side.side for s in gathered.sides):
        gathered.input_errors.append(
            fail(f"input.{label}", f"a second {side.side} config was given", "give one per side")
        )
        return None
    gathered.sides.append(side)
    if local:
        gathered.local_sides.add(side.side)
    model = getattr(command, "model", None)
    return model if isinstance(model, str) else None


def _read_model(gathered: Gathered, path: str, explicit: bool) -> None:
    p = Path(path)
    config = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        if explicit:
            gathered.input_errors.append(
                fail("input.model", f"cannot read {config}: {exc}", "--model DIR with config.json")
            )
        return
    if isinstance(data, dict):
        gathered.model = model_info(data)


def _node_config(gathered: Gathered, options: DoctorOptions) -> NodeConfig | None:
    env = gathered.env
    env_set = env_lookup(env, CONFIG_PATH_VARS) is not None
    shadowed = None
    values = [env.get(v, "").strip() for v in CONFIG_PATH_VARS]
    if all(values) and values[0] != values[1]:
        shadowed = f"{CONFIG_PATH_VARS[1]}={values[1]}"
    found = config_path_from_env(env)
    if options.config is not None:
        source, path = f"--config {options.config}", Path(options.config)
    elif found is not None:
        source, path = f"{found[0]}={found[1]}", found[1]
    else:
        gathered.config_file = ConfigFileFacts(None, None, None, env_set, shadowed)
        return None
    try:
        node = load_node_config(path, env=env)
    except ConfigError as exc:
        gathered.config_file = ConfigFileFacts(source, None, str(exc), env_set, shadowed)
        return None
    gathered.config_file = ConfigFileFacts(source, node, None, env_set, shadowed)
    return node


def _port_facts(label: str, start: int, count: int, live: bool) -> PortFacts:
    if live:
        return PortFacts(label, start, probes.port_bind_error(start))
    for port in range(start, start + min(count, _MAX_PORTS_PER_RANGE)):
        error = probes.port_bind_error(port)
        if error is not None:
            return PortFacts(label, port, error)
    return PortFacts(label, start, None)


def gather(options: DoctorOptions, env: Mapping[str, str] | None = None) -> Gathered:
    """Read every input and probe the outside world (the edge)."""
    g = Gathered(env=dict(os.environ) if env is None else env, live=options.live)
    _gather_sides(g, options)
    node = _node_config(g, options)
    _gather_node(g, node)
    _gather_master(g, options, node)
    _gather_ports(g, options)
    if options.probe_keys:
        g.key_probe = probes.key_probe()
        if g.master is not None and g.master.health_status == 200:
            host = node.local_hostname if node is not None else socket.gethostname()
            g.cross_node = probes.cross_node_probe(g.master.address, host, __version__)
    return g


def _gather_sides(g: Gathered, options: DoctorOptions) -> None:
    models: list[str] = []
    for label, value, side_name, local in (
        ("prefill-config", options.prefill_config, "prefill", not options.separate_hosts),
        ("decode-config", options.decode_config, "decode", not options.separate_hosts),
        ("kv-transfer-config", options.kv_transfer_config, None, True),
        ("vllm-cmd", options.vllm_cmd, None, True),
    ):
        if value is not None:
            model = _add_side(g, label, value, side_name, local)
            models += [model] if model else []
    if options.model is not None:
        _read_model(g, options.model, explicit=True)
    elif models:
        _read_model(g, models[0], explicit=False)


def _gather_node(g: Gathered, node: NodeConfig | None) -> None:
    if node is not None:
        g.hostname_error = probes.address_is_local(node.local_hostname)
        if node.enable_ssd_offload:
            g.ssd = probes.ssd_facts(node.ssd_offload_path)
        g.timeouts = node.timeouts
        return
    try:
        g.timeouts = parse_timeouts(g.env)
    except ConfigError as exc:
        g.input_errors.append(fail("input.env", str(exc), "fix the variable"))


def _gather_master(g: Gathered, options: DoctorOptions, node: NodeConfig | None) -> None:
    """The master's answers, and its flags: from --master-cmd, else as it reports them."""
    g.master_arg = options.master
    address = options.master or (node.master_address if node else None)
    if address is not None:
        g.master = probes.probe_master(address)
    if options.master_cmd is not None:
        try:
            text = options.master_cmd
            if "\n" not in text and Path(text).is_file():
                text = Path(text).read_text(encoding="utf-8")
            argv = command_argv(text, ("master", "mooncake_master"))
            g.master_config = MasterConfig.from_argv(argv)
        except (ConfigError, ValueError) as exc:
            g.master_config_error = str(exc)
        return
    running = g.master.status.get("config") if g.master and g.master.status else None
    if isinstance(running, Mapping):
        try:
            g.master_config = MasterConfig.from_flags(running)
        except ConfigError as exc:
            g.master_config_error = f"the running master reports {exc}"


def _gather_ports(g: Gathered, options: DoctorOptions) -> None:
    for side in g.sides:
        if side.side not in g.local_sides:
            continue
        ranks = side.own_topology.ranks if side.own_topology else 1
        if side.config.transfer is not None:
            port = side.config.transfer.port("kv_port")
            if isinstance(port, int) and 0 < port < 65536:
                label = f"{side.side} kv_port"
                g.ports.append(_port_facts(label, port, ranks, options.live))
        if side.config.store is not None and side.config.store.is_seed_name:
            # kvpool's store connector takes no TCP port for lookups; the seed's does.
            port = side.config.store.port("lookup_rpc_port")
            if isinstance(port, int) and 0 < port < 65536:
                label = f"{side.side} lookup_rpc_port"
                g.ports.append(_port_facts(label, port, 1, options.live))
    if options.prefill_host is not None:
        prefill = next((s for s in g.sides if s.side == "prefill"), None)
        transfer = prefill.config.transfer if prefill is not None else None
        port = transfer.port("kv_port") if transfer is not None else None
        port = port if isinstance(port, int) else 30000
        g.peer = (options.prefill_host, port, probes.tcp_connect_error(options.prefill_host, port))


def _decode_ranks(sides: Sequence[Side]) -> int | None:
    for side in sides:
        if side.side == "decode" and side.own_topology is not None:
            return side.own_topology.ranks
    for side in sides:
        topology = side.config.transfer.topology("decode") if side.config.transfer else None
        if topology is not None and not isinstance(topology, str):
            return topology.ranks
    return None


def _effective_timeouts(g: Gathered) -> Timeouts | None:
    """The transfer connector's own values when it is configured here (its extra config and
    variables win there), else the node config's / environment's."""
    for side in g.sides:
        node = g.config_file.node if g.config_file else None
        local = side.side in g.local_sides
        settings = transfer_settings(side, g.env, node) if local else None
        if settings is not None:
            return Timeouts(settings.connect_timeout_ms, settings.transfer_timeout_ms)
    return g.timeouts


def diagnose(g: Gathered) -> list[Check]:
    """Every check, in report order, from gathered facts (pure)."""
    checks: list[Check] = list(g.input_errors)
    node = g.config_file.node if g.config_file else None
    if g.config_file is not None:
        checks += check_config_file(g.config_file)
    checks.append(check_local_hostname(node, g.hostname_error))
    checks.append(check_master_address(node, g.master_arg))
    checks += check_master(g.master)
    registered = check_registered(g.master, node) if g.live else None
    checks += [registered] if registered is not None else []
    checks += check_master_flags(g.master_config, g.master_config_error)
    seed_names = any(e.is_seed_name for s in g.sides for e in s.config.entries)
    checks.append(check_hashseed(g.env, seed_connectors=seed_names))
    checks += check_key_agreement(g.key_probe)
    mine = g.key_probe.get("this process")
    if isinstance(mine, list):
        checks.append(check_cross_node(g.cross_node, mine))
    same_host = len(g.local_sides) == len(g.sides)
    checks += connector_checks(g.sides, g.model, same_host=same_host)
    node_error = g.config_file.error if g.config_file else None
    checks += settings_checks(g.sides, g.env, node, node_error)
    checks.append(check_ssd(node, g.ssd, g.master_config))
    timeouts = _effective_timeouts(g)
    if timeouts is not None:
        lease = (g.master_config or MasterConfig()).default_kv_lease_ttl
        rdma = g.env.get("HCCL_RDMA_TIMEOUT", "").strip()
        checks += check_timeouts(
            timeouts,
            lease_ttl_ms=lease,
            decode_ranks=_decode_ranks(g.sides),
            rdma_timeout_exp=int(rdma) if rdma.isdigit() else None,
        )
    checks += check_ports(g.ports, live=g.live)
    if g.peer is not None:
        checks.append(check_peer_reachable(*g.peer))
    return checks


def run_doctor(options: DoctorOptions, env: Mapping[str, str] | None = None) -> list[Check]:
    return diagnose(gather(options, env))


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def _summary(checks: Sequence[Check]) -> dict[str, int]:
    return {s.value.lower(): sum(c.status is s for c in checks) for s in Status}


def format_text(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = []
    for c in checks:
        line = f"{c.status.value:<4}  {c.name:<{width}}  {c.message}"
        lines.append(line + (f" — fix: {c.fix}" if c.fix else ""))
    counts = _summary(checks)
    lines.append(
        f"{counts['fail']} failed, {counts['warn']} warnings, {counts['pass']} passed,"
        f" {counts['skip']} skipped"
    )
    return "\n".join(lines)


def format_json(checks: Sequence[Check]) -> str:
    return json.dumps(
        {
            "ok": exit_code(checks) == 0,
            "summary": _summary(checks),
            "checks": [c.to_dict() for c in checks],
        },
        indent=2,
        ensure_ascii=False,
    )


def run_cli(options: DoctorOptions, *, as_json: bool) -> int:
    """Entry point of ``kvpool doctor``: print the report, return the exit status."""
    checks = run_doctor(options)
    try:
        print(format_json(checks) if as_json else format_text(checks), flush=True)
    except BrokenPipeError:  # `kvpool doctor | head`: the reader left; the status stands
        sys.stderr.close()
    return exit_code(checks)

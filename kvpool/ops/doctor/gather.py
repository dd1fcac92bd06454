"""The edge of ``kvpool doctor``: read every input and probe the outside world into one
:class:`~.facts.Gathered`; an input that cannot be read becomes a failed ``input.*`` check
rather than a traceback.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from kvpool import __version__
from kvpool.config import (
    CONFIG_PATH_VARS,
    MasterConfig,
    NodeConfig,
    config_path_from_env,
    env_lookup,
    parse_timeouts,
)
from kvpool.config.masters import ETCD_SCHEME, parse_masters
from kvpool.config.vllm_versions import installed_vllm_version
from kvpool.errors import ConfigError, KVPoolError
from kvpool.mooncake.ha import leadership_or_none
from kvpool.mooncake.master_flags import parse_master_command
from kvpool.mooncake.settings import MooncakeNodeConfig, load_any_node_config
from kvpool.net import split_address
from kvpool.ops.doctor import probes
from kvpool.ops.doctor.checks import fail
from kvpool.ops.doctor.checks_connector import Side, model_info
from kvpool.ops.doctor.checks_host import PortFacts
from kvpool.ops.doctor.checks_node import ConfigFileFacts
from kvpool.ops.doctor.facts import Gathered
from kvpool.ops.doctor.options import DoctorOptions
from kvpool.ops.kvconfig import (
    KVTransferConfig,
    command_argv,
    parse_kv_transfer_text,
    parse_vllm_command,
)
from kvpool.ops.status import fetch_snapshot, find_leader
from kvpool.security.credentials import Credential
from kvpool.security.secret import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    load_credential,
    operator_headers,
)

__all__ = ["gather", "read_connector_input"]

_MAX_PORTS_PER_RANGE = 64


def _is_file(text: str) -> bool:
    # A pasted command line is no path: its JSON alone can exceed the 255 bytes a file
    # name may have, and is_file() then raises (ENAMETOOLONG) instead of saying False.
    try:
        return Path(text).is_file()
    except OSError:
        return False


def read_connector_input(value: str) -> tuple[KVTransferConfig, object]:
    """A ``--kv-transfer-config`` given as JSON, as a file (JSON or a shell script holding a
    ``vllm serve`` line), or as a vLLM command line.  Returns the config and, when it came
    from a command, the parsed command (its TP/DP and model)."""
    text = value.strip()
    if not text.startswith("{") and "\n" not in text and _is_file(text):
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
    switches = getattr(command, "switches", None)
    side = (
        Side(side_name, config, topology, switches)
        if side_name
        else Side.infer(config, topology, switches)
    )
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


def _node_config(
    gathered: Gathered, options: DoctorOptions
) -> NodeConfig | MooncakeNodeConfig | None:
    """The node config named by --config or the variables, for whichever engine it is
    (a Mooncake mooncake.json is read as one, not refused as a bad kvpool config)."""
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
        node = load_any_node_config(path, env=env)
    except ConfigError as exc:
        gathered.config_file = ConfigFileFacts(source, None, str(exc), env_set, shadowed)
        return None
    if isinstance(node, MooncakeNodeConfig):
        devices = probes.rdma_devices() if node.protocol == "rdma" else None
        gathered.rdma_devices = devices
        gathered.config_file = ConfigFileFacts(
            source, None, None, env_set, shadowed, mooncake=node, rdma_devices=devices
        )
        return node
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
    g.vllm_version = installed_vllm_version()
    _gather_sides(g, options)
    node = _node_config(g, options)
    _gather_node(g, node)
    _gather_master(g, options, node)
    credential = _gather_security(g, node)
    _gather_ports(g, options)
    if options.probe_keys:
        g.key_probe = probes.key_probe()
        if g.master is not None and g.master.health_status == 200:
            host = node.local_hostname if node is not None else socket.gethostname()
            g.cross_node = probes.cross_node_probe(
                g.master.address, host, __version__, credential=credential
            )
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


def _gather_node(g: Gathered, node: NodeConfig | MooncakeNodeConfig | None) -> None:
    if isinstance(node, MooncakeNodeConfig):
        g.hostname_error = probes.address_is_local(node.local_hostname)
    elif node is not None:
        g.hostname_error = probes.address_is_local(node.local_hostname)
        if node.enable_ssd_offload:
            g.ssd = probes.ssd_facts(node.ssd_offload_path)
        g.timeouts = node.timeouts
        return
    try:
        g.timeouts = parse_timeouts(g.env)
    except ConfigError as exc:
        g.input_errors.append(fail("input.env", str(exc), "fix the variable"))


def _gather_master(
    g: Gathered, options: DoctorOptions, node: NodeConfig | MooncakeNodeConfig | None
) -> None:
    """The master's answers, and its flags: from --master-cmd, else as it reports them."""
    g.master_arg = options.master
    address = options.master or (node.master_address if node else None)
    if options.master_cmd is not None:
        # the guide writes `mooncake_master ...` for kvpool's master too: whose it is comes
        # from a flag only Mooncake has, the node config's engine, or what answers there
        mooncake_config = isinstance(node, MooncakeNodeConfig)
        _read_master_cmd(g, options.master_cmd, "mooncake" if mooncake_config else None)
    if address is not None and ("," in address or address.startswith(ETCD_SCHEME)):
        # HA masters: the leader is the one whose answers the checks below read
        spec = address
        try:
            address = find_leader(spec)
            view = fetch_snapshot(address).leadership
            g.leadership = (spec, address, view)
        except KVPoolError as exc:
            address = _mooncake_leader(g, spec, exc)
    if address is not None:
        metrics_port = g.master_config_metrics_port
        ha = g.mooncake_ha
        if ha is not None and ha.facts is not None:
            metrics_port = split_address(ha.facts.metrics_address)[1]
        g.master = probes.probe_master(
            address, metrics_port=metrics_port, headers=operator_headers(g.env)
        )
        found = g.master.mooncake
        if ha is not None and found is not None and found.role != "leader":
            # two masters on one host: 9003 beside the leader's RPC port is another's
            g.master = replace(
                g.master,
                mooncake=None,
                mooncake_rpc=True,
                health_error=f"{found.metrics_address} is a {found.role}'s, not the leader's",
            )
        if g.master.mooncake is not None and g.master_engine == "kvpool":
            _read_master_cmd(g, options.master_cmd or "", "mooncake")
    if options.master_cmd is not None:
        return
    running = g.master.status.get("config") if g.master and g.master.status else None
    if isinstance(running, Mapping):
        try:
            g.master_config = MasterConfig.from_flags(running)
        except ConfigError as exc:
            g.master_config_error = f"the running master reports {exc}"


def _mooncake_leader(g: Gathered, spec: str, kvpool_error: KVPoolError) -> str | None:
    """No kvpool master leads at ``spec``: Mooncake's own HA masters may
    (:mod:`kvpool.mooncake.ha`).  The address the master checks then read (the leader's
    RPC address; a named master, or None, when none leads)."""
    ha, why = leadership_or_none(spec)
    if ha is not None:
        g.mooncake_ha = ha
        return ha.leader
    g.leadership = (spec, "", f"{kvpool_error}; nor do Mooncake's HA masters: {why}")
    try:
        masters = parse_masters(spec, key="--master")
    except ConfigError:  # Mooncake's etcd://a;b spelling
        return None
    return None if masters.etcd else masters.first  # the checks say it is down


def _read_master_cmd(g: Gathered, value: str, engine: str | None) -> None:
    """``--master-cmd`` (a line, or a file holding one) into the master's settings."""
    if not value:
        return
    try:
        text = value
        if "\n" not in text and Path(text).is_file():
            text = Path(text).read_text(encoding="utf-8")
        argv = command_argv(text, ("master", "mooncake_master"))
        command = parse_master_command(argv, engine=engine)
    except (ConfigError, ValueError) as exc:
        g.master_config_error = str(exc)
        return
    g.master_config, g.master_engine = command.config, command.engine
    g.master_config_metrics_port = command.metrics_port


def _gather_security(
    g: Gathered, node: NodeConfig | MooncakeNodeConfig | None
) -> Credential | None:
    """kvpool's credentials on this host: its secret files, and the handshake with the
    master using the one this host's processes would use (Mooncake has none).  Returns
    that credential (None: none, or a broken one)."""
    if isinstance(node, MooncakeNodeConfig) or g.master_engine == "mooncake":
        return None
    if g.master is not None and (g.master.mooncake is not None or g.master.mooncake_rpc):
        return None
    sources: list[tuple[str, str]] = []
    if node is not None and node.secret_file:
        sources.append(("secret_file", node.secret_file))
    if g.env.get(ENV_SECRET_FILE, "").strip():
        sources.append((ENV_SECRET_FILE, g.env[ENV_SECRET_FILE].strip()))
    master = g.master_config
    if master is not None and master.secret_file and _runs_here(master.host):
        sources.append(("--secret_file", master.secret_file))
    seen: set[str] = set()
    for source, path in sources:
        if path not in seen:
            seen.add(path)
            g.secret_files.append(probes.secret_file_facts(source, path))
    g.env_credential = bool(g.env.get(ENV_SECRET_FILE, "").strip() or g.env.get(ENV_SECRET))
    try:
        secret_file = node.secret_file if node is not None else ""
        credential = load_credential(secret_file, g.env, key="secret_file")
    except ConfigError:
        g.has_credential = True  # configured, if broken: the file check is the one to fail
        return None
    g.has_credential = credential is not None
    if g.master is not None and g.master.health_status == 200:
        g.master_auth = probes.master_auth_probe(g.master.address, credential)
    return credential


def _runs_here(host: str) -> bool:
    return host in ("0.0.0.0", "::") or probes.address_is_local(host) is None


def _gather_ports(g: Gathered, options: DoctorOptions) -> None:
    for side in g.sides:
        if side.side not in g.local_sides:
            continue
        ranks = side.own_topology.ranks if side.own_topology else 1
        # only a producer listens on kv_port (D pulls from P's and opens none of its own)
        transfer = side.config.transfer
        if transfer is not None and transfer.role in ("kv_producer", "kv_both"):
            port = transfer.port("kv_port")
            if isinstance(port, int) and 0 < port < 65536:
                label = f"{side.side} kv_port"
                g.ports.append(_port_facts(label, port, ranks, options.live))
        if side.config.store is not None and side.config.store.is_guide_name:
            # kvpool's store connector takes no TCP port for lookups; AscendStoreConnector does.
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

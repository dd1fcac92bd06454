"""``kvpool up``: the plan of the whole P/D stack on one machine, as plain data.

:func:`make_plan` is pure: options in; commands, environments, ports, health URLs and files
out.  Nothing here starts a process, touches the disk or reads the clock.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.mooncake import up as mooncake
from kvpool.ops.up.instances import cpu_sets, kv_transfer_config, rank_binds
from kvpool.ops.up.options import HA_PORTS, PORT_FLAGS, UpOptions
from kvpool.proxy.auth import ENV_API_KEY, ENV_API_KEY_FILE

__all__ = [
    "CHAT_TEMPLATE",
    "TINY_MODEL_NAME",
    "PortUse",
    "ProcessSpec",
    "UpPlan",
    "cpu_sets",
    "instance_kv_port",
    "kv_transfer_config",
    "make_plan",
    "planned_ports",
    "ready_text",
]

TINY_MODEL_NAME = "tiny-llama"
# The locally built model has a tokenizer but no chat template; chat completions need one.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the stack: how to start it and how to know it is up."""

    name: str  # "master", "prefill-0", "decode-1", "proxy"
    role: str  # "master" | "prefill" | "decode" | "proxy"
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the inherited environment
    health_url: str
    url: str
    log_path: Path
    stage: int  # 0 master, 1 vLLM instances (started together), 2 proxy
    # the Python that runs the supervisor's launcher before exec; None: argv[0] is one
    launcher: str | None = None


@dataclass(frozen=True)
class UpPlan:
    options: UpOptions
    model_dir: Path
    build_model: bool  # build the tiny model into model_dir first
    model_name: str  # what requests say in "model"
    node_config_path: Path
    files: Mapping[Path, str]  # written before anything starts
    dirs: tuple[Path, ...]  # created before anything starts
    processes: tuple[ProcessSpec, ...] = field(default_factory=tuple)

    @property
    def stages(self) -> list[list[ProcessSpec]]:
        out: dict[int, list[ProcessSpec]] = {}
        for spec in self.processes:
            out.setdefault(spec.stage, []).append(spec)
        return [out[k] for k in sorted(out)]

    def by_role(self, role: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == role]

    @property
    def master_url(self) -> str:
        return self.by_role("master")[0].url

    @property
    def proxy_url(self) -> str | None:
        proxies = self.by_role("proxy")
        return proxies[0].url if proxies else None


@dataclass(frozen=True)
class PortUse:
    """One port the stack listens on, and the flag that chose it."""

    port: int
    flag: str  # "--decode-kv-port"
    instance: int | None = None  # which vLLM instance (the flag's port + instance)

    @property
    def owner(self) -> str:
        return self.flag if self.instance is None else f"{self.flag} (instance {self.instance})"


def instance_kv_port(opts: UpOptions, role: str, index: int) -> int:
    """Instance ``index``'s ``kv_port``: its ranks listen on ``kv_port + dp_rank * tp_size +
    tp_rank`` (the transfer connector's rule), so instances are spaced by their rank count."""
    base = opts.prefill_kv_port if role == "prefill" else opts.decode_kv_port
    return base + index * opts.layout(role).ranks


def planned_ports(opts: UpOptions) -> list[PortUse]:
    """Every port the stack will listen on, in start order (the master's first)."""
    uses = [PortUse(opts.master_port, "--master-port")]
    if opts.ha:
        uses.append(PortUse(opts.standby_port, "--standby-port"))
        uses.append(PortUse(opts.etcd_port, "--etcd-port"))
        uses.append(PortUse(opts.etcd_port + 1, "--etcd-port (its peer port)"))
    if opts.engine == "mooncake":
        uses.append(PortUse(opts.metrics_port, "--metrics-port"))
    if opts.no_vllm:
        return uses
    uses.append(PortUse(opts.proxy_port, "--proxy-port"))
    for role, http, n in (
        ("prefill", opts.prefill_port, opts.prefill_instances),
        ("decode", opts.decode_port, opts.decode_instances),
    ):
        for i in range(n):
            uses.append(PortUse(http + i, f"--{role}-port", i))
            first = instance_kv_port(opts, role, i)
            for rank in range(opts.layout(role).ranks):
                uses.append(PortUse(first + rank, f"--{role}-kv-port", i))
    return uses


def _check_port_clashes(opts: UpOptions) -> None:
    for name, flag, _ in PORT_FLAGS:
        if name == "metrics_port" and opts.engine != "mooncake":
            continue
        if name in HA_PORTS and not opts.ha:
            continue
        if getattr(opts, name) == 0:  # the edge resolves 0 (any free port) before planning
            raise ConfigError(f"{flag}: 0 is not a TCP port (1..65535)")
    owners: dict[int, str] = {}
    for use in planned_ports(opts):
        if use.port in owners:
            raise ConfigError(
                f"{use.owner} and {owners[use.port]} both use port {use.port}; move one"
            )
        owners[use.port] = use.owner


# What ``kvpool up`` starts, in order (the production guide's §3.2 Compose file and §5 commands, on
# host):
#
# 1. ``kvpool master`` with its own memory segment and an SSD tier under the state
#    directory (``--enable_offload=true``); with ``--engine mooncake`` the wheel's
#    ``mooncake_master`` instead (:mod:`kvpool.mooncake.up`);
# 2. the prefill and decode vLLM instances (``python -m vllm.entrypoints.openai.api_server``,
#    started together), each with vLLM's MultiConnector holding kvpool's transfer connector
#    and store connector, ``kv_load_failure_policy: recompute`` at the top level (the
#    production guide's §5.2/§5.3 JSON), the master found through ``KVPOOL_CONFIG_PATH``;
# 3. ``kvpool proxy`` in front of them.
def make_plan(opts: UpOptions) -> UpPlan:
    """The whole stack as data (pure)."""
    _check_port_clashes(opts)
    state = opts.state_dir
    logs = state / "logs"
    ssd = state / "ssd"
    node_config_path = state / "mooncake.json"
    build_model = opts.model is None and not opts.no_vllm
    model_dir = state / "model" / TINY_MODEL_NAME if opts.model is None else opts.model
    model_name = opts.served_model_name or (TINY_MODEL_NAME if build_model else model_dir.name)
    files: dict[Path, str] = {node_config_path: ""}
    if opts.engine == "mooncake":
        files[node_config_path] = json.dumps(mooncake.node_config(opts), indent=2) + "\n"
        master = _mooncake_master_spec(opts, logs)
    else:
        master = _kvpool_master_spec(opts, logs, ssd)
        # the production guide's §4 mooncake.json, for this host; the connectors read it
        files[node_config_path] = (
            json.dumps(
                {
                    "local_hostname": opts.host,
                    "metadata_server": masters_address(opts),
                    "protocol": "tcp",
                    **_node_keys(opts, ssd),
                },
                indent=2,
            )
            + "\n"
        )
    processes = _ha_specs(opts, logs, node_config_path) if opts.ha else [master]
    if not opts.no_vllm:
        chat_template = state / "chat_template.jinja" if build_model else None
        if chat_template is not None:
            files[chat_template] = CHAT_TEMPLATE
        instances = [("prefill", i) for i in range(opts.prefill_instances)] + [
            ("decode", i) for i in range(opts.decode_instances)
        ]
        cores = rank_binds(
            opts.cpus,
            [opts.layout(role).ranks for role, _ in instances],
            dedicated=opts.prefill_instances,
        )
        for (role, i), core in zip(instances, cores, strict=True):
            processes.append(
                _vllm_spec(opts, role, i, core, model_dir, model_name, chat_template, logs)
            )
        processes.append(_proxy_spec(opts, processes, logs))
    return UpPlan(
        options=opts,
        model_dir=model_dir,
        build_model=build_model,
        model_name=model_name,
        node_config_path=node_config_path,
        files=files,
        dirs=(state, logs) if opts.engine == "mooncake" else (state, logs, ssd),
        processes=tuple(processes),
    )


def masters_address(opts: UpOptions) -> str:
    """What clients and nodes dial: the master, or with ``--ha`` both masters."""
    if opts.ha:
        return f"{opts.host}:{opts.master_port},{opts.host}:{opts.standby_port}"
    return f"{opts.host}:{opts.master_port}"


def _node_keys(opts: UpOptions, ssd: Path) -> dict[str, object]:
    """With ``--ha`` the pool's memory and SSD tier are a node's (the masters hold none,
    so a failover loses nothing); the node reads the same mooncake.json."""
    if not opts.ha:
        return {}
    return {
        "global_segment_size": str(opts.segment_size),
        "enable_ssd_offload": True,
        "ssd_offload_path": str(ssd),
        "ssd_offload_limit": str(opts.ssd_limit),
    }


def _http_spec(
    name: str,
    role: str,
    argv: Sequence[str],
    url: str,
    logs: Path,
    stage: int,
    *,
    env: Mapping[str, str] | None = None,
    launcher: str | None = None,
) -> ProcessSpec:
    """A process that serves HTTP at ``url``, up once ``url/health`` answers, logging to
    ``logs/<name>.log``; ``env`` None: only unbuffered Python output."""
    return ProcessSpec(
        name=name,
        role=role,
        argv=tuple(argv),
        env={"PYTHONUNBUFFERED": "1"} if env is None else env,
        health_url=url + "/health",
        url=url,
        log_path=logs / f"{name}.log",
        stage=stage,
        launcher=launcher,
    )


# --ha: etcd (stage -2), two masters campaigning on it (-1), a node with the pool's
# memory (0, once a master leads: its health URL is the first master's), then vLLM
def _ha_specs(opts: UpOptions, logs: Path, node_config: Path) -> list[ProcessSpec]:
    etcd_url = f"http://{opts.host}:{opts.etcd_port}"
    peer_url = f"http://{opts.host}:{opts.etcd_port + 1}"
    etcd_argv = (
        "etcd", "--name", "kvpool-up", "--data-dir", str(opts.state_dir / "etcd"),
        "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"kvpool-up={peer_url}",
    )  # fmt: skip
    etcd = _http_spec("etcd", "etcd", etcd_argv, etcd_url, logs, -2, env={}, launcher=opts.python)
    masters = []
    for name, port in (("master", opts.master_port), ("master-b", opts.standby_port)):
        argv = (
            opts.python, "-m", "kvpool", "master", "--host", opts.host,
            "--port", str(port), "--segment_size", "0", "--client_ttl=120",
            "--default_kv_lease_ttl", "11000", "--enable_offload=true",
            "--enable_ha", "--etcd_endpoints", f"{opts.host}:{opts.etcd_port}",
        )  # fmt: skip
        masters.append(_http_spec(name, "master", argv, f"http://{opts.host}:{port}", logs, -1))
    node = ProcessSpec(
        name="node",
        role="node",
        argv=(opts.python, "-m", "kvpool", "node", "--data-port", "0"),
        env={"PYTHONUNBUFFERED": "1", "KVPOOL_CONFIG_PATH": str(node_config)},
        health_url=masters[0].health_url,
        url="",
        log_path=logs / "node.log",
        stage=0,
    )
    return [etcd, *masters, node]


def _kvpool_master_spec(opts: UpOptions, logs: Path, ssd: Path) -> ProcessSpec:
    argv = (
        opts.python, "-m", "kvpool", "master",
        "--host", opts.host, "--port", str(opts.master_port),
        "--eviction_high_watermark_ratio", "0.9", "--eviction_ratio", "0.1",
        "--default_kv_lease_ttl", "11000",
        "--enable_offload=true", "--client_ttl=120",
        "--segment_size", str(opts.segment_size),
        "--ssd_offload_path", str(ssd), "--ssd_offload_limit", str(opts.ssd_limit),
    )  # fmt: skip
    return _http_spec("master", "master", argv, f"http://{opts.host}:{opts.master_port}", logs, 0)


def _mooncake_master_spec(opts: UpOptions, logs: Path) -> ProcessSpec:
    """mooncake_master answers HTTP only on its metrics port: that is its URL here."""
    metrics = f"http://{opts.host}:{opts.metrics_port}"
    argv = mooncake.master_argv(opts)
    return _http_spec("master", "master", argv, metrics, logs, 0, env={}, launcher=opts.python)


def _vllm_spec(
    opts: UpOptions,
    role: str,
    index: int,
    core: str,
    model_dir: Path,
    model_name: str,
    chat_template: Path | None,
    logs: Path,
) -> ProcessSpec:
    port = (opts.prefill_port if role == "prefill" else opts.decode_port) + index
    kv_port = instance_kv_port(opts, role, index)
    kv_config = kv_transfer_config(
        role, kv_port, opts.host, prefill=opts.prefill_layout, decode=opts.decode_layout
    )
    layout = opts.layout(role)
    dtype = opts.dtype or ("float32" if opts.model is None else "auto")
    argv = [
        opts.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", model_name,
        "--host", opts.host, "--port", str(port),
        "--dtype", dtype, "--enforce-eager",
        "--max-model-len", str(opts.max_model_len),
        "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
        "--seed", "0", "--disable-uvicorn-access-log",
        # always written, so that `kvpool doctor` reading the command knows the layout
        "--tensor-parallel-size", str(layout.tp_size),
        "--data-parallel-size", str(layout.dp_size),
        "--kv-transfer-config", json.dumps(kv_config),
    ]  # fmt: skip
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    if role == "prefill":
        # kv_aware routing: the proxy reads what each prefill's cache holds from its KV
        # events, and what it hit from its replies
        endpoint, replay = kv_events_endpoints(opts, role, index)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
        }
        argv += ["--kv-events-config", json.dumps(events), "--enable-prompt-tokens-details"]
    argv += opts.vllm_args
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": core,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        # the production guide's §5.1: where the master is (kvpool's own name for the variable)
        "KVPOOL_CONFIG_PATH": str(opts.state_dir / "mooncake.json"),
        **(
            {"MOONCAKE_CONFIG_PATH": str(opts.state_dir / "mooncake.json")}
            if opts.engine == "mooncake"
            else {}
        ),
        "KVPOOL_CONNECT_TIMEOUT_MS": str(opts.connect_timeout_ms),
        "KVPOOL_TRANSFER_TIMEOUT_MS": str(opts.transfer_timeout_ms),
        # the production guide asks for it; kvpool's keys do not need it, and it is harmless
        "PYTHONHASHSEED": "0",
    }
    return _http_spec(f"{role}-{index}", role, argv, f"http://{opts.host}:{port}", logs, 1, env=env)


def kv_events_endpoints(opts: UpOptions, role: str, index: int) -> tuple[str, str]:
    """Where a prefill instance publishes its KV events, and its replay socket: Unix
    sockets in the state directory (nothing listens on a port)."""
    base = opts.state_dir.resolve() / "kv-events"
    return f"ipc://{base}-{role}-{index}", f"ipc://{base}-{role}-{index}-replay"


def _proxy_spec(opts: UpOptions, processes: Sequence[ProcessSpec], logs: Path) -> ProcessSpec:
    prefill = [p.url for p in processes if p.role == "prefill"]
    decode = [p.url for p in processes if p.role == "decode"]
    url = f"http://{opts.host}:{opts.proxy_port}"
    events = []
    for index, prefill_url in enumerate(prefill):
        endpoint, replay = kv_events_endpoints(opts, "prefill", index)
        events += ["--kv-events", f"{prefill_url}={endpoint},{replay}"]
    argv = (
        opts.python, "-m", "kvpool", "proxy",
        "--host", opts.host, "--port", str(opts.proxy_port),
        "--prefill", *prefill, "--decode", *decode,
        "--policy", opts.policy, "--health-interval", "1", *events,
    )  # fmt: skip
    return _http_spec("proxy", "proxy", argv, url, logs, 2)


def _curl_json(url: str, body: Mapping[str, Any], auth: str, *, stream: bool = False) -> str:
    flags = "-sN" if stream else "-s"
    payload = shlex.quote(json.dumps(body))
    return f"curl {flags} {url}{auth} -H 'Content-Type: application/json' -d {payload}"


def _auth_header(env: Mapping[str, str]) -> str:
    """The proxy's key as the pasted curl finds it, where the proxy inherits one from the
    environment (its first key, as the proxy reads the file); never the key itself."""
    if env.get(ENV_API_KEY_FILE):
        path = shlex.quote(env[ENV_API_KEY_FILE])
        first = f"$(grep -m1 -Ev '^[[:space:]]*(#|$)' {path} | tr -d '[:space:]')"
        return f' -H "Authorization: Bearer {first}"'
    if env.get(ENV_API_KEY):
        return f' -H "Authorization: Bearer ${ENV_API_KEY}"'
    return ""


def ready_text(plan: UpPlan, env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, text) lines printed once the stack is healthy: endpoints, then commands
    to paste.  Commands are single lines so a terminal copy keeps them whole; ``env``
    is the one the proxy inherits (its API key)."""
    opts = plan.options
    auth = _auth_header(env or {})
    if opts.engine == "mooncake":
        lines: list[tuple[str, str]] = [
            (
                "master",
                f"mooncake_master, RPC {opts.host}:{opts.master_port};"
                f" {plan.master_url}/metrics /health",
            )
        ]
    elif opts.ha:
        lines = [
            (spec.name, f"{spec.url}  (RPC + /metrics /health; HA, one leads)")
            for spec in plan.by_role("master")
        ]
        lines.append(("etcd", f"{opts.host}:{opts.etcd_port}"))
        lines.append(("leader", f"kvpool status --master {masters_address(opts)}"))
        lines.append(("failover", "kill the leader (kvpool status names it): the other leads"))
    else:
        lines = [("master", f"{plan.master_url}  (RPC + /metrics /health)")]
    for spec in plan.processes:
        if spec.role in ("prefill", "decode"):
            lines.append((spec.name, spec.url))
    if plan.proxy_url:
        lines.append(("proxy", f"{plan.proxy_url}  (OpenAI API: /v1/completions, ...)"))
    lines.append(("state", str(opts.state_dir)))
    lines.append(("logs", str(opts.state_dir / "logs")))
    lines.append(("node config", f"export KVPOOL_CONFIG_PATH={plan.node_config_path}"))
    if opts.engine == "mooncake":
        lines.append(("metrics", mooncake.metrics_grep(plan.master_url)))
    else:
        grep = 'grep -E "kv_cache|connected"'
        lines.append(("metrics", f"curl -s {plan.master_url}/metrics | {grep}"))
    if plan.proxy_url:
        completion = {
            "model": plan.model_name,
            "prompt": "the pool keeps cache blocks for every prefix",
            "max_tokens": 16,
            "temperature": 0,
        }
        chat = {
            "model": plan.model_name,
            "messages": [{"role": "user", "content": "what does the pool keep?"}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
        }
        url = plan.proxy_url
        lines.append(("completion", _curl_json(url + "/v1/completions", completion, auth)))
        chat_curl = _curl_json(url + "/v1/chat/completions", chat, auth, stream=True)
        lines.append(("streamed chat", chat_curl))
    return lines

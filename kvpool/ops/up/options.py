"""What ``kvpool up`` was asked for: :class:`UpOptions`, and how the command's flags become
one (:func:`options_from_args`).  Pure: the environment and the usable cores come in as
values."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvpool.config import Topology, parse_size
from kvpool.errors import ConfigError
from kvpool.net import DEFAULT_MASTER_PORT

__all__ = [
    "ENGINES",
    "PORT_FLAGS",
    "UpOptions",
    "default_state_dir",
    "options_from_args",
    "port_default",
]

_MiB = 1 << 20

#: the pool engines ``kvpool up`` runs: kvpool's own master, or the wheel's mooncake_master
ENGINES = ("kvpool", "mooncake")

_KV_PORT_HELP = (
    "first {role} instance's kv_port; its ranks take the next ports (dp x tp in all), and"
    " each further instance starts after the ranks of the one before"
)

# (field, flag, what listens there): every port ``kvpool up`` takes; 0 means any free port.
PORT_FLAGS = (
    ("master_port", "--master-port", "the master's RPC port (kvpool's: RPC + HTTP)"),
    (
        "metrics_port",
        "--metrics-port",
        "mooncake_master's metrics + /health port (--engine mooncake)",
    ),
    ("proxy_port", "--proxy-port", "the proxy's port"),
    ("prefill_port", "--prefill-port", "first prefill instance's HTTP port (+1 per instance)"),
    ("decode_port", "--decode-port", "first decode instance's HTTP port (+1 per instance)"),
    # an instance's ranks listen on kv_port + rank, so the next instance starts after them
    ("prefill_kv_port", "--prefill-kv-port", _KV_PORT_HELP.format(role="prefill")),
    ("decode_kv_port", "--decode-kv-port", _KV_PORT_HELP.format(role="decode")),
    ("standby_port", "--standby-port", "with --ha: the second master's port (RPC + HTTP)"),
    ("etcd_port", "--etcd-port", "with --ha: etcd's client port (its peer port is the next)"),
)
#: the ports only --ha uses
HA_PORTS = ("standby_port", "etcd_port")


@dataclass(frozen=True)
class UpOptions:
    """Everything ``kvpool up`` takes.  A port of ``0`` asks for any free port: the edge
    (:func:`kvpool.ops.up.lifecycle.resolve_ports`) picks one before planning."""

    state_dir: Path
    engine: str = "kvpool"  # "mooncake": the wheel's mooncake_master and Mooncake Store
    mooncake_master: str = "mooncake_master"  # the binary; the edge finds the wheel's
    model: Path | None = None  # None: the locally built tiny model under state_dir
    no_vllm: bool = False
    # two masters electing their leader on a local etcd, the pool's memory on a node
    ha: bool = False
    host: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT  # the guide's 50088, on either engine
    standby_port: int = DEFAULT_MASTER_PORT + 1
    etcd_port: int = 2379  # etcd's own default; its peer port is etcd_port + 1
    metrics_port: int = 9003  # mooncake_master's --metrics_port (the guide's 9003)
    proxy_port: int = 8000
    prefill_port: int = 8100  # instance i listens on prefill_port + i
    decode_port: int = 8200
    prefill_kv_port: int = 30000  # the production guide's kv_port values; see _KV_PORT_HELP
    decode_kv_port: int = 30100
    prefill_instances: int = 1
    decode_instances: int = 1
    # each instance's own layout (vLLM -tp/-dp); each side's --kv-transfer-config gets the
    # peer's (the guide's §5.4), and an instance's ranks listen on kv_port + rank
    prefill_tp: int = 1
    prefill_dp: int = 1
    decode_tp: int = 1
    decode_dp: int = 1
    # kvpool: the master's own memory segment; mooncake: each vLLM instance's
    # global_segment_size (Mooncake's master holds no memory)
    segment_size: int = 256 * _MiB
    local_buffer_size: int = 64 * _MiB  # mooncake: each instance's registered staging area
    ssd_limit: int = 1024 * _MiB  # cap of the SSD tier under state_dir/ssd
    kv_cache_bytes: int = 64 * _MiB  # per vLLM instance
    max_model_len: int = 2048
    dtype: str | None = None  # None: float32 for the tiny model, vLLM's "auto" otherwise
    served_model_name: str | None = None
    policy: str = "kv_aware"
    cpus: tuple[int, ...] = (0,)  # cores to share among the vLLM instances
    connect_timeout_ms: int = 2000  # one host: a dead prefill should cost seconds
    transfer_timeout_ms: int = 10000
    vllm_args: tuple[str, ...] = ()  # appended to every vLLM command line
    python: str = "python3"
    start_timeout_s: float = 300.0  # every stage must be healthy within this
    stop_timeout_s: float = 20.0  # SIGTERM grace before SIGKILL

    @property
    def prefill_layout(self) -> Topology:
        return Topology(dp_size=self.prefill_dp, tp_size=self.prefill_tp)

    @property
    def decode_layout(self) -> Topology:
        return Topology(dp_size=self.decode_dp, tp_size=self.decode_tp)

    def layout(self, role: str) -> Topology:
        """``role``'s own layout (``"prefill"`` or ``"decode"``)."""
        return self.prefill_layout if role == "prefill" else self.decode_layout

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(
                f"--engine: {self.engine!r} is not a pool engine; use kvpool or mooncake"
            )
        for name, flag, _ in PORT_FLAGS:
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag}: {port} is not a TCP port (1..65535)")
        for flag, count in (
            ("--prefill-instances", self.prefill_instances),
            ("--decode-instances", self.decode_instances),
        ):
            if not 1 <= count <= 16:
                raise ConfigError(f"{flag}: must be 1..16, got {count}")
        for flag, size in (
            ("--prefill-tp", self.prefill_tp),
            ("--prefill-dp", self.prefill_dp),
            ("--decode-tp", self.decode_tp),
            ("--decode-dp", self.decode_dp),
        ):
            if not 1 <= size <= 64:
                raise ConfigError(f"{flag}: must be 1..64, got {size}")
        if self.ha and self.engine == "mooncake":
            raise ConfigError(
                "--ha: runs kvpool's own masters on etcd; Mooncake's HA master is started "
                "by hand (docs/ha.md), not by kvpool up --engine mooncake"
            )
        if self.segment_size <= 0:
            raise ConfigError("--segment-size: must be a positive size, e.g. 256MiB")
        if self.engine == "mooncake" and self.segment_size < 16 * _MiB:
            raise ConfigError(
                "--segment-size: Mooncake refuses a segment under 16MiB; give e.g. 64MiB"
            )
        if self.ssd_limit <= 0:
            raise ConfigError("--ssd-limit: must be a positive size, e.g. 1GiB")
        if self.kv_cache_bytes < 4 * _MiB:
            raise ConfigError("--kv-cache-bytes: at least 4MiB per instance, e.g. 64MiB")
        if self.max_model_len < 16:
            raise ConfigError(f"--max-model-len: must be at least 16, got {self.max_model_len}")
        if not self.cpus or any(c < 0 for c in self.cpus):
            raise ConfigError(f"--cpus: expected core numbers, got {list(self.cpus)}")
        if self.connect_timeout_ms <= 0 or self.transfer_timeout_ms <= 0:
            raise ConfigError("timeouts: must be positive milliseconds")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("--start-timeout/--stop-timeout: must be positive seconds")


def port_default(name: str) -> int:
    """The default of the port field ``name`` (the flags show it in their help)."""
    default = next(f.default for f in fields(UpOptions) if f.name == name)
    assert isinstance(default, int)
    return default


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$KVPOOL_STATE_DIR``, else ``$XDG_STATE_HOME/kvpool/up``, else ``./.kvpool-state``."""
    if env.get("KVPOOL_STATE_DIR"):
        return Path(env["KVPOOL_STATE_DIR"])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "kvpool" / "up"
    return Path(".kvpool-state")


def _parse_cpus(text: str) -> tuple[int, ...]:
    """``0,1`` or ``0-3`` or ``0-1,4``."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            cores += range(int(lo), int(hi) + 1) if dash else [int(lo)]
    except ValueError:
        raise ConfigError(f"--cpus: expected core numbers like 0,1 or 0-3, got {text!r}") from None
    return tuple(cores)


def options_from_args(
    args: Any, env: Mapping[str, str], usable_cpus: tuple[int, ...], python: str
) -> UpOptions:
    """``kvpool up``'s parsed flags → options; a port flag of 0 stays 0 (any free port)."""
    try:
        vllm_args = tuple(shlex.split(args.vllm_args or ""))
    except ValueError as exc:
        raise ConfigError(f"--vllm-args: {exc}") from None
    return UpOptions(
        # absolute, so the printed paths (KVPOOL_CONFIG_PATH=...) work from any directory
        engine=args.engine,
        state_dir=(Path(args.state_dir) if args.state_dir else default_state_dir(env)).absolute(),
        model=Path(args.model).expanduser().absolute() if args.model else None,
        no_vllm=args.no_vllm,
        ha=args.ha,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        prefill_tp=args.prefill_tp,
        prefill_dp=args.prefill_dp,
        decode_tp=args.decode_tp,
        decode_dp=args.decode_dp,
        segment_size=parse_size(args.segment_size, key="--segment-size"),
        ssd_limit=parse_size(args.ssd_limit, key="--ssd-limit"),
        kv_cache_bytes=parse_size(args.kv_cache_bytes, key="--kv-cache-bytes"),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        policy=args.policy,
        cpus=_parse_cpus(args.cpus) if args.cpus else usable_cpus,
        vllm_args=vllm_args,
        python=python,
        start_timeout_s=args.start_timeout,
        stop_timeout_s=args.stop_timeout,
        **{name: getattr(args, name) for name, _, _ in PORT_FLAGS},
    )

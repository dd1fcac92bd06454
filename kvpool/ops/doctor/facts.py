"""Every fact doctor's checks need, read from the outside world by :mod:`.gather` and
turned into checks by :mod:`.diagnose` (plain values: the tests build them by hand)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.config import MasterConfig, Timeouts
from kvpool.mooncake.ha import MooncakeHA
from kvpool.ops.doctor.checks import Check
from kvpool.ops.doctor.checks_connector import ModelInfo, Side
from kvpool.ops.doctor.checks_host import PortFacts, SsdFacts
from kvpool.ops.doctor.checks_node import ConfigFileFacts, MasterFacts
from kvpool.ops.doctor.checks_security import MasterAuthFacts, SecretFileFacts

__all__ = ["Gathered"]


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
    #: HA masters (a list, or etcd://): the spec, the leader found ("" none) and what it
    #: said of itself (role, epoch, standbys) or why none was found
    leadership: tuple[str, str, Mapping[str, object] | str] | None = None
    #: Mooncake's own HA masters lead instead (kvpool.mooncake.ha): who leads there
    mooncake_ha: MooncakeHA | None = None
    master_config: MasterConfig | None = None
    master_config_error: str | None = None
    #: whose master --master-cmd starts ("kvpool" / "mooncake"); None without one
    master_engine: str | None = None
    #: mooncake_master's --metrics_port from --master-cmd, where doctor looks first
    master_config_metrics_port: int | None = None
    #: the listing of /sys/class/infiniband (None: no such directory)
    rdma_devices: tuple[str, ...] | None = None
    timeouts: Timeouts | None = None
    ssd: SsdFacts | None = None
    ports: list[PortFacts] = field(default_factory=list)
    live: bool = False
    peer: tuple[str, int, str | None] | None = None
    key_probe: Mapping[str, Sequence[str] | str] = field(default_factory=dict)
    cross_node: tuple[Mapping[str, object] | None, bool, str | None] | None = None
    #: every secret file a process here would read (kvpool's engine)
    secret_files: list[SecretFileFacts] = field(default_factory=list)
    #: this host's processes hold a credential (node config or environment)
    has_credential: bool = False
    #: the environment alone holds one (KVPOOL_SECRET_FILE / KVPOOL_SECRET)
    env_credential: bool = False
    master_auth: MasterAuthFacts | None = None
    #: the installed vLLM's version (None: no vLLM on this host)
    vllm_version: str | None = None

"""What ``kvpool doctor`` was asked to look at: the operator's flags, as typed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DoctorOptions"]


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
    as_json: bool = False  # the report as JSON instead of one line per check

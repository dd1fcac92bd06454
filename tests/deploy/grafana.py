"""deploy/grafana/kvpool.json as data: its panels and the PromQL of each, for the tests
that hold it to a real master and a real Prometheus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpool.json"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def exprs() -> list[tuple[str, str]]:
    """(panel title, query) for every query of every panel, rows' panels included."""
    return [
        (panel["title"], target["expr"])
        for panel in all_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]

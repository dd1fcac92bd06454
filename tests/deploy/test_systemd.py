"""deploy/systemd: each unit passes ``systemd-analyze verify`` and starts a script that
``kvpool config render`` writes, where the rendered files say they live."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvpool.ops.render import parse_inventory, render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
INVENTORY = DEPLOY.parent / "examples" / "inventory.toml"


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    assert shutil.which("systemd-analyze"), "scripts/setup.sh installs systemd"
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_the_unit_verifies(unit: Path) -> None:
    done = verify(unit)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_each_unit_starts_a_rendered_script() -> None:
    inv = parse_inventory(tomllib.loads(INVENTORY.read_text()))
    files = render(inv)
    scripts = {"kvpool-master.service": "p0/master.sh", "kvpool-node.service": "p0/node.sh",
               "kvpool-proxy.service": "proxy.sh"}  # fmt: skip
    assert {u.name for u in UNITS} == set(scripts)
    for unit in UNITS:
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(unit)
        shell, path = parser["Service"]["ExecStart"].split()
        rendered = scripts[unit.name]
        assert shell == "/bin/sh" and rendered in files
        assert path == f"{inv.config_dir}/{Path(rendered).name}", unit.name


def test_a_broken_unit_fails_verification(tmp_path: Path) -> None:
    broken = tmp_path / "kvpool-broken.service"
    text = (DEPLOY / "systemd" / "kvpool-master.service").read_text()
    broken.write_text(text.replace("ExecStart=/bin/sh ", "ExecStart=/no/such/sh "))
    assert verify(broken).returncode != 0
    typo = tmp_path / "kvpool-typo.service"
    typo.write_text(text.replace("Restart=on-failure", "Restart=sometimes"))
    assert "restart specifier" in verify(typo).stderr  # what test_the_unit_verifies rejects

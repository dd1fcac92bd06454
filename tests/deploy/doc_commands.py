"""Commands and configs as the docs write them, made runnable on this machine: the deploy
tests' helpers.

A doc's fenced block is read from the doc itself, so an edit that breaks what an operator
would paste fails a test.  What the tests change is only what differs between the doc's
cluster and this one: the master's address, the secret's file, a token file's path, and
the user a token file is handed to.  ``kvpool`` in a command is this interpreter's
kvpool (:func:`kvpool_on_path`), so the code under test is what runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
# the master's address as the docs write it: <MASTER_IP>:50088, <p0>:50088, 10.0.0.1:50088
_MASTER = re.compile(r"(?:<\w+>|\d+\.\d+\.\d+\.\d+):50088")
_SECRET_FILE = re.compile(r"--secret[-_]file[ =](\S+?)(?=[)\s]|$)")


def fenced_blocks(path: Path, lang: str | None = None) -> list[str]:
    """The bodies of ``path``'s fenced code blocks (those of language ``lang`` when
    given), with shell line continuations joined."""
    text = path.read_text(encoding="utf-8")
    return [
        m["body"].replace("\\\n", " ")
        for m in _FENCE.finditer(text)
        if lang is None or m["lang"] == lang
    ]


def shell_lines(path: Path) -> list[str]:
    """Every command line an operator could paste from ``path``: the lines of a
    Markdown file's fenced blocks, or a YAML file's comment lines (``#`` stripped)."""
    if path.suffix == ".md":
        return [line.strip() for body in fenced_blocks(path) for line in body.splitlines()]
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if "#" in line]


def for_this_master(command: str, address: str, secret: Path) -> str:
    """``command`` aimed at the master at ``address`` with the secret in ``secret``."""
    command = _MASTER.sub(address, command)
    return _SECRET_FILE.sub(f"--secret-file {secret}", command)


def kvpool_on_path(directory: Path) -> dict[str, str]:
    """An environment in which ``kvpool`` is ``python -m kvpool`` of this interpreter
    (a script in ``directory``), for running a doc's command as written."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "kvpool"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvpool "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{directory}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("KVPOOL_SECRET_FILE", None)  # the command names its secret itself
    env.pop("KVPOOL_SECRET", None)
    return env


def bash(
    command: str, env: dict[str, str], timeout_s: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as the docs' reader would: ``bash -c``, failing on a failed step."""
    return subprocess.run(
        ["bash", "-c", f"set -eo pipefail\n{command}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )

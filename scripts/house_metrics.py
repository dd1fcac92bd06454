"""How the house reads: the numbers docs/architecture.md keeps before and after a cut.

- the kvpool source files whose code runs while one ``Client.put`` and one ``Client.get``
  run against a master (client and master side, TCP and shared memory);
- the module docstrings' lines, and how many modules open with 20 lines or more;
- the largest modules, and the largest classes by method count;
- the duplicate pairs the ``duplicates`` command finds in kvpool/ and in the whole tree
  (tests and benches included), where it is installed.

Usage: .venv/bin/python scripts/house_metrics.py [--markdown]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpool"


def docstring_lines() -> tuple[int, int, int]:
    """(total module-docstring lines, modules opening with >= 20 lines, modules)."""
    total = long = count = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        count += 1
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        n = len(doc.splitlines()) if doc else 0
        total += n
        long += n >= 20
    return total, long, count


def largest(n: int = 5) -> list[tuple[int, str]]:
    sizes = [
        (len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in PACKAGE.rglob("*.py")
    ]
    return sorted(sizes, reverse=True)[:n]


def largest_classes(n: int = 5) -> list[tuple[int, str]]:
    """The classes with the most methods (functions defined in their body)."""
    sizes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                sizes.append((len(methods), node.name))
    return sorted(sizes, reverse=True)[:n]


def duplicate_pairs(where: Path = PACKAGE) -> str:
    if shutil.which("duplicates") is None:
        return "n/a (no duplicates command)"
    out = subprocess.run(
        ["duplicates", "--repo", str(where), "--seconds", "120", "--most", "1"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split(" pairs", 1)[0] if " pairs" in out else out.splitlines()[0]


class _Files:
    """The kvpool files whose functions are called, in every thread, while recording."""

    def __init__(self) -> None:
        self.on = False
        self.seen: set[str] = set()
        prefix = str(PACKAGE) + "/"

        def profile(frame: Any, event: str, arg: Any) -> None:
            if self.on and event == "call":
                name = frame.f_code.co_filename
                if name.startswith(prefix):
                    self.seen.add(name[len(prefix) :])

        self.profile = profile

    def install(self) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def take(self) -> set[str]:
        seen, self.seen = self.seen, set()
        return seen


def put_get_files() -> dict[str, tuple[int, int]]:
    """{transport: (files of a put, files of a get)} with the master in this process."""
    from kvpool.client.client import Client
    from kvpool.config.master import MasterConfig
    from kvpool.master.server import MasterServer

    files = _Files()
    files.install()  # threads started from now on are seen too (the master's, the data's)
    config = MasterConfig.from_flags({"port": "0", "segment_size": "64MiB"})
    server = MasterServer(config)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def serve() -> None:
        sys.setprofile(files.profile)
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(30)
    out: dict[str, tuple[int, int]] = {}
    value = b"x" * 65536
    try:
        for transport in ("tcp", "shm"):
            with Client(f"127.0.0.1:{server.port}", transport=transport) as pool:
                pool.put(f"warm-{transport}", value)  # connections and first-use imports
                pool.get(f"warm-{transport}")
                files.on = True
                pool.put(f"key-{transport}", value)
                put = files.take()
                assert pool.get(f"key-{transport}") == value
                get = files.take()
                files.on = False
            out[transport] = (len(put), len(get))
    finally:
        files.on = False
        asyncio.run_coroutine_threadsafe(server.stop(quiet=True), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a table row set")
    args = parser.parse_args(argv)
    total, long, modules = docstring_lines()
    paths = put_get_files()
    rows = [
        ("modules in kvpool/", str(modules)),
        *(
            (f"files a 64 KiB put / get runs code in ({t})", f"{p} / {g}")
            for t, (p, g) in paths.items()
        ),
        ("module docstring lines (modules opening with >= 20)", f"{total} ({long})"),
        ("largest modules", ", ".join(f"{name} {n}" for n, name in largest())),
        ("largest classes (methods)", ", ".join(f"{name} {n}" for n, name in largest_classes())),
        ("duplicate pairs in kvpool/ (`duplicates`)", duplicate_pairs()),
        ("duplicate pairs in the whole tree", duplicate_pairs(ROOT)),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |" if args.markdown else f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

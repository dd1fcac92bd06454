"""What the benchmarks' command lines share: a parser described by the module's first
line, the ``--rows`` check, the ``--child`` mode of a benchmark that runs each row in a
child process, and the print of the results as JSON or, with ``--markdown``, the docs table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["check_rows", "child_result", "markdown_table", "parser", "report", "run_or_child"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The benchmark's parser, described by the first line of its module docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n")[0])


def check_rows(p: argparse.ArgumentParser, chosen: set[str], rows: Sequence[str]) -> None:
    """Stop with the usage line when ``--rows`` names a row the benchmark does not have."""
    if unknown := chosen - set(rows):
        p.error(f"--rows: unknown {','.join(sorted(unknown))}; choose from {','.join(rows)}")


def report(results: Any, args: argparse.Namespace, table: Callable[..., str]) -> int:
    """Print ``table(results, args)`` with ``--markdown``, else the results as JSON."""
    print(table(results, args) if args.markdown else json.dumps(results, indent=2))
    return 0


def run_or_child(
    args: argparse.Namespace,
    mark: str,
    child: Callable[[Any], Any],
    measure: Callable[[argparse.Namespace], Any],
    table: Callable[..., str],
) -> int:
    """With ``--child SPEC``: run one row here and print its result after ``mark`` (the
    parent reads that line); without: measure every row and :func:`report` them."""
    if args.child:
        print(mark + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    return report(measure(args), args, table)


def child_result(proc: subprocess.CompletedProcess[str], mark: str, name: str) -> dict[str, Any]:
    """The result a ``--child`` run printed after ``mark``; RuntimeError with its stderr's
    tail when it printed none."""
    for line in proc.stdout.splitlines():
        if line.startswith(mark):
            result: dict[str, Any] = json.loads(line[len(mark) :])
            return result
    raise RuntimeError(f"{name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def markdown_table(head: Sequence[str], body: Iterable[Sequence[str]]) -> None:
    """Print ``head`` and the rows of ``body`` as a Markdown table."""
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for line in body:
        print("| " + " | ".join(line) + " |")

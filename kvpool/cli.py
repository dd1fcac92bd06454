"""The ``kvpool`` command: parse → config → run.  Nothing else lives here.

Subcommands import their implementation lazily so that ``kvpool --help`` stays fast and
``kvpool doctor`` works on a host without vLLM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kvpool import __version__

__all__ = ["build_parser", "main", "parse_bool"]


def parse_bool(text: str) -> bool:
    """The seed writes booleans as ``true``/``false`` (``--enable_offload=true``)."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    """Add ``--name`` under both spellings: ``--snake_case`` (as the seed writes it) and
    ``--kebab-case``.  argparse itself accepts ``--flag value`` and ``--flag=value``."""
    spellings = [f"--{name}"]
    kebab = name.replace("_", "-")
    if kebab != name:
        spellings.append(f"--{kebab}")
    parser.add_argument(*spellings, dest=name, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a KV-cache pool for prefill/decode-disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.set_defaults(run=None)
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = args.run
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args)

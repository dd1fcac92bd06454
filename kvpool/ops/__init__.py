"""The operator's commands, one module or package per command; each is an options
dataclass and ``run(options) -> int`` (:mod:`kvpool.cli` only builds the options):

- :mod:`.doctor` — checks a node or a P/D pair against the production guide's
  troubleshooting table (§8.3) and checklist (§9): facts gathered with I/O, diagnosed purely;
- :mod:`.up` — the whole P/D stack on one machine: plan, supervisor, lifecycle;
- :mod:`.render` — ``kvpool config render`` (per-node files from an inventory) and
  ``kvpool config check``;
- :mod:`.status` — the pool at a glance, from the master's HTTP side;
- :mod:`.serve` — ``kvpool master``, ``kvpool node`` and ``kvpool proxy``, handed to the
  services that run them.
"""

from __future__ import annotations

__all__: list[str] = []

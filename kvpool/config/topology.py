"""The P/D layout: one side's :class:`Topology`, and which prefill (P) rank sends which KV
heads to which decode (D) rank (pure: no I/O, no vLLM).

P and D may run different TP sizes (the guide's GLM example: P ``tp 8``, D ``tp 4``), so a
D rank may need heads from several P ranks.  Both connectors and ``kvpool doctor`` read a
layout here, so doctor refuses exactly what the connectors refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError

__all__ = [
    "MAX_PORT",
    "HeadSlice",
    "Topology",
    "expected_pullers",
    "local_heads",
    "parse_topology",
    "plan_pulls",
    "rank_port",
]

MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """``count`` consecutive heads a D rank reads from P rank ``src_rank``.

    ``src_start`` indexes the P rank's *local* heads, ``dst_start`` the D rank's.
    """

    src_rank: int
    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True, slots=True)
class Topology:
    """A side's data- and tensor-parallel layout, written ``{"dp_size": 4, "tp_size": 8}``.

    In a connector's extra config it describes the PEER (the guide's §5.4 trap); on a
    ``vllm serve`` command line (``-dp``/``-tp``) a side's own layout.
    """

    dp_size: int = 1
    tp_size: int = 1

    @property
    def ranks(self) -> int:
        """Worker ranks of the side: one KV port each (see :func:`rank_port`)."""
        return self.dp_size * self.tp_size

    def __str__(self) -> str:
        return f'{{"dp_size": {self.dp_size}, "tp_size": {self.tp_size}}}'


def _check_tp(num_kv_heads: int, tp_size: int) -> None:
    if num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads must be > 0, got {num_kv_heads}")
    if tp_size <= 0:
        raise ValueError(f"tp_size must be > 0, got {tp_size}")
    big, small = max(num_kv_heads, tp_size), min(num_kv_heads, tp_size)
    if big % small != 0:
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be sharded over tp_size {tp_size}: "
            "one must divide the other"
        )


# Rules (vLLM's head sharding, which this module must mirror exactly):
#
# - ``tp_size <= num_kv_heads``: the heads split evenly; rank ``r`` holds heads
#   ``[r * n, (r + 1) * n)`` with ``n = num_kv_heads // tp_size``.
# - ``tp_size > num_kv_heads``: heads are replicated; rank ``r`` holds the one head
#   ``r // (tp_size // num_kv_heads)`` (MLA's single latent "head" is the extreme case).
def local_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV-head indices TP rank ``rank`` holds (vLLM's sharding)."""
    _check_tp(num_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def _holders(num_kv_heads: int, src_tp: int, head: int) -> list[int]:
    """The P ranks that hold global head ``head`` (several when heads are replicated)."""
    if src_tp <= num_kv_heads:
        return [head // (num_kv_heads // src_tp)]
    replicas = src_tp // num_kv_heads
    return list(range(head * replicas, (head + 1) * replicas))


# Invariants checked by the tests (hypothesis):
#
# - every head of every D rank is covered by exactly one :class:`HeadSlice`;
# - a slice only reads heads its P rank really holds;
# - :func:`expected_pullers` is the exact inverse of :func:`plan_pulls`, so a P rank knows
#   how many D ranks will come for a request before it may free the blocks.
def plan_pulls(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSlice]:
    """The slices D rank ``dst_rank`` (of ``dst_tp``) reads from P ranks (of ``src_tp``).

    When a head is replicated on several P ranks, D ranks spread over the replicas
    (``dst_rank % replicas``) so one P rank does not serve everyone.  Consecutive heads
    from the same P rank merge into one slice: one contiguous run per block page.
    """
    _check_tp(num_kv_heads, src_tp)
    wanted = local_heads(num_kv_heads, dst_tp, dst_rank)
    slices: list[HeadSlice] = []
    for dst_index, head in enumerate(wanted):
        holders = _holders(num_kv_heads, src_tp, head)
        src_rank = holders[dst_rank % len(holders)]
        src_index = head - local_heads(num_kv_heads, src_tp, src_rank).start
        last = slices[-1] if slices else None
        if (
            last is not None
            and last.src_rank == src_rank
            and last.src_start + last.count == src_index
            and last.dst_start + last.count == dst_index
        ):
            slices[-1] = HeadSlice(src_rank, last.src_start, last.dst_start, last.count + 1)
        else:
            slices.append(HeadSlice(src_rank, src_index, dst_index, 1))
    return slices


def expected_pullers(num_kv_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> frozenset[int]:
    """The D ranks that will read from P rank ``src_rank`` for every request."""
    if not 0 <= src_rank < src_tp:
        raise ValueError(f"rank {src_rank} is outside tp_size {src_tp}")
    return frozenset(
        dst_rank
        for dst_rank in range(dst_tp)
        if any(s.src_rank == src_rank for s in plan_pulls(num_kv_heads, src_tp, dst_tp, dst_rank))
    )


# Ports: each rank of each DP engine gets its own port,
# ``kv_port + dp_rank * tp_size + tp_rank`` (:func:`rank_port`), so the guide's
# ``kv_port`` 30000/30100 are bases and two ranks never collide.
def rank_port(base_port: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """The port of one rank: ``base + dp_rank * tp_size + tp_rank``."""
    port = base_port + dp_rank * tp_size + tp_rank
    if not 0 < port <= MAX_PORT:
        raise ConfigError(
            f"kv_port {base_port} + dp_rank {dp_rank} * tp_size {tp_size} + tp_rank {tp_rank} "
            f"= {port} is not a valid TCP port; lower kv_port"
        )
    return port


def _positive_int(section: str, key: str, value: Any) -> int:
    if isinstance(value, bool):
        value = repr(value)  # True is an int to Python, never a size to an operator
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f'kv_connector_extra_config["{section}"]["{key}"] must be an integer, got {value!r}'
        ) from None
    if number <= 0 or (isinstance(value, float) and value != number):
        raise ConfigError(
            f'kv_connector_extra_config["{section}"]["{key}"] must be a positive integer, '
            f"got {value!r}"
        )
    return number


def parse_topology(extra_config: Mapping[str, Any], peer: str) -> Topology | None:
    """The layout in ``extra_config[peer]`` (``"prefill"`` or ``"decode"``).

    ``None`` when the section is absent (the caller then trusts what the peer reports).
    Unknown keys inside the section are errors: a typo such as ``"tp"`` must not
    silently fall back to 1.
    """
    section = extra_config.get(peer)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(
            f'kv_connector_extra_config["{peer}"] must be an object like '
            f'{{"dp_size": 1, "tp_size": 1}}, got {section!r}'
        )
    unknown = sorted(set(section) - {"dp_size", "tp_size"})
    if unknown:
        raise ConfigError(
            f'kv_connector_extra_config["{peer}"] has unknown key(s) {unknown}; '
            'allowed: "dp_size", "tp_size"'
        )
    return Topology(
        dp_size=_positive_int(peer, "dp_size", section.get("dp_size", 1)),
        tp_size=_positive_int(peer, "tp_size", section.get("tp_size", 1)),
    )

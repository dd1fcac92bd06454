"""KV-head groups: the unit the store connector keys, saves and loads (pure: no I/O, no vLLM).

One pool object holds one chunk of one *head group* (``group_size`` consecutive KV heads of
the model, every layer), keyed by the chunk's key and the group's index — never by the
writer's TP rank or size.  So an instance of any TP layout finds what an instance of
another layout wrote: TP rank ``r`` of ``tp_size`` loads exactly the groups of the heads it
holds (vLLM's sharding, :func:`kvpool.config.topology.local_heads`), whoever wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.config.topology import local_heads
from kvpool.core.keys import BlockKey, group_key, layer_key
from kvpool.errors import ConfigError

__all__ = ["GroupSlot", "HeadGroups"]


@dataclass(frozen=True, slots=True)
class GroupSlot:
    """Group ``group`` lies in a rank's local heads ``[head_start, head_start + count)``."""

    group: int
    head_start: int
    count: int


# Rules:
# - group_size must divide every rank's head count; every instance that shares a pool must
#   use the same value (it is part of the key namespace, so a different one is a miss,
#   never wrong bytes).  One head per group (the default with a master) fits every TP size.
# - A chunk is a hit only when *every* group is present: a reader's ranks together hold
#   every head of the model, so the all-ranks rule is "every group exists".
# - Each group is written once per instance: when heads are replicated (tp_size >
#   num_kv_heads, MLA's single latent head always), only the first rank that holds a head
#   writes its group; every holder reads it.
# - A single group (MLA, or an embedded pool) keys its objects with the chunk key itself;
#   with several, group g's key is kvpool.core.keys.group_key of it.
# - ``layers`` > 1 (use_layerwise) splits each group's object into one object per layer,
#   keyed by kvpool.core.keys.layer_key of the group's key: a *column* is one (group, layer)
#   pair, column ``group * layers + layer``, and a chunk is a hit only when every column is
#   present.  With ``layers`` 1 a column is a group, as without layer-wise objects.
@dataclass(frozen=True, slots=True)
class HeadGroups:
    """How a model's ``num_kv_heads`` split into pool objects, seen from ``tp_size`` ranks."""

    num_kv_heads: int = 1
    group_size: int = 1
    tp_size: int = 1
    layers: int = 1  # objects per group and chunk: 1, or every layer its own (layer-wise)

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.group_size <= 0 or self.tp_size <= 0 or self.layers <= 0:
            raise ConfigError(
                f"head groups: num_kv_heads {self.num_kv_heads}, head_group_size"
                f" {self.group_size}, tp_size {self.tp_size} and layers {self.layers}"
                " must be positive"
            )
        try:
            per_rank = len(local_heads(self.num_kv_heads, self.tp_size, 0))
        except ValueError as exc:
            raise ConfigError(f"head groups: {exc}") from None
        if per_rank % self.group_size:
            raise ConfigError(
                f"head_group_size: {self.group_size} does not divide the {per_rank} KV heads"
                f" each of {self.tp_size} TP ranks holds ({self.num_kv_heads} in all); use a"
                " divisor of it (1 fits every layout), the same on every instance of the pool"
            )

    @classmethod
    def whole(cls, num_kv_heads: int, tp_size: int = 1) -> HeadGroups:
        """One group per rank's heads (tp 1: one object per chunk, as an embedded pool keeps)."""
        return cls(num_kv_heads, len(local_heads(num_kv_heads, tp_size, 0)), tp_size)

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_size

    @property
    def num_columns(self) -> int:
        """Pool objects per chunk: every layer of every group."""
        return self.num_groups * self.layers

    @property
    def reads_per_chunk(self) -> int:
        """Objects all ranks together load per chunk (more than groups when heads are
        replicated)."""
        return sum(len(self.reads(rank)) for rank in range(self.tp_size)) * self.layers

    def columns(self, slot: GroupSlot) -> range:
        """The columns of ``slot``'s group: its layers in order."""
        return range(slot.group * self.layers, (slot.group + 1) * self.layers)

    def reads(self, rank: int) -> tuple[GroupSlot, ...]:
        """The groups rank ``rank`` loads, in its local head order."""
        heads = local_heads(self.num_kv_heads, self.tp_size, rank)
        return tuple(
            GroupSlot(head // self.group_size, head - heads.start, self.group_size)
            for head in heads[:: self.group_size]
        )

    def writes(self, rank: int) -> tuple[GroupSlot, ...]:
        """The groups rank ``rank`` saves: its own, unless a lower rank holds the same heads."""
        first = local_heads(self.num_kv_heads, self.tp_size, rank).start
        if rank and local_heads(self.num_kv_heads, self.tp_size, rank - 1).start == first:
            return ()  # a replica: the first holder writes
        return self.reads(rank)

    def object_key(self, key: BlockKey, group: int) -> str:
        """The pool key of chunk ``key``'s group ``group`` (its column, without layers)."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} is outside {self.num_groups} groups")
        return key.hex if self.num_groups == 1 else group_key(key, group).hex

    def column_key(self, key: BlockKey, column: int) -> str:
        """The pool key of chunk ``key``'s column ``column`` (a group, or a group's layer)."""
        if not 0 <= column < self.num_columns:
            raise ValueError(f"column {column} is outside {self.num_columns} columns")
        if self.layers == 1:
            return self.object_key(key, column)
        group, layer = divmod(column, self.layers)
        of_group = key if self.num_groups == 1 else group_key(key, group)
        return layer_key(of_group, layer).hex

    def keys(self, chain: list[BlockKey]) -> tuple[tuple[str, ...], ...]:
        """Every column's pool keys of ``chain`` (``[column][chunk]``)."""
        return tuple(tuple(self.column_key(k, c) for k in chain) for c in range(self.num_columns))

"""What one chunk is in the pool: objects per KV cache group and KV-head group (pure).

Within one of vLLM's KV cache groups, one pool object holds one chunk of one head group
(``group_size`` consecutive KV heads, every layer), keyed by the chunk's key and the
group's index, never by the writer's TP rank or size, so that an instance of any TP layout
finds what another layout wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.config.topology import local_heads
from kvpool.core.keys import BlockKey, cache_group_key, group_key, layer_key
from kvpool.errors import ConfigError

__all__ = ["CacheGroup", "CacheGroups", "GroupSlot", "HeadGroups", "HitRule", "prefix_hit"]


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


# A cache group's *kind* decides which of its chunks a save writes and a load needs:
# - "attention": a block holds its chunk's KV at a fixed position (full, sliding-window,
#   chunked-local attention, MLA and its indexer): every full chunk is saved as it is
#   computed; a load fills the blocks vLLM allocated for the hit (it leaves the chunks a
#   window no longer sees unallocated).
# - "state": a recurrent state (Mamba, linear attention) exists only at a block boundary,
#   in a block vLLM names when it caches it: only those states are saved, and a hit at
#   chunk n needs only the state ending there.
ATTENTION = "attention"
STATE = "state"


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One of vLLM's KV cache groups, as the store connector keys and moves it."""

    group_id: int  # vLLM's index of the group (block ids come per group, in this order)
    kind: str  # ATTENTION or STATE
    heads: HeadGroups  # its objects per chunk (a state group: one per TP rank)
    layers: tuple[str, ...] = ()  # its layers' names in vLLM's order
    tag: str = ""  # its spec, as the key namespace names it

    def __post_init__(self) -> None:
        if self.kind not in (ATTENTION, STATE):
            raise ConfigError(f"KV cache group {self.group_id}: unknown kind {self.kind!r}")


#: (which chunks of each cache group the pool holds, chunks at most) -> chunks a hit covers
HitRule = Callable[[Sequence[Sequence[bool]], int], int]


def prefix_hit(present: Sequence[Sequence[bool]], limit: int) -> int:
    """The hit of groups that need every chunk before the hit (full attention): the
    leading run every group holds."""
    hit = limit
    for row in present:
        run = 0
        for held in row[:hit]:
            if not held:
                break
            run += 1
        hit = min(hit, run)
    return max(hit, 0)


# Rules:
# - One group (every model before hybrid attention): its objects keep the keys they always
#   had, the chunk key itself or its head groups' and layers' sub-keys.
# - A hybrid model (several groups, or one that is not plain attention): group g's chunk
#   key is kvpool.core.keys.cache_group_key(key, group_id) before any head-group or layer
#   split, so two groups never share a key; the namespace's
#   layout names every group's tag, so a changed model is a miss, never another model's KV.
# - A hit is the longest prefix *every* group can restore, as the model's own prefix cache
#   decides it (``rule``: a window needs only its tail, a state only the block at the hit).
@dataclass(frozen=True, slots=True)
class CacheGroups:
    """Every KV cache group of a model the store connector saves and loads."""

    groups: tuple[CacheGroup, ...]
    rule: HitRule = prefix_hit
    # shaped by vLLM's hybrid KV cache manager (any model but one group of full attention
    # or MLA): null blocks a group does not need, per-request load failures, group keys
    hybrid: bool = False

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("the store connector needs at least one KV cache group")

    @classmethod
    def single(cls, heads: HeadGroups | None = None, layers: Sequence[str] = ()) -> CacheGroups:
        """A model with one KV cache group of attention (``heads``: its head groups)."""
        return cls((CacheGroup(0, ATTENTION, heads or HeadGroups(), tuple(layers)),))

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.groups)

    def __getitem__(self, index: int) -> CacheGroup:
        return self.groups[index]

    @property
    def tp_size(self) -> int:
        return self.groups[0].heads.tp_size

    def chunk_key(self, key: BlockKey, index: int) -> BlockKey:
        """Group ``index``'s key of chunk ``key`` (the chunk key itself with one group)."""
        return key if not self.hybrid else cache_group_key(key, self.groups[index].group_id)

    def keys(self, index: int, chain: Sequence[BlockKey]) -> tuple[tuple[str, ...], ...]:
        """Group ``index``'s pool keys of ``chain``, ``[column][chunk]``."""
        heads = self.groups[index].heads
        return heads.keys([self.chunk_key(k, index) for k in chain])

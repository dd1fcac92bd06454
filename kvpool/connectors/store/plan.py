"""What the store connector's scheduler half tells its worker half each step.

Plain frozen dataclasses (picklable; vLLM ships them to worker processes): a
:class:`LoadSpec` or :class:`SaveSpec` per request and KV cache group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadSpec", "SaveSpec", "StorePlan"]


# Keys are given for every column (keys[column][i], see .groups): a column is a KV-head
# group, or one layer of one with layer-wise objects.  Each rank loads and saves the
# columns of the heads it holds, and the scheduler computed them all anyway to check that
# every column of a chunk is present.  Block block_ids[i] holds chunk keys[column][i]: one
# pool object per (chunk, column) holding that group's heads of every layer of the block,
# or of the column's one layer.  ``group`` is the KV cache group the blocks belong to (its
# position in the connector's CacheGroups): a hybrid model's request loads and saves one
# spec per group, each with that group's blocks, and a load of a request is all of them.
@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy the pool objects ``keys[column]`` into the engine blocks ``block_ids``.

    ``owners[rank]`` is the pin owner under which the scheduler's lookup pinned that rank's
    keys (empty when it pinned nothing): the worker of that rank releases it once its copy
    is done, so the pins end as soon as they have served.
    """

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[tuple[str, ...], ...]
    is_async: bool
    owners: tuple[str, ...] = ()
    group: int = 0

    def __post_init__(self) -> None:
        if any(len(rank_keys) != len(self.block_ids) for rank_keys in self.keys):
            raise ValueError("LoadSpec: every column needs one key per block")


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Write the engine blocks ``block_ids`` to the pool under ``keys[column]``.

    ``parents[column]`` is the key of the chunk before the first one (None at the start of a
    prompt): the pool uses it to evict a prefix's tail before its head.
    """

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[tuple[str, ...], ...]
    parents: tuple[str | None, ...]
    group: int = 0

    def __post_init__(self) -> None:
        if any(len(rank_keys) != len(self.block_ids) for rank_keys in self.keys):
            raise ValueError("SaveSpec: every column needs one key per block")
        if len(self.parents) != len(self.keys):
            raise ValueError("SaveSpec: one parent per column")


@dataclass(frozen=True, slots=True)
class StorePlan:
    """One step's work for the worker half.

    ``commit``: the requests whose answer may end with this step; every save of theirs
    handed off so far is in the pool before the step returns (read-your-writes: a client
    that has the answer finds the prefix from any instance)."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    commit: tuple[str, ...] = ()

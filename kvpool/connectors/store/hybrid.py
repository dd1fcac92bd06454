"""A hybrid model's KV cache groups as the store connector moves them, from vLLM's.

vLLM gives each kind of layer its own KV cache group (sliding window, Mamba state, an MLA
indexer); :func:`cache_groups` refuses in one line, naming the group and its spec, what
cannot be stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.config.kv_transfer import STORE_CONNECTOR, StoreConfig
from kvpool.config.topology import local_heads
from kvpool.connectors.store.groups import (
    ATTENTION,
    STATE,
    CacheGroup,
    CacheGroups,
    HeadGroups,
    HitRule,
)
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["cache_groups", "describe_groups", "group_tag", "is_plain", "vllm_hit_rule"]

# Specs kvpool cannot store although vLLM may list them as prefix-cacheable: their KV is
# not a function of the request's tokens alone (cross-attention: the encoder's input).
_REFUSED = ("CrossAttentionSpec", "EncoderOnlyAttentionSpec")
_PLAIN = ("FullAttentionSpec", "MLAAttentionSpec")


def _spec_name(spec: Any) -> str:
    return type(spec).__name__


def _cacheable(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """vLLM's prefix-cacheable groups (every group before vLLM named them)."""
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    return tuple(range(len(kv_cache_config.kv_cache_groups))) if ids is None else tuple(ids)


def is_plain(kv_cache_config: KVCacheConfig) -> bool:
    """One group of full attention or MLA: the model kvpool's keys were first made for,
    stored as it always was."""
    groups = kv_cache_config.kv_cache_groups
    return len(groups) == 1 and _spec_name(groups[0].kv_cache_spec) in _PLAIN


def describe_groups(kv_cache_config: KVCacheConfig) -> list[str]:
    """One line per KV cache group: its index, spec, layers and whether it is stored."""
    cacheable = set(_cacheable(kv_cache_config))
    lines = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = group.kv_cache_spec
        extra = ""
        if getattr(spec, "sliding_window", None):
            extra = f", window {spec.sliding_window}"
        elif getattr(spec, "attention_chunk_size", None):
            extra = f", chunk {spec.attention_chunk_size}"
        elif getattr(spec, "mamba_cache_mode", None):
            extra = f", mamba_cache_mode {spec.mamba_cache_mode}"
        stored = "" if i in cacheable else " (not prefix-cacheable: not stored)"
        lines.append(
            f"group {i}: {_spec_name(spec)}, block {spec.block_size}, "
            f"{len(group.layer_names)} layers{extra}{stored}"
        )
    return lines


def _kind(index: int, spec: Any) -> str:
    """ATTENTION or STATE, or a ConfigError naming the group and what to do."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    name = _spec_name(spec)
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise ConfigError(
                f"{STORE_CONNECTOR}: KV cache group {index} ({name}) keeps its recurrent"
                f" state with mamba_cache_mode {mode!r}, which has no state at block"
                " boundaries to store; start vLLM with --enable-prefix-caching (it sets"
                " --mamba-cache-mode align)"
            )
        return STATE
    if name in _REFUSED or not isinstance(spec, AttentionSpec):
        raise ConfigError(
            f"{STORE_CONNECTOR}: KV cache group {index} ({name}) cannot be stored by"
            " prefix: its KV is not decided by the prompt's tokens alone"
            if name in _REFUSED
            else f"{STORE_CONNECTOR}: KV cache group {index} ({name}) is a KV cache kind"
            " the store connector does not know; it stores attention (full, sliding-window,"
            " chunked-local, MLA) and Mamba/linear-attention state"
        )
    return ATTENTION


def group_tag(spec: Any, tp_size: int) -> str:
    """What the namespace says of a group's spec: everything that decides its bytes, never
    a per-rank count (attention groups are shared across TP layouts; a state group, which
    cannot be split by head, names the layout)."""
    name = _spec_name(spec)
    parts = [name, f"b{spec.block_size}"]
    for field in ("head_size", "head_size_v", "sliding_window", "attention_chunk_size"):
        value = getattr(spec, field, None)
        if value is not None:
            parts.append(f"{field}={value}")
    if hasattr(spec, "dtype"):
        parts.append(str(spec.dtype).removeprefix("torch."))
    if hasattr(spec, "shapes"):  # a recurrent state: its tensors, per rank
        dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        parts.append(f"shapes={list(map(list, spec.shapes))}:{dtypes}:tp{tp_size}")
        parts.append(str(getattr(spec, "mamba_type", "")).rsplit(".", 1)[-1])
    return ":".join(parts)


def _heads(spec: Any, kind: str, total: int, tp_size: int, config: StoreConfig) -> HeadGroups:
    """A group's head groups: MLA's one replicated latent (rank 0 writes), one object per
    rank for a state, else the model's KV heads as the plain model splits them."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if kind == STATE:
        return HeadGroups(tp_size, 1, tp_size)
    if isinstance(spec, MLAAttentionSpec):
        return HeadGroups(1, 1, tp_size)
    per_rank = getattr(spec, "num_kv_heads", 1)
    if len(local_heads(total, tp_size, 0)) != per_rank:  # heads this group shards its own way
        return HeadGroups(per_rank * tp_size, per_rank, tp_size)
    if config.head_group_size:
        return HeadGroups(total, config.head_group_size, tp_size)
    if config.backend == "embedded":
        return HeadGroups.whole(total, tp_size)
    return HeadGroups(total, 1, tp_size)


def cache_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: StoreConfig
) -> tuple[CacheGroups, str]:
    """The groups a hybrid model stores, and the layout its namespace names.

    Refused in one line each: a group vLLM cannot prefix-cache by tokens (cross-attention),
    Mamba state outside ``align`` mode, cacheable groups of unequal block sizes.
    """
    from vllm.platforms import current_platform

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    total = vllm_config.model_config.get_total_num_kv_heads()
    specs = kv_cache_config.kv_cache_groups
    ids = _cacheable(kv_cache_config)
    if not ids:
        raise ConfigError(f"{STORE_CONNECTOR}: the model has no prefix-cacheable KV cache group")
    sizes = {specs[i].kv_cache_spec.block_size for i in ids}
    if len(sizes) != 1:
        raise ConfigError(
            f"{STORE_CONNECTOR}: the model's KV cache groups have block sizes"
            f" {sorted(sizes)}; the store connector needs one block size for every group"
            " (vLLM picks one when --block-size is left unset)"
        )
    groups = []
    for i in ids:
        spec = specs[i].kv_cache_spec
        kind = _kind(i, spec)
        groups.append(
            CacheGroup(
                group_id=i,
                kind=kind,
                heads=_heads(spec, kind, total, tp_size, config),
                layers=tuple(specs[i].layer_names),
                tag=group_tag(spec, tp_size),
            )
        )
    rule = vllm_hit_rule([specs[i].kv_cache_spec for i in ids], sizes.pop())
    layout = f"{current_platform.device_type}:hybrid:" + "|".join(
        f"{g.group_id}={g.tag}:H{g.heads.num_kv_heads}:g{g.heads.group_size}:L{len(g.layers)}"
        for g in groups
    )
    return CacheGroups(tuple(groups), rule, hybrid=True), layout


class _Held:
    """vLLM's ``BlockPool`` as its managers' hit rules read it, over what the pool holds:
    ``held[g][i]`` for group position ``g`` and chunk ``i`` (the chunk index is the hash)."""

    def __init__(self, held: Sequence[Sequence[bool]], block_size: int) -> None:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self._held = held
        self.hash_block_size = block_size
        self.null_block = KVCacheBlock(block_id=0)
        self._block = KVCacheBlock(block_id=1)

    def get_cached_block(self, chunk: int, group_ids: list[int]) -> list[Any] | None:
        if all(chunk < len(self._held[g]) and self._held[g][chunk] for g in group_ids):
            return [self._block] * len(group_ids)
        return None


def vllm_hit_rule(specs: Sequence[Any], block_size: int) -> HitRule:
    """The hit vLLM's own prefix cache would find if it held what the pool holds: each
    spec's manager (``find_longest_cache_hit``: a window needs its last blocks, a Mamba
    state only the block at the hit), groups of one spec together, full attention first,
    narrowed until every group agrees (vLLM's hybrid coordinator)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    merged: list[tuple[Any, list[int], Any]] = []
    for position, spec in enumerate(specs):
        for same, ids, _ in merged:
            if same == spec:
                ids.append(position)
                break
        else:
            merged.append((spec, [position], KVCacheSpecRegistry.get_manager_class(spec)))
    merged.sort(key=lambda entry: not isinstance(entry[0], FullAttentionSpec))

    def rule(held: Sequence[Sequence[bool]], limit: int) -> int:
        pool = _Held(held, block_size)
        chunks = list(range(max((len(row) for row in held), default=0)))
        hit = min(limit, len(chunks)) * block_size
        while True:
            narrowed = hit
            for spec, ids, manager in merged:
                _, narrowed = manager.find_longest_cache_hit(
                    block_hashes=chunks,
                    max_length=narrowed,
                    kv_cache_group_ids=ids,
                    block_pool=pool,
                    kv_cache_spec=spec,
                    drop_eagle_block=False,
                    alignment_tokens=block_size,
                )
            if narrowed >= hit:
                return hit // block_size
            hit = narrowed

    return rule

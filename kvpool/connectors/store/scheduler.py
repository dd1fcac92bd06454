"""The scheduler half of the store connector: lookups, load plans, save plans.

Runs in vLLM's engine-core process.  It never touches KV bytes: it asks the pool how long
a request's cached prefix is (``prefix_lookup``: no lease, so probing never pins anything),
pins the blocks it will load for that request, and each step tells the worker half which
blocks to load and which to save.  Requests and scheduler outputs are duck-typed (the
attributes vLLM 0.32 has), so this module imports nothing from vLLM and is tested with
plain objects.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys
from kvpool.engines import POOL_TTL, PoolLookups

__all__ = ["StoreScheduler", "pin_owner"]

_WARN_EVERY_S = 30.0


def _present_prefix(pool: PoolLookups, keys: Sequence[Sequence[str]]) -> int:
    """Leading chunks present for every group (probing only: no lease is taken)."""
    if len(keys) == 1:
        return pool.prefix_lookup(keys[0])
    # Several groups: one round trip for all of them instead of one per group.
    try:
        flags = pool.batch_exists([k for group_keys in keys for k in group_keys])
    except NotImplementedError:  # the embedded pool's lookup channel: one lookup per group
        return min(pool.prefix_lookup(group_keys) for group_keys in keys)
    n = len(keys[0])
    found = n
    for group in range(len(keys)):
        row = flags[group * n : (group + 1) * n]
        found = min(found, row.index(False) if False in row else n)
    return found


def pin_owner(scope: str, req_id: str, rank: int, generation: int = 1) -> str:
    """The pin owner of one request's blocks of one rank: ``scope`` keeps two vLLM
    instances that reuse a request id (a P and a D behind one proxy) apart, and
    ``generation`` a request's later lookup (after a preemption) apart from the pins of
    an earlier load, which that load's worker releases in its own time."""
    return f"kvpool-req/{scope}/{req_id}/{generation}/{rank}"


def _pin_ranks(pool: PoolLookups, keys: list[list[str]], owners: Sequence[str]) -> list[int]:
    """Pin each rank's keys under its owner: how many each rank's pin holds."""
    pairs = zip(keys, owners, strict=True)
    return [pool.pin(rank_keys, owner, POOL_TTL) for rank_keys, owner in pairs]


def _release_ranks(pool: PoolLookups, owners: Sequence[str]) -> int:
    return sum(pool.release(owner) for owner in owners)


@dataclass(slots=True)
class _Request:
    """What the scheduler half remembers about one live request."""

    req_id: str
    request: Any  # vLLM's Request: its token ids grow as decode proceeds
    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)  # the chain: one key per full chunk
    namespace: KeyNamespace | None = None  # None: not cacheable by tokens
    local_tokens: int = 0  # vLLM's own prefix-cache hit at lookup time
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the pool or being written
    query_tokens: int = 0  # the last lookup's query size, until vLLM admits the request
    load: LoadSpec | None = None  # the last load planned, to map failed blocks back
    pinned: bool = False  # holds pins the scheduler must release (not handed to a load)
    pin_generation: int = 0  # of the owners: one more for each set handed to a load

    def tokens(self) -> Sequence[int]:
        return self.request.all_token_ids  # type: ignore[no-any-return]


# Rules:
# - Keys come from kvpool.core.keys.chunk_keys over the request's token ids, one chain
#   whatever the TP layout, and one pool object per chunk and KV-head group (.groups);
#   never from vLLM's block hashes (seeded per process).
# - A chunk is a hit only if every group is present (the reader's ranks together need
#   every head): the hit is the minimum over groups.
# - A synchronous hit leaves at least one token to compute (vLLM needs a token to sample
#   from); the hit is also capped the same way for async loads, which keeps one rule.
# - A request saves each full block once; blocks the pool already held at lookup time are
#   not written again.  After a failed load the mark moves back, so that what vLLM
#   recomputes is written again and the pool heals.
# - Any pool failure during a lookup is a miss: a dead pool slows requests down, never
#   fails them.
# - Only what decides the KV may share a key: a LoRA adapter or a request's cache_salt
#   goes into its namespace, and a request whose KV depends on more than token ids
#   (multimodal inputs, prompt embeddings) is neither looked up nor saved.
class StoreScheduler:
    """Scheduler-side logic of :class:`~kvpool.connectors.store.KVPoolStoreConnector`."""

    def __init__(
        self,
        *,
        namespace: KeyNamespace,
        pool: PoolHandle[PoolLookups],
        saves: bool,
        load_async: bool,
        logger: logging.Logger,
        pin_hits: bool = True,
        pin_scope: str | None = None,
        groups: HeadGroups | None = None,
    ) -> None:
        self._ns = namespace
        self._groups = groups or HeadGroups()
        self._bs = namespace.chunk_size
        self._pool = pool
        self._saves = saves
        self._load_async = load_async
        self._log = logger
        self._pin_hits = pin_hits  # off only to measure what pins are worth (bench)
        self._scope = pin_scope or uuid.uuid4().hex[:12]
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        self.counters: Counter[str] = Counter()
        self._last_warning = -_WARN_EVERY_S

    # ------------------------------------------------------------------ keys

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Request(request.request_id, request, namespace=self._namespace(request))
            self._requests[request.request_id] = state
        else:
            state.request = request
        return state

    def _namespace(self, request: Any) -> KeyNamespace | None:
        """The request's key namespace; None when tokens alone do not decide
        its KV (images or other inputs, prompt embeddings): such a request is never looked up
        nor saved, since a key without those inputs would serve another request's KV."""
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return None
        salt = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:  # an adapter changes K and V for the same tokens
            salt.append(f"lora={getattr(lora, 'lora_name', lora)}")
        cache_salt = getattr(request, "cache_salt", None)
        if cache_salt:  # vLLM's per-request prefix-cache isolation: honour it here too
            salt.append(f"salt={cache_salt}")
        if not salt:
            return self._ns
        return replace(self._ns, tenant="|".join([self._ns.tenant, *salt]))

    def _keys_upto(self, state: _Request, n_blocks: int) -> list[BlockKey]:
        """The chain's keys of chunks [0, n_blocks), extending the cached chain."""
        have = len(state.keys)
        if n_blocks > have:
            tokens = list(state.tokens()[have * self._bs : n_blocks * self._bs])
            assert state.namespace is not None
            parent = state.keys[-1] if have else None
            state.keys.extend(chunk_keys(tokens, state.namespace, parent))
        return state.keys[:n_blocks]

    def _rank_keys(self, chain: Sequence[BlockKey]) -> list[list[str]]:
        """Per rank, the pool keys of the columns it loads for ``chain``, column by column."""
        groups = self._groups
        return [
            [
                groups.column_key(k, c)
                for slot in groups.reads(rank)
                for c in groups.columns(slot)
                for k in chain
            ]
            for rank in range(groups.tp_size)
        ]

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens the pool can add beyond vLLM's local hit, whether they load async)."""
        state = self._state(request)
        state.local_tokens = num_computed_tokens
        if state.namespace is None:
            return 0, False
        n_tokens = int(request.num_tokens)
        usable_blocks = (n_tokens - 1) // self._bs
        if usable_blocks * self._bs <= num_computed_tokens:
            return 0, False
        # Probe every full block (not just the usable ones) so that a block the pool holds
        # is not written again after the request computes it.
        keys = self._keys_upto(state, n_tokens // self._bs)
        state.query_tokens = 0
        try:
            found = self._pool.call(partial(_present_prefix, keys=self._groups.keys(keys)))
        except Exception as exc:  # any pool failure is a miss, never a failed request
            self.counters["lookup_errors"] += 1
            self._warn(f"lookup failed, treating as a miss: {type(exc).__name__}: {exc}")
            return 0, False
        # Counted when vLLM admits the request (update_state_after_alloc): a request that
        # waits for memory is asked about again each step and must not count twice.
        state.query_tokens = n_tokens - num_computed_tokens
        state.saved_blocks = max(state.saved_blocks, found)
        hit_blocks = max(0, min(found, usable_blocks))
        if self._pin_hits and hit_blocks * self._bs > num_computed_tokens:
            hit_blocks = self._pin_hit(state, keys, num_computed_tokens // self._bs, hit_blocks)
        new_tokens = hit_blocks * self._bs - num_computed_tokens
        if new_tokens <= 0:
            return 0, False
        return new_tokens, self._load_async

    def _owners(self, state: _Request) -> tuple[str, ...]:
        gen = state.pin_generation
        ranks = range(self._groups.tp_size)
        return tuple(pin_owner(self._scope, state.req_id, r, gen) for r in ranks)

    # A hit is pinned for its request (owner: pin_owner, one per rank, named in the LoadSpec
    # so the worker can release it; a rank pins the groups it will load), for the pool's lease
    # TTL (default_kv_lease_ttl): the probe itself stays lease-free, so probing never starves
    # eviction, but what a request is about to load is not evicted under it.  A pin ends when
    # the worker has loaded the blocks, at once when vLLM admits the request without a load,
    # when the request finishes or aborts, or at the TTL, whichever comes first.  A block gone
    # between the probe and the pin shortens the hit (asked again, now that the rest is
    # pinned); a failed pin leaves the hit unprotected.
    def _pin_hit(self, state: _Request, keys: list[BlockKey], first: int, hit: int) -> int:
        """Pin chunks [first, hit) of every group for the request, each rank's groups under
        its own owner; the hit that stays (shorter
        when a chunk went away between the probe and the pin)."""
        if not state.pinned:  # a new set of pins (the last one, if any, went to a load)
            state.pinned = True  # from now on something may be pinned: released at the end
            state.pin_generation += 1
        wanted = self._rank_keys(keys[first:hit])
        try:
            counts = self._pool.call(partial(_pin_ranks, keys=wanted, owners=self._owners(state)))
        except Exception as exc:  # an unprotected hit is still a hit
            self.counters["pin_errors"] += 1
            self._warn(f"pin failed, the hit is not protected: {type(exc).__name__}: {exc}")
            return hit
        # in blocks, like the other counters: a block is pinned once per rank's group
        self.counters["pinned_blocks"] += sum(counts) // self._groups.reads_per_chunk
        if all(n == len(w) for n, w in zip(counts, wanted, strict=True)):
            return hit
        # A chunk left between the probe and the pin; the pinned ones cannot leave now, so
        # a second probe gives a hit that stays.
        try:
            found = self._pool.call(partial(_present_prefix, keys=self._groups.keys(keys[:hit])))
        except Exception:
            return first
        return max(first, min(hit, found))

    def _release(self, state: _Request) -> None:
        """End the request's pins now (best effort: the TTL ends them otherwise)."""
        if not state.pinned:
            return
        state.pinned = False
        try:
            self._pool.call(partial(_release_ranks, owners=self._owners(state)))
        except Exception as exc:
            self.counters["pin_errors"] += 1
            self._warn(f"release of pins failed, they end at their TTL: {exc}")

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` into the blocks vLLM just allocated."""
        state = self._state(request)
        if state.query_tokens:
            self.counters["lookups"] += 1
            self.counters["query_tokens"] += state.query_tokens
            self.counters["hit_tokens"] += max(num_external_tokens, 0)
            state.query_tokens = 0
        if num_external_tokens <= 0:
            self._release(state)  # vLLM admitted it without a load: the pins served nothing
            return
        if state.local_tokens % self._bs or num_external_tokens % self._bs:
            raise ValueError(
                f"store connector: hit of {num_external_tokens} tokens after"
                f" {state.local_tokens} local ones is not block-aligned ({self._bs})"
            )
        first = state.local_tokens // self._bs
        end = first + num_external_tokens // self._bs
        keys = self._keys_upto(state, end)
        spec = LoadSpec(
            req_id=state.req_id,
            block_ids=tuple(block_ids[first:end]),
            keys=self._groups.keys(keys[first:end]),
            is_async=self._load_async,
            owners=self._owners(state) if state.pinned else (),
        )
        state.pinned = False  # the workers release them once they have loaded
        state.load = spec
        self._pending_loads = [s for s in self._pending_loads if s.req_id != state.req_id]
        self._pending_loads.append(spec)

    # ------------------------------------------------------------------ per step

    def build_plan(self, scheduler_output: Any) -> StorePlan:
        """This step's loads and saves; resets the pending loads."""
        scheduled: list[tuple[_Request, int]] = []
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:  # not seen by lookup (should not happen): save nothing for it
                continue
            state.block_ids = list(new.block_ids[0])
            scheduled.append((state, new.num_computed_tokens + num_scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            scheduled.append((state, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)))
        saves = [s for s in (self._save_spec(st, done) for st, done in scheduled) if s is not None]
        loads, self._pending_loads = self._pending_loads, []
        return StorePlan(loads=tuple(loads), saves=tuple(saves))

    def _save_spec(self, state: _Request, computed_after_step: int) -> SaveSpec | None:
        if not self._saves or state.namespace is None:
            return None
        full = min(
            computed_after_step // self._bs,
            len(state.block_ids),
            len(state.tokens()) // self._bs,
        )
        start = state.saved_blocks
        if full <= start:
            return None
        keys = self._keys_upto(state, full)
        state.saved_blocks = full
        return SaveSpec(
            req_id=state.req_id,
            block_ids=tuple(state.block_ids[start:full]),
            keys=self._groups.keys(keys[start:full]),
            parents=tuple(
                self._groups.column_key(keys[start - 1], c) if start else None
                for c in range(self._groups.num_columns)
            ),
        )

    def on_load_errors(self, invalid_block_ids: Iterable[int]) -> None:
        """Blocks that failed to load will be recomputed: save them again afterwards."""
        invalid = set(invalid_block_ids)
        if not invalid:
            return
        for state in self._requests.values():
            if state.load is None:
                continue
            for i, block_id in enumerate(state.load.block_ids):
                if block_id in invalid:
                    first = state.local_tokens // self._bs
                    state.saved_blocks = min(state.saved_blocks, first + i)
                    break

    def request_finished(self, request: Any) -> None:
        # A planned load stays planned even if the request was aborted meanwhile: vLLM
        # holds its blocks until the worker reports the load finished, so the worker must
        # see it (it skips the copy of a request it knows is finished).  Its pins are then
        # the worker's to release; those of a lookup that led to no load end here.
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._release(state)

    def close(self) -> None:
        """Close the scheduler's pool connection (pins still held end at their TTL)."""
        self._pool.close()

    @property
    def num_tracked(self) -> int:
        """Live requests remembered (tests check that finished ones are forgotten)."""
        return len(self._requests)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            self._log.warning("[KVPoolStoreConnector] %s", message)

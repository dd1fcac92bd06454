"""The scheduler half of the store connector: lookups, load plans, save plans.

Runs in vLLM's engine-core process and never touches KV bytes.  ``prefix_lookup`` takes no
lease, so probing never pins anything; the blocks to load are pinned separately.  Requests
are duck-typed (vLLM 0.32's attributes), so this module imports nothing from vLLM.
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

from kvpool.connectors.store.groups import STATE, CacheGroups, HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys
from kvpool.engines import POOL_TTL, PoolLookups

__all__ = ["SavedChunk", "StoreScheduler", "pin_owner"]

_WARN_EVERY_S = 30.0


def _present_prefix(pool: PoolLookups, keys: Sequence[Sequence[str]]) -> int:
    """Leading chunks present for every column (probing only: no lease is taken)."""
    if len(keys) == 1:
        return pool.prefix_lookup(keys[0])
    n = len(keys[0])
    found = n
    for row in _present(pool, keys):
        found = min(found, row.index(False) if False in row else n)
    return found


def _present(pool: PoolLookups, keys: Sequence[Sequence[str]]) -> list[list[bool]]:
    """Which chunks each column's keys name the pool holds: one round trip for all."""
    flags = pool.batch_exists([k for column in keys for k in column])
    n = len(keys[0]) if keys else 0
    return [list(flags[c * n : (c + 1) * n]) for c in range(len(keys))]


@dataclass(frozen=True, slots=True)
class SavedChunk:
    """A chunk this instance is putting into the pool, as a KV event says it (vLLM's
    ``BlockStored``, medium CPU): its key, its parent's (None at the prompt's start), its
    tokens; or, ``removed``, a chunk found unreadable and dropped."""

    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    removed: bool = False


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
    block_ids: list[list[int]] = field(default_factory=list)  # per cache group
    keys: list[BlockKey] = field(default_factory=list)  # the chain: one key per full chunk
    namespace: KeyNamespace | None = None  # None: not cacheable by tokens
    local_tokens: int = 0  # vLLM's own prefix-cache hit at lookup time
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the pool or being written
    # state groups (hybrid models): the chunks whose state the pool holds or is given
    states: set[tuple[int, int]] = field(default_factory=set)
    query_tokens: int = 0  # the last lookup's query size, until vLLM admits the request
    loads: tuple[LoadSpec, ...] = ()  # the last load planned, to map failed blocks back
    pinned: bool = False  # holds pins the scheduler must release (not handed to a load)
    pin_generation: int = 0  # of the owners: one more for each set handed to a load

    def tokens(self) -> Sequence[int]:
        return self.request.all_token_ids  # type: ignore[no-any-return]


# Rules:
# - Keys come from kvpool.core.keys.chunk_keys over the request's token ids, one chain
#   whatever the TP layout, and one pool object per chunk, KV cache group and KV-head group
#   (.groups); never from vLLM's block hashes (seeded per process).
# - A chunk is a hit only if every head group is present (the reader's ranks together need
#   every head).  With several KV cache groups (a hybrid model) the hit is what the
#   groups' rule allows (CacheGroups.rule: vLLM's own, a window needing only its tail and
#   a recurrent state only the block at the hit), and each group loads only the blocks
#   vLLM allocated for it (it leaves the rest null).
# - A hybrid model's state groups save only the states vLLM names at block boundaries
#   (its boundary-state hand-offs, vLLM ≥ 0.32): a state block holds no position-fixed KV.
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
        groups: CacheGroups | HeadGroups | None = None,
        events: bool = False,
        read_your_writes: bool = True,
    ) -> None:
        """``events``: keep a :class:`SavedChunk` per chunk saved or dropped, for vLLM's KV
        events (:meth:`take_events`); ``read_your_writes``: name the requests whose saves a
        step must see committed (:attr:`StorePlan.commit`)."""
        self._read_your_writes = read_your_writes
        self._ns = namespace
        if not isinstance(groups, CacheGroups):  # one KV cache group: its head groups
            groups = CacheGroups.single(groups)
        self._cache_groups = groups
        self._groups = groups[0].heads  # the one group's head groups (hybrid: unused)
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
        self._events: list[SavedChunk] | None = [] if events else None

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

    def _rank_keys(
        self, chain: Sequence[BlockKey], held: Sequence[Sequence[bool]] | None = None
    ) -> list[list[str]]:
        """Per rank, the pool keys of the columns it loads for ``chain``, column by column
        (every cache group's; ``held[g][i]``: only the chunks group g holds)."""
        out: list[list[str]] = [[] for _ in range(self._cache_groups.tp_size)]
        for g, group in enumerate(self._cache_groups):
            heads = group.heads
            chunks = [
                self._cache_groups.chunk_key(k, g)
                for i, k in enumerate(chain)
                if held is None or held[g][i]
            ]
            for rank in range(heads.tp_size):
                out[rank].extend(
                    heads.column_key(k, c)
                    for slot in heads.reads(rank)
                    for c in heads.columns(slot)
                    for k in chunks
                )
        return out

    def _probe(self, keys: list[BlockKey]) -> tuple[int, list[list[bool]] | None]:
        """Chunks of ``keys`` present for every column, counted from the start (one KV
        cache group), or (hybrid) the presence of each group's chunks, with -1."""
        if not self._cache_groups.hybrid:
            found = self._pool.call(partial(_present_prefix, keys=self._groups.keys(keys)))
            return found, None
        columns = [self._cache_groups.keys(g, keys) for g in range(len(self._cache_groups))]
        flat = [column for group in columns for column in group]
        rows = self._pool.call(partial(_present, keys=flat))
        present: list[list[bool]] = []
        for group in columns:
            taken, rows = rows[: len(group)], rows[len(group) :]
            present.append([all(flags) for flags in zip(*taken, strict=True)])
        return -1, present

    def _hybrid_hit(
        self, state: _Request, present: list[list[bool]], local: int, limit: int
    ) -> int:
        """The hit, in chunks, of a hybrid model: chunks vLLM holds count as held."""
        held = [[i < local or p for i, p in enumerate(row)] for row in present]
        # what the pool holds needs no save: attention groups from the leading run they
        # all hold, state groups chunk by chunk
        runs = [
            row.index(False) if False in row else len(row)
            for row, group in zip(held, self._cache_groups, strict=True)
            if group.kind != STATE
        ]
        state.saved_blocks = max(state.saved_blocks, min(runs, default=0))
        for g, group in enumerate(self._cache_groups):
            if group.kind == STATE:
                state.states.update((g, i) for i, p in enumerate(present[g]) if p)
        return max(0, min(self._cache_groups.rule(held, limit), limit))

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
        usable_blocks = self._usable_blocks(n_tokens)
        if min(usable_blocks * self._bs, n_tokens - 1) <= num_computed_tokens:
            return 0, False
        # Probe every full block (not just the usable ones) so that a block the pool holds
        # is not written again after the request computes it.
        keys = self._keys_upto(state, n_tokens // self._bs)
        state.query_tokens = 0
        try:
            found, present = self._probe(keys)
        except Exception as exc:  # any pool failure is a miss, never a failed request
            self.counters["lookup_errors"] += 1
            self._warn(f"lookup failed, treating as a miss: {type(exc).__name__}: {exc}")
            return 0, False
        # Counted when vLLM admits the request (update_state_after_alloc): a request that
        # waits for memory is asked about again each step and must not count twice.
        state.query_tokens = n_tokens - num_computed_tokens
        local = num_computed_tokens // self._bs
        if present is None:
            state.saved_blocks = max(state.saved_blocks, found)
            hit_blocks = max(0, min(found, usable_blocks))
        else:
            hit_blocks = self._hybrid_hit(state, present, local, usable_blocks)
        if self._pin_hits and hit_blocks * self._bs > num_computed_tokens:
            hit_blocks = self._pin_hit(state, keys, local, hit_blocks, present)
        new_tokens = min(hit_blocks * self._bs, n_tokens - 1) - num_computed_tokens
        if new_tokens <= 0:
            return 0, False
        return new_tokens, self._load_async

    def _usable_blocks(self, n_tokens: int) -> int:
        """The most blocks a hit may load.  vLLM must compute a prompt's last token; its
        own cache therefore never reuses the last block, and computes all of it again.  A
        prompt that ends on a block boundary loads its last block from the pool instead
        and computes only the last token (one token where vLLM's own hit computes a
        block).  Not for a hybrid model: a state or a window is at block boundaries only."""
        if n_tokens % self._bs == 0 and not self._cache_groups.hybrid:
            return n_tokens // self._bs
        return (n_tokens - 1) // self._bs

    def _owners(self, state: _Request) -> tuple[str, ...]:
        gen = state.pin_generation
        ranks = range(self._cache_groups.tp_size)
        return tuple(pin_owner(self._scope, state.req_id, r, gen) for r in ranks)

    # A hit is pinned for its request (owner: pin_owner, one per rank, named in the LoadSpec
    # so the worker can release it; a rank pins the groups it will load), for the pool's lease
    # TTL (default_kv_lease_ttl): the probe itself stays lease-free, so probing never starves
    # eviction, but what a request is about to load is not evicted under it.  A pin ends when
    # the worker has loaded the blocks, at once when vLLM admits the request without a load,
    # when the request finishes or aborts, or at the TTL, whichever comes first.  A block gone
    # between the probe and the pin shortens the hit (asked again, now that the rest is
    # pinned); a failed pin leaves the hit unprotected.
    def _pin_hit(
        self,
        state: _Request,
        keys: list[BlockKey],
        first: int,
        hit: int,
        present: list[list[bool]] | None = None,
    ) -> int:
        """Pin chunks [first, hit) of every group for the request, each rank's groups under
        its own owner; the hit that stays (shorter
        when a chunk went away between the probe and the pin).  A hybrid model pins the
        chunks each cache group holds in that range (``present``)."""
        if not state.pinned:  # a new set of pins (the last one, if any, went to a load)
            state.pinned = True  # from now on something may be pinned: released at the end
            state.pin_generation += 1
        held = None if present is None else [row[first:hit] for row in present]
        wanted = self._rank_keys(keys[first:hit], held)
        try:
            counts = self._pool.call(partial(_pin_ranks, keys=wanted, owners=self._owners(state)))
        except Exception as exc:  # an unprotected hit is still a hit
            self.counters["pin_errors"] += 1
            self._warn(f"pin failed, the hit is not protected: {type(exc).__name__}: {exc}")
            return hit
        # in blocks, like the other counters: a block is pinned once per rank's group
        per_chunk = sum(g.heads.reads_per_chunk for g in self._cache_groups)
        self.counters["pinned_blocks"] += sum(counts) // per_chunk
        if all(n == len(w) for n, w in zip(counts, wanted, strict=True)):
            return hit
        # A chunk left between the probe and the pin; the pinned ones cannot leave now, so
        # a second probe gives a hit that stays.
        try:
            found, again = self._probe(keys[:hit])
        except Exception:
            return first
        if again is not None:
            found = self._hybrid_hit(state, again, first, hit)
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
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` into the blocks vLLM just allocated
        (``block_ids``: one list per vLLM KV cache group)."""
        state = self._state(request)
        if state.query_tokens:
            self.counters["lookups"] += 1
            self.counters["query_tokens"] += state.query_tokens
            self.counters["hit_tokens"] += max(num_external_tokens, 0)
            state.query_tokens = 0
        if num_external_tokens <= 0:
            self._release(state)  # vLLM admitted it without a load: the pins served nothing
            return
        # aligned, or the whole prompt but its last token (:meth:`_usable_blocks`)
        upto = state.local_tokens + num_external_tokens
        whole = (
            upto + 1 == int(request.num_tokens) and self._usable_blocks(upto + 1) * self._bs > upto
        )
        if state.local_tokens % self._bs or (num_external_tokens % self._bs and not whole):
            raise ValueError(
                f"store connector: hit of {num_external_tokens} tokens after"
                f" {state.local_tokens} local ones is not block-aligned ({self._bs})"
            )
        first = state.local_tokens // self._bs
        end = -(-upto // self._bs)
        keys = self._keys_upto(state, end)
        owners = self._owners(state) if state.pinned else ()
        specs = []
        for g, group in enumerate(self._cache_groups):
            ids = list(block_ids[group.group_id][first:end])
            # vLLM leaves null (block 0) what a group does not need for the hit: the
            # chunks a window no longer sees, every state but the last
            chunks = [i for i, b in enumerate(ids) if b or not self._cache_groups.hybrid]
            if not chunks:
                continue
            columns = self._cache_groups.keys(g, [keys[first + i] for i in chunks])
            specs.append(
                LoadSpec(
                    req_id=state.req_id,
                    block_ids=tuple(ids[i] for i in chunks),
                    keys=columns,
                    is_async=self._load_async,
                    owners=owners,
                    group=g,
                )
            )
        state.pinned = False  # the workers release them once they have loaded
        state.loads = tuple(specs)
        self._pending_loads = [s for s in self._pending_loads if s.req_id != state.req_id]
        self._pending_loads.extend(specs)

    # ------------------------------------------------------------------ per step

    def _group_ids(self, ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """vLLM's per-group block lists, in the order of this connector's cache groups."""
        return [list(ids[g.group_id]) for g in self._cache_groups]

    def build_plan(self, scheduler_output: Any) -> StorePlan:
        """This step's loads and saves; resets the pending loads."""
        scheduled: list[tuple[_Request, int]] = []
        before: dict[str, int] = {}  # computed tokens before this step
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:  # not seen by lookup (should not happen): save nothing for it
                continue
            state.block_ids = self._group_ids(new.block_ids)
            before[new.req_id] = new.num_computed_tokens
            scheduled.append((state, new.num_computed_tokens + num_scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = self._group_ids(new_ids) if new_ids is not None else []
            elif new_ids is not None:
                for mine, more in zip(state.block_ids, self._group_ids(new_ids), strict=True):
                    mine.extend(more)
            before[req_id] = cached.num_computed_tokens[i]
            scheduled.append((state, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)))
        # vLLM ≥ 0.32 offers a producer its current block tables (a window frees and nulls
        # blocks in place, which the append-only mirror above cannot see) and the exact
        # blocks of the recurrent states it caches: a hybrid model saves from those.
        tables = getattr(scheduler_output, "kv_connector_block_state", None)
        saves: list[SaveSpec] = []
        for state, done in scheduled:
            if self._cache_groups.hybrid and tables is not None:
                current = tables.get_block_ids(state.req_id)
                if current is not None:
                    state.block_ids = self._group_ids(current)
            saves.extend(self._save_specs(state, done))
        if self._cache_groups.hybrid and tables is not None:
            saves.extend(self._state_saves(tables.boundary_state_offloads))
        commit = tuple(
            s.req_id for s, done in scheduled if self._may_end(s, before[s.req_id], done)
        )
        loads, self._pending_loads = self._pending_loads, []
        return StorePlan(loads=tuple(loads), saves=tuple(saves), commit=commit)

    def _may_end(self, state: _Request, before: int, done: int) -> bool:
        """Whether the request's answer may be complete after this step, with saves of its
        own in the pool's way (read-your-writes).  Not its first token's step unless that
        is its last allowed one (a P/D prefill's ``max_tokens: 1``): waiting there would
        add the last chunk's put to every TTFT, and the step after it waits instead."""
        if not self._read_your_writes or not state.saved_blocks:
            return False
        prompt = int(state.request.num_prompt_tokens)
        if done < prompt:
            return False
        if before >= prompt:  # decoding: any step may sample its last token
            return True
        left = getattr(state.request, "max_tokens", None)
        return isinstance(left, int) and left - int(state.request.num_output_tokens) <= 1

    def _save_specs(self, state: _Request, computed_after_step: int) -> list[SaveSpec]:
        """The saves of the blocks this step completes (attention groups; one cache group:
        that group's)."""
        if not self._saves or state.namespace is None or not state.block_ids:
            return []
        full = min(
            computed_after_step // self._bs,
            min(len(ids) for ids in state.block_ids),
            len(state.tokens()) // self._bs,
        )
        start = state.saved_blocks
        if full <= start:
            return []
        keys = self._keys_upto(state, full)
        state.saved_blocks = full
        self._note_saved(state, keys, start, full)
        specs = []
        for g, group in enumerate(self._cache_groups):
            if group.kind == STATE:
                continue  # states are saved where vLLM names them (_state_saves)
            ids = state.block_ids[g][start:full]
            # a hybrid group's null blocks hold nothing (a window's skipped chunks)
            chunks = [i for i, b in enumerate(ids) if b or not self._cache_groups.hybrid]
            if not chunks:
                continue
            heads = group.heads
            columns = self._cache_groups.keys(g, [keys[start + i] for i in chunks])
            before = start + chunks[0] - 1
            parent = self._cache_groups.chunk_key(keys[before], g) if before >= 0 else None
            specs.append(
                SaveSpec(
                    req_id=state.req_id,
                    block_ids=tuple(ids[i] for i in chunks),
                    keys=columns,
                    parents=tuple(
                        None if parent is None else heads.column_key(parent, c)
                        for c in range(heads.num_columns)
                    ),
                    group=g,
                )
            )
        return specs

    # The pool's KV events are the scheduler's: vLLM's MultiConnector passes a child's
    # scheduler events on (take_events) but not its workers' (the production guide's layout
    # runs this connector under it).  A chunk counts as saved when planned; a save that
    # then fails only makes a router predict a hit that is not there, which it notices.
    # Requests with a namespace of their own (LoRA, cache_salt, tenants) say nothing: a
    # router that keys blocks by tokens alone would take their blocks for anyone's.
    def _note_saved(self, state: _Request, keys: Sequence[BlockKey], start: int, end: int) -> None:
        if self._events is None or state.namespace is not self._ns:
            return
        tokens = state.tokens()
        for i in range(start, end):
            parent = keys[i - 1].digest if i else None
            chunk = tuple(tokens[i * self._bs : (i + 1) * self._bs])
            self._events.append(SavedChunk(keys[i].digest, parent, chunk))

    def take_events(self) -> list[SavedChunk]:
        """The chunks saved and dropped since the last call (see :class:`SavedChunk`)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _state_saves(self, offers: dict[str, list[tuple[int, int, int]]]) -> list[SaveSpec]:
        """Saves of the recurrent states vLLM cached this step: ``offers[req_id]`` is
        ``(vLLM group id, block id, tokens)``, the block holding the state after
        ``tokens``.  Only whole chunks have a key; a state the pool has is not saved."""
        position = {g.group_id: i for i, g in enumerate(self._cache_groups)}
        specs = []
        for req_id, entries in offers.items():
            state = self._requests.get(req_id)
            if not self._saves or state is None or state.namespace is None:
                continue
            for group_id, block_id, tokens in entries:
                g = position.get(group_id)
                if g is None or not block_id or tokens % self._bs or tokens <= 0:
                    continue
                chunk = tokens // self._bs - 1
                if self._cache_groups[g].kind != STATE or (g, chunk) in state.states:
                    continue
                if len(state.tokens()) < tokens:
                    continue
                key = self._keys_upto(state, chunk + 1)[chunk]
                state.states.add((g, chunk))
                heads = self._cache_groups[g].heads
                specs.append(
                    SaveSpec(
                        req_id=req_id,
                        block_ids=(block_id,),
                        keys=self._cache_groups.keys(g, [key]),
                        parents=(None,) * heads.num_columns,
                        group=g,
                    )
                )
        return specs

    def on_load_errors(self, invalid_block_ids: Iterable[int]) -> None:
        """Blocks that failed to load will be recomputed: save them again afterwards."""
        invalid = set(invalid_block_ids)
        if not invalid:
            return
        for state in self._requests.values():
            if len(state.loads) != 1:
                continue  # no load, or a hybrid one (failures come per request)
            for i, block_id in enumerate(state.loads[0].block_ids):
                if block_id in invalid:
                    first = state.local_tokens // self._bs
                    state.saved_blocks = min(state.saved_blocks, first + i)
                    self._note_dropped(state, first + i)
                    break

    def on_failed_loads(self, req_ids: Iterable[str]) -> None:
        """Requests whose load failed as a whole (a hybrid model's): vLLM recomputes them
        from the start, so everything they compute is saved again."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None and state.loads:
                state.saved_blocks = min(state.saved_blocks, state.local_tokens // self._bs)
                state.states.clear()
                self._note_dropped(state, state.local_tokens // self._bs)

    def _note_dropped(self, state: _Request, chunk: int) -> None:
        """A load failed from ``chunk`` on: the pool no longer has it as it was."""
        if self._events is not None and state.namespace is self._ns and chunk < len(state.keys):
            self._events.append(SavedChunk(state.keys[chunk].digest, None, (), removed=True))

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

"""Random operation sequences against the index, checking its invariants after every step."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.core.eviction import EVICTION_POLICIES
from kvpool.core.index import ObjectIndex
from kvpool.core.objects import Demote, Dropped, IndexConfig, NoRoom, State
from kvpool.core.registry import Tier
from kvpool.errors import KVPoolError, NoSpace

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
OWNERS = st.sampled_from(["r1", "r2", "r3"])
WRITERS = st.sampled_from(["w1", "w2"])
SIZES = st.sampled_from([8, 16, 24])


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(EVICTION_POLICIES),
        offload=st.booleans(),
        watermark=st.sampled_from([0.5, 0.9, 1.0]),
        ratio=st.sampled_from([0.1, 0.5]),
        deferred=st.booleans(),
    )
    def setup(
        self, policy: str, offload: bool, watermark: float, ratio: float, deferred: bool
    ) -> None:
        self.idx = ObjectIndex(
            IndexConfig(
                high_watermark=watermark,
                eviction_ratio=ratio,
                lease_ttl_ms=50,
                writer_ttl_ms=80,
                client_ttl_ms=10_000,
                enable_offload=offload,
                policy=policy,
            )
        )
        self.now = 0
        for node in ("n1", "n2"):
            self.idx.register_client(node, 0)
            self.idx.add_segment(node, f"{node}/mem", 64)
            if offload:
                self.idx.add_segment(node, f"{node}/ssd", 48, Tier.SSD)
        self.deferred = deferred  # n1 is a node whose copies are in flight until reported
        if deferred:
            self.idx.defer_copies("n1")
        self.leased: dict[str, int] = {}  # key -> latest lease expiry granted in the test
        self.copies: list[Demote] = []  # in-flight copies not reported yet

    def _observe(self, events: list[Dropped | Demote]) -> None:
        for e in events:
            if isinstance(e, Dropped) and e.reason == "evicted":
                # a leased object is never evicted
                assert self.leased.get(e.key, -1) <= self.now, f"evicted leased {e.key}"
                self.leased.pop(e.key, None)
            if isinstance(e, Demote):
                assert self.leased.get(e.key, -1) <= self.now, f"demoted leased {e.key}"
                assert e.in_flight == (e.src.client_id == "n1" and self.deferred)
                if e.in_flight:
                    self.copies.append(e)
                    assert self.idx.exists(e.key)  # its bytes are still held: visible

    @rule(dt=st.integers(0, 40))
    def advance(self, dt: int) -> None:
        self.now += dt
        self.idx.heartbeat("n1", self.now)
        self.idx.heartbeat("n2", self.now)
        self._observe(self.idx.tick(self.now))
        for tier in Tier:
            capacity, used = self.idx.usage(tier)
            used -= self.idx._placer.leaving_of(tier)  # copies in flight count as gone
            if capacity and used >= self.idx.config.high_watermark * capacity:
                # still over: then nothing evictable may be left in the tier
                assert self.idx._evictable_count(tier, self.now) == 0

    @rule(
        key=KEYS, size=SIZES, writer=WRITERS, commit=st.booleans(), copies=st.sampled_from([1, 2])
    )
    def put(self, key: str, size: int, writer: str, commit: bool, copies: int) -> None:
        try:
            res, events = self.idx.put_start(key, size, writer, self.now, replicas=copies)
        except NoRoom as exc:
            self._observe(exc.events)
            return
        except NoSpace:
            return
        except KVPoolError:
            return
        self._observe(events)
        if res is not None and commit:
            self.idx.put_end(key, writer, self.now)

    @rule(key=KEYS, writer=WRITERS, node=st.sampled_from(["n1", "n2"]))
    def finish_one_copy_unwritten(self, key: str, writer: str, node: str) -> None:
        with contextlib.suppress(KVPoolError):
            self.idx.put_end(key, writer, self.now, 0, [f"{node}/mem"])

    @rule(key=KEYS, pick=st.integers(0, 1))
    def corrupt(self, key: str, pick: int) -> None:
        copies = self.idx.copies_of(key)
        if self.idx.state_of(key) is not State.READY or pick >= len(copies):
            return
        where = copies[pick]
        before = len(copies)
        checksum = self.idx._objects[key].checksum
        self.idx.drop_corrupt(key, where.segment_id, where.offset, checksum)
        after = self.idx.copies_of(key)
        assert len(after) == before - 1 and where not in after  # only that copy went

    @rule()
    def lose_n2(self) -> None:
        """n2 dies and comes back empty: objects with a copy on n1 stay."""
        kept = {k for k in list(self.idx._objects) if any(
            loc.client_id == "n1" for loc in self.idx.copies_of(k))}  # fmt: skip
        self.idx.remove_client("n2")
        assert all(self.idx.state_of(k) is not None for k in kept)
        self.idx.register_client("n2", self.now)
        self.idx.add_segment("n2", "n2/mem", 64)
        if self.idx.config.enable_offload:
            self.idx.add_segment("n2", "n2/ssd", 48, Tier.SSD)

    @rule(key=KEYS, writer=WRITERS)
    def finish(self, key: str, writer: str) -> None:
        with contextlib.suppress(KVPoolError):
            self.idx.put_end(key, writer, self.now)

    @rule(key=KEYS, writer=WRITERS)
    def revoke(self, key: str, writer: str) -> None:
        with contextlib.suppress(KVPoolError):
            self.idx.put_revoke(key, writer)

    @rule(key=KEYS, owner=OWNERS)
    def get(self, key: str, owner: str) -> None:
        visible = self.idx.exists(key)
        was = self.idx.state_of(key)
        try:
            grant = self.idx.get(key, owner, self.now)
        except KVPoolError:
            assert not visible and was in (None, State.PENDING)  # never a miss for bytes held
            return
        assert visible
        if was is State.DEMOTING:  # taken back from its copy: read where its bytes are
            assert self.idx.state_of(key) is State.READY
            assert grant.location.tier is Tier.MEMORY
        self.leased[key] = max(self.leased.get(key, 0), grant.lease_expiry_ms)

    @rule(owner=OWNERS)
    def release_owner(self, owner: str) -> None:
        self.idx.release_owner(owner)
        # the test no longer knows who holds what precisely; forget conservatively
        self.leased = {k: e for k, e in self.leased.items() if self.idx.location_of(k)}
        for key in list(self.leased):
            obj = self.idx._objects.get(key)
            if obj is None or not obj.held(self.now):
                del self.leased[key]

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        try:
            self.idx.remove(key, self.now)
        except KVPoolError:
            return
        assert self.leased.get(key, -1) <= self.now, "removed a leased object"

    @rule(
        key=KEYS,
        size=SIZES,
        node=st.sampled_from(["n1", "n2"]),
        ssd=st.booleans(),
        offset=st.integers(0, 56),
    )
    def restore(self, key: str, size: int, node: str, ssd: bool, offset: int) -> None:
        segment_id = f"{node}/ssd" if ssd else f"{node}/mem"
        if segment_id not in self.idx.registry.segments:
            return
        before = self.idx.location_of(key)
        ok = self.idx.restore(key, segment_id, offset, size, 5, self.now)
        after = self.idx.location_of(key)
        if before is not None:
            assert after == before  # a known object is never moved or replaced
            return
        assert ok == (after is not None)
        if after is not None:
            assert after.segment_id == segment_id and after.size == size
            assert ssd or after.offset == offset  # memory: exactly where its bytes are
            assert self.idx.exists(key)

    @rule(pick=st.integers(0, 5), done=st.booleans())
    def report_copy(self, pick: int, done: bool) -> None:
        if not self.copies:
            return
        copy = self.copies.pop(pick % len(self.copies))
        was = self.idx.state_of(copy.key)
        if done:
            ok = self.idx.demote_done(copy)
            assert not ok or self.idx.location_of(copy.key) == copy.dst
        else:
            gone = self.idx.demote_abandoned(copy)
            assert gone is None or self.idx.state_of(copy.key) is None
            ok = gone is not None
        assert not ok or was is State.DEMOTING

    @rule(stalled=st.booleans())
    def stall(self, stalled: bool) -> None:
        self.idx.stall_copies("n1", stalled)

    @rule(keys=st.lists(KEYS, max_size=6))
    def prefix(self, keys: list[str]) -> None:
        leases_before = self.idx.active_leases(self.now)
        n = self.idx.prefix_lookup(keys)
        assert all(self.idx.exists(k) for k in keys[:n])
        assert n == len(keys) or not self.idx.exists(keys[n])
        assert self.idx.active_leases(self.now) == leases_before

    @invariant()
    def structure(self) -> None:
        if not hasattr(self, "idx"):
            return
        self.idx.check()
        for key in [f"k{i}" for i in range(12)]:
            state = self.idx.state_of(key)
            assert self.idx.exists(key) == (state in (State.READY, State.DEMOTING))
            assert self.idx.prefix_lookup([key]) == int(self.idx.exists(key))


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

from __future__ import annotations

import warnings
from collections import Counter

# Importing vLLM's metrics module imports torch modules that warn about their own
# deprecations; pytest turns warnings into errors, so import it with them silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpool.connectors.store.stats import COUNTERS, KVPoolStoreStats


def test_counts_become_stats_with_a_hit_rate() -> None:
    counters: Counter[str] = Counter()
    assert KVPoolStoreStats.from_counts(counters) is None
    counters["lookups"] += 2
    counters["query_tokens"] += 400
    counters["hit_tokens"] += 100
    stats = KVPoolStoreStats.from_counts(counters)
    assert stats is not None
    reduced = stats.reduce()
    assert reduced["hit_rate"] == 0.25 and reduced["lookups"] == 2
    assert set(COUNTERS) <= set(reduced)


def test_aggregate_sums_worker_and_scheduler_counts() -> None:
    a = KVPoolStoreStats(data={"hit_tokens": 5, "loaded_blocks": 1})
    b = KVPoolStoreStats(data={"hit_tokens": 7, "saved_blocks": 3})
    assert a.aggregate(b) is a
    assert a.data["hit_tokens"] == 12 and a.data["saved_blocks"] == 3
    assert not a.is_empty()
    a.reset()
    assert a.is_empty() and a.reduce()["hit_rate"] == 0.0

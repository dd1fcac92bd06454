from __future__ import annotations

import warnings

# vLLM's metrics module imports torch modules that warn about their own deprecations
# (pytest turns warnings into errors), as in test_store_stats.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpool.connectors.transfer.stats import COUNTERS, KVPoolTransferStats


def test_counters_start_at_zero_and_sum_across_workers() -> None:
    a = KVPoolTransferStats(data={"pulls": 2, "pulled_bytes": 100})
    b = KVPoolTransferStats(data={"pulls": 1, "holds": 3})
    assert set(a.data) == set(COUNTERS)
    a.aggregate(b)
    reduced = a.reduce()
    assert reduced["pulls"] == 3 and reduced["pulled_bytes"] == 100 and reduced["holds"] == 3
    assert not a.is_empty()
    a.reset()
    assert a.is_empty() and a.reduce() == dict.fromkeys(COUNTERS, 0)


def test_nothing_counted_is_no_report() -> None:
    assert KVPoolTransferStats.from_counts({}) is None
    stats = KVPoolTransferStats.from_counts({"served_pulls": 1})
    assert stats is not None and stats.reduce()["served_pulls"] == 1

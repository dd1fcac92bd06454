"""bench/pd_latency.py's own arithmetic: percentiles, the proxy's Server-Timing header, and
the rows (added ms and ratios against the direct rows of the same prompt kind).  The
stack itself is run by the benchmark, not here (it takes minutes to start on two cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.pd_latency import _REPORTED, percentile, server_timing, summarize, table
from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.testing.closes import closed_at_end
from tests.connectors.transfer.helpers import caches, config, free_port, recv_job, wait_results


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_server_timing_header_is_parsed_in_ms() -> None:
    assert server_timing("prefill;dur=12.5, decode_first;dur=3.0") == {
        "prefill": 12.5,
        "decode_first": 3.0,
    }
    assert server_timing(None) == {}


def _sample(kind: str, target: str, ms: float | None, **timing: float) -> dict[str, object]:
    return {"kind": kind, "target": target, "ttft_ms": ms, "timing": timing}


def test_rows_compare_the_proxy_with_each_direct_target_of_the_same_kind() -> None:
    samples = [
        *(_sample("repeated", "proxy", 30.0, prefill=10.0, decode_first=18.0) for _ in range(3)),
        *(_sample("repeated", "P", 10.0) for _ in range(3)),
        *(_sample("repeated", "D", 12.0) for _ in range(2)),
        _sample("repeated", "D", None),  # a failed request is counted, not timed
        *(_sample("fresh", "proxy", 200.0) for _ in range(2)),
        *(_sample("fresh", "P", 100.0) for _ in range(2)),
    ]
    rows = {(r["kind"], r["target"]): r for r in summarize(samples)}
    assert set(rows) == {
        ("repeated", "proxy"), ("repeated", "P"), ("repeated", "D"),
        ("fresh", "proxy"), ("fresh", "P"),
    }  # fmt: skip
    p = rows[("repeated", "P")]
    assert p["proxy_added_p50"] == 20.0 and p["proxy_ratio_p50"] == 3.0
    assert rows[("repeated", "D")]["failed"] == 1 and rows[("repeated", "D")]["n"] == 2
    assert rows[("repeated", "proxy")]["prefill_p50"] == 10.0
    assert rows[("fresh", "P")]["proxy_added_p50"] == 100.0
    text = table(list(rows.values()))
    assert "| repeated | P | 3 | 10.0 |" in text
    assert "(1 failed)" in text


@pytest.fixture
def workers() -> Iterator[list[TransferWorker]]:
    with closed_at_end(TransferWorker) as made:
        yield made


def test_d_traces_how_many_steps_a_load_took_to_be_reported(
    workers: list[TransferWorker], caplog: pytest.LogCaptureFixture
) -> None:
    """KVPOOL_TRANSFER_TRACE=1 (which the benchmark sets): the line it reads from D's log."""
    port = free_port()
    for role, p_port, env in (
        ("kv_producer", port, {}),
        ("kv_consumer", port + 100, {"KVPOOL_TRANSFER_TRACE": "1"}),
    ):
        worker = TransferWorker(config(role, p_port), RankInfo(0, 1, 0, 2), env=env)
        worker.register(caches(2, seed=1)[0])
        workers.append(worker)
    p, d = workers
    p.submit(TransferJobs(holds=[HoldJob("p-t1", (2,))]))
    d.submit(TransferJobs(recvs=[recv_job("t1", [1], [2], port)]))
    with caplog.at_level("INFO", logger="vllm.kvpool.transfer"):
        wait_results(d, want_recv="t1")
    [line] = [r.getMessage() for r in caplog.records if "reported request t1" in r.getMessage()]
    match = _REPORTED.search(line)
    assert match is not None and match.group(1) == "t1", line
    assert int(match.group(2)) >= 1 and float(match.group(3)) >= 0, line

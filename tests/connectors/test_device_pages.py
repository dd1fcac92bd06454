"""KV caches on a device, through the same code path on CPU tensors.

``block_pages(..., staged=True)`` / ``byte_pages(..., staged=True)`` send CPU tensors
through :class:`~kvpool.connectors.device_pages.StagedCaches`, the path a CUDA or NPU
cache takes (torch gathers, host staging, copies back); its ``host_bytes`` shows the path
ran.  Meta tensors stand in for device memory where only the choice of path is tested.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.connectors.device_pages import StagedCaches
from kvpool.connectors.pages import PagedCaches, block_pages, byte_pages, page_view
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.engines import PoolEngine, open_engine
from kvpool.errors import ConfigError
from kvpool.testing.closes import closed_at_end
from tests.connectors.transfer.helpers import config, free_port, recv_job, wait_results
from tests.mooncake.host import run_on_mooncake, save_then_load


def kv_caches(seed: int, blocks: int = 12, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(blocks, 4, 4, 6, generator=g).to(dtype) for i in range(3)}


# ------------------------------------------------------------------ choosing the path


def test_the_device_decides_the_path_and_staged_forces_it() -> None:
    assert type(block_pages(kv_caches(1))) is PagedCaches
    assert type(block_pages(kv_caches(1), staged=True)) is StagedCaches
    meta = {"l": torch.empty(8, 2, 16, 8, device="meta")}  # device memory stand-in
    for paged in (block_pages(meta), byte_pages(meta, block_size=16)):
        assert isinstance(paged, StagedCaches) and paged.device.type == "meta"
    with pytest.raises(ConfigError, match=r"KVPoolStoreConnector.*meta.*leave staged unset"):
        block_pages(meta, staged=False)
    mixed = {"a": torch.zeros(8, 2, 16, 8), "b": torch.empty(8, 2, 16, 8, device="meta")}
    with pytest.raises(ConfigError, match=r"KVPoolTransferConnector.*several devices"):
        byte_pages(mixed, block_size=16)
    with pytest.raises(ConfigError, match="block size"):  # the layout checks still apply
        byte_pages({"l": torch.empty(4, 2, 32, 8, device="meta")}, block_size=16)


def test_host_buffers_are_pinned_where_the_device_allows_and_plain_otherwise() -> None:
    assert not block_pages(kv_caches(1), staged=True).pinned  # CPU tensors: nothing to pin
    paged = block_pages({"l": torch.empty(8, 2, 16, 8, device="meta")})
    pages = paged.new_pages(3)  # pinning needs an accelerator; without one, plain memory
    assert pages.shape == (3, 1, paged.layer_page_bytes) and pages.flags.writeable
    assert paged.pinned is torch.accelerator.is_available()


# ------------------------------------------------------------------ whole blocks (store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_staged_gather_and_scatter_match_the_numpy_path(dtype: torch.dtype) -> None:
    src = kv_caches(1, dtype=dtype)
    plain, staged = block_pages(src), block_pages(src, staged=True)
    want, got = plain.new_pages(4), staged.new_pages(4)
    plain.gather([3, 7, 0, 11], want)
    staged.gather([3, 7, 0, 11], got)
    assert got.tobytes() == want.tobytes()
    assert staged.host_bytes == {"to_host": 4 * staged.page_bytes}

    dst_plain, dst_staged = kv_caches(2, dtype=dtype), kv_caches(2, dtype=dtype)
    block_pages(dst_plain).scatter([5, 1, 9, 2], want)
    into = block_pages(dst_staged, staged=True)
    into.scatter([5, 1, 9, 2], got)
    assert into.host_bytes == {"to_device": 4 * into.page_bytes}
    for name in src:
        assert dst_staged[name].view(torch.uint8).equal(dst_plain[name].view(torch.uint8))
        assert dst_staged[name][5].view(torch.uint8).equal(src[name][3].view(torch.uint8))


def test_staged_pages_take_mla_and_other_blocks_first_layouts() -> None:
    for kv in ({"mla": torch.randn(6, 16, 8)}, {"odd": torch.randn(6, 3, 2, 2, 2)}):
        plain, staged = block_pages(kv), block_pages(kv, staged=True)
        want, got = plain.new_pages(2), staged.new_pages(2)
        plain.gather([4, 1], want)
        staged.gather([4, 1], got)
        assert got.tobytes() == want.tobytes() and staged.page_bytes == plain.page_bytes


def test_a_partial_batch_moves_only_its_blocks() -> None:
    src, dst = kv_caches(1), kv_caches(2)
    before = {n: t.clone() for n, t in dst.items()}
    a, b = block_pages(src, staged=True), block_pages(dst, staged=True)
    pages = a.new_pages(4)  # room for 4, as the worker's batch; 2 read back good
    a.gather([1, 2, 3, 4], pages)
    b.scatter([7, 8], pages)
    for name in src:
        assert torch.equal(dst[name][[7, 8]], src[name][[1, 2]])
        assert torch.equal(dst[name][:7], before[name][:7])
        assert torch.equal(dst[name][9:], before[name][9:])


def store_worker(pool: PoolEngine, caches: dict) -> StoreWorker:
    def handle() -> PoolHandle:
        return PoolHandle(lambda: pool, reconnect_interval_s=60, describe="embedded")

    worker = StoreWorker(
        tp_rank=0, pool=handle(), loader_pool=handle(), logger=logging.getLogger("t")
    )
    worker.register(caches)
    worker.paged = block_pages(caches, staged=True)  # the path a device cache takes
    return worker


def test_the_store_worker_moves_staged_pages_through_a_real_pool() -> None:
    pool = open_engine("embedded", capacity=16 << 20)
    try:
        src, dst = kv_caches(1, blocks=40), kv_caches(2, blocks=40)
        keys = tuple(f"k{i:031d}" for i in range(20))  # more than one batch of 16
        saver = store_worker(pool, src)
        saver.save(StorePlan(saves=(SaveSpec("r", tuple(range(20)), (keys,), (None,)),)))
        assert saver.counters["saved_blocks"] == 20
        loader = store_worker(pool, dst)
        targets = tuple(range(39, 19, -1))
        loader.start_loads(StorePlan(loads=(LoadSpec("r2", targets, (keys,), False),)))
        assert loader.take_invalid_block_ids() == set()
        for name in src:
            assert torch.equal(dst[name][list(targets)], src[name][:20])
        assert loader.paged is not None and saver.paged is not None
        assert saver.paged.host_bytes["to_host"] == 20 * saver.paged.page_bytes
        assert loader.paged.host_bytes["to_device"] == 20 * loader.paged.page_bytes
    finally:
        pool.close()


# ------------------------------------------------------------------ page slices (transfer)


def test_staged_sending_and_receiving_match_the_numpy_path() -> None:
    kv = {"l": torch.randn(8, 4, 16, 8)}
    plain, staged = byte_pages(kv, block_size=16), byte_pages(kv, block_size=16, staged=True)
    want = [bytes(v) for v in plain.sending("l", [6, 2], 1, 2)]
    got = staged.sending("l", [6, 2], 1, 2)
    assert [bytes(v) for v in got] == want and all(v.readonly for v in got)
    assert bytes(staged.page("l", 6, 1, 2)) == want[0]

    dst = {"l": torch.zeros(8, 4, 16, 8)}
    into = byte_pages(dst, block_size=16, staged=True)
    with into.receiving("l", [0, 5], 2, 2) as views:
        for view, data in zip(views, want, strict=True):
            view[:] = data
        assert not dst["l"].any()  # staged: nothing reaches the cache before the commit
    assert torch.equal(dst["l"][0, 2:4], kv["l"][6, 1:3])
    assert torch.equal(dst["l"][5, 2:4], kv["l"][2, 1:3])
    assert not dst["l"][:, :2].any() and not dst["l"][[1, 2, 3, 4, 6, 7]].any()


def test_a_receive_that_fails_half_way_writes_nothing() -> None:
    dst = {"l": torch.zeros(8, 2, 16, 8)}
    into = byte_pages(dst, block_size=16, staged=True)
    with pytest.raises(TimeoutError), into.receiving("l", [1, 2], 0, 2) as views:
        views[0][:] = b"\x01" * len(views[0])
        raise TimeoutError("the prefill stopped sending")
    assert not dst["l"].any() and into.host_bytes["to_device"] == 0


@pytest.fixture
def workers() -> Iterator[list[TransferWorker]]:
    with closed_at_end(TransferWorker) as made:
        yield made


def transfer_rank(
    workers: list[TransferWorker], cfg: Any, rank: int, tp: int, seed: int | None, staged: bool
) -> tuple[TransferWorker, dict, PagedCaches]:
    heads = 4 // tp
    g = torch.Generator().manual_seed(seed or 0)
    kv = {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(8, heads, 4, 8, generator=g).to(torch.bfloat16)
            if seed is not None
            else torch.zeros(8, heads, 4, 8, dtype=torch.bfloat16)
        )
        for i in range(2)
    }
    worker = TransferWorker(cfg, RankInfo(rank, tp, 0, 4), time.monotonic)
    paged = byte_pages(kv, block_size=4, staged=staged)
    worker.register(paged)
    workers.append(worker)
    return worker, kv, paged


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_staged", "d_staged"),
    [(1, 1, True, True), (2, 1, True, True), (1, 2, True, True), (2, 1, False, True),
     (1, 2, True, False)],
)  # fmt: skip
def test_pulls_between_staged_caches_reassemble_every_head(
    workers: list[TransferWorker], p_tp: int, d_tp: int, p_staged: bool, d_staged: bool
) -> None:
    port = free_port(p_tp)
    prefill = [
        transfer_rank(workers, config("kv_producer", port, peer_tp=d_tp), r, p_tp, 10 + r, p_staged)
        for r in range(p_tp)
    ]
    decode = [
        transfer_rank(workers, config("kv_consumer", port + 100, peer_tp=p_tp), r, d_tp, None,
                      d_staged)
        for r in range(d_tp)
    ]  # fmt: skip
    for p, _, _ in prefill:
        p.submit(TransferJobs(holds=[HoldJob("p-x", (3, 4, 7))]))
    for d, _, _ in decode:
        d.submit(TransferJobs(recvs=[recv_job("x", [6, 1, 0], [3, 4, 7], port, tp=p_tp)]))
    for d, _, _ in decode:
        assert wait_results(d, want_recv="x").failed_recving == set()
    for name in prefill[0][1]:
        # the full head axis on both sides: every head range landed at its dst_start
        full_p = torch.cat([kv[name][[3, 4, 7]] for _, kv, _ in prefill], dim=1)
        full_d = torch.cat([kv[name][[6, 1, 0]] for _, kv, _ in decode], dim=1)
        assert full_d.view(torch.uint8).equal(full_p.view(torch.uint8))
        for _, kv, _ in decode:
            assert not kv[name][[2, 3, 4, 5, 7]].any()  # nothing else written
    sent = sum(paged.host_bytes["to_host"] for *_, paged in prefill if paged.staged)
    got = sum(paged.host_bytes["to_device"] for *_, paged in decode if paged.staged)
    one_copy = 2 * 3 * 4 * 4 * 8 * 2  # layers x blocks x heads x block_size x row x bf16
    assert sent == (one_copy if p_staged else 0) and got == (one_copy if d_staged else 0)


# ------------------------------------------------------------------ Mooncake's buffers


def staged_mooncake_round_trip(engine: Any) -> dict[str, Any]:
    """In the namespace: the store worker saves and loads staged pages of 16 MiB layers
    (big enough that the engine would register a CPU tensor of that size in place) on
    real Mooncake; and a tensor in (meta) device memory handed to the engine directly."""
    src = {f"l{i}": torch.randint(0, 256, (512, 2, 16, 1024), dtype=torch.uint8) for i in range(2)}
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    keys = tuple(f"page-{i}" for i in range(20))
    saver, loader = store_worker(engine, src), store_worker(engine, dst)
    equal = save_then_load(saver, loader, keys, src, dst)
    assert loader.paged is not None
    staging = loader.paged.new_pages(1)
    assert engine.batch_get_parts(keys[:1], [[page_view(staging[0])]]) == [loader.paged.page_bytes]
    device = torch.empty(1 << 24, dtype=torch.uint8, device="meta")
    try:
        engine.batch_put_parts(["on-device"], [[device]])
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {
        "saved": saver.counters["saved_blocks"],
        "invalid": sorted(loader.take_invalid_block_ids()),
        "equal": equal,
        "staging_equal": staging[0].tobytes() == b"".join(src[n][0].numpy().tobytes() for n in src),
        "regions": len(engine._registered),
        "moved": dict(engine.moved),
        "refused": refused,
        "meta_address": engine._registered.address(device, 1 << 24),
    }


def test_mooncake_moves_staged_pages_and_never_registers_device_memory() -> None:
    r = run_on_mooncake(staged_mooncake_round_trip)
    assert r["saved"] == 20 and r["invalid"] == [] and r["equal"] and r["staging_equal"]
    # pages reach Mooncake as host staging, copied through the engine's own area
    assert r["moved"] == {"put_in_place": 0, "put_staged": 20, "get_in_place": 0, "get_staged": 21}
    assert r["regions"] == 0  # no caller memory registered: not the KV caches, not the device's
    assert "only CPU tensors" in r["refused"] and r["meta_address"] is None

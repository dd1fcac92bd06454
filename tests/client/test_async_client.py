from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.client.async_client import AsyncClient
from kvpool.embedded import EmbeddedPool
from kvpool.errors import KVPoolError, ObjectNotFound, PeerTimeout
from kvpool.testing.processes import PoolProcess, start_master


@pytest.fixture(scope="module")
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "16MiB") as proc:
        yield proc


def test_concurrent_puts_and_gets_each_get_their_own_bytes(master: PoolProcess) -> None:
    values = {f"a{i:02d}": os.urandom(8192 + i) for i in range(24)}

    async def scenario() -> None:
        async with AsyncClient(master.address) as pool:
            await asyncio.gather(*(pool.put(k, v) for k, v in values.items()))
            got = await asyncio.gather(*(pool.get(k) for k in values))
            assert got == list(values.values())
            assert await pool.batch_exists([*values, "nope"]) == [True] * len(values) + [False]
            assert await pool.batch_get(["a00", "nope"]) == [values["a00"], None]
            with pytest.raises(ObjectNotFound):
                await pool.get("nope")
            assert await pool.remove("a00")
            assert not await pool.exists("a00")

    asyncio.run(scenario())


def test_reads_into_caller_buffers_and_batch_forms(master: PoolProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(master.address) as pool:
            src = np.arange(4096, dtype=np.float32)
            await pool.put_from("arr", src)
            out = np.zeros_like(src)
            assert await pool.get_into("arr", out) == src.nbytes
            assert np.array_equal(out, src)
            assert await pool.batch_put(["b1", "b2"], [b"x" * 100, b"y" * 200]) == [None, None]
            bufs = [bytearray(100), bytearray(200), bytearray(10)]
            assert await pool.batch_get_into(["b1", "b2", "nope"], bufs) == [100, 200, -1]
            assert bytes(bufs[1]) == b"y" * 200
            assert (await pool.stats())["tiers"]["memory"]["objects"] >= 3

    asyncio.run(scenario())


def test_the_loop_keeps_running_while_a_call_waits_on_a_stopped_master() -> None:
    with start_master("--segment_size", "1MiB") as proc:

        async def scenario() -> int:
            ticks = 0
            async with AsyncClient(proc.address, timeout_s=2) as pool:
                await pool.put("k", b"v")
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    call = asyncio.ensure_future(pool.get("k"))
                    while not call.done():  # bounded: the call times out after 2 s
                        ticks += 1
                        await asyncio.sleep(0.01)
                    with pytest.raises(PeerTimeout):
                        await call
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
            return ticks

        assert asyncio.run(scenario()) > 1


def test_it_wraps_an_embedded_pool_and_closes_it() -> None:
    pool = EmbeddedPool(1 << 20)

    async def scenario() -> None:
        async with AsyncClient(client=pool) as apool:
            await apool.put("e", b"embedded")
            assert await apool.get("e") == b"embedded"
            assert await apool.prefix_lookup(["e", "f"]) == 1
        with pytest.raises(KVPoolError, match="closed"):
            await apool.get("e")

    asyncio.run(scenario())
    assert pool.storage.segment is not None and pool.storage.segment.closed


def test_client_and_connection_arguments_together_are_refused() -> None:
    with (
        EmbeddedPool(1 << 20) as pool,  # closed after: its segment goes
        pytest.raises(ValueError, match="either client="),
    ):
        AsyncClient(client=pool, timeout_s=1)

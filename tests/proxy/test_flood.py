"""The proxy under a flood: 2,000 idle connections and 2,000 whose HTTP headers never end,
held on its port while clients' completions keep coming back whole."""

from __future__ import annotations

import asyncio

from kvpool.testing.flood import FloodProcess
from tests.proxy.harness import proxy_stack, run
from tests.proxy.stub_upstream import reference_text

FLOOD = 2000
COMPLETION = {"model": "m", "prompt": "under a flood", "max_tokens": 8}


def test_a_flood_of_idle_and_unfinished_requests_locks_no_client_out() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            address = stack.url.removeprefix("http://")
            flooder = FloodProcess(address, idle=FLOOD, slow=FLOOD, http=True)
            try:
                await asyncio.to_thread(flooder.wait_opened, 2 * FLOOD)
                for _ in range(20):  # bounded: each a whole P/D round trip
                    async with stack.session.post(
                        stack.url + "/v1/completions", json=COMPLETION
                    ) as resp:
                        assert resp.status == 200
                        reply = await resp.json()
                    assert reply["choices"][0]["text"] == reference_text(COMPLETION)
            finally:
                await asyncio.to_thread(flooder.stop)

    run(scenario(), timeout=240)

"""The master's live status page, in a real headless chromium driven over the DevTools
protocol (aiohttp's websocket client): it loads, shows the pool's numbers, those numbers
change when the pool is used, it fits a phone's width, and the run leaves screenshots."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpool.client.client import Client
from kvpool.errors import ObjectNotFound
from kvpool.master.status_page import PAGE_PATH, page_html
from kvpool.testing import lifetime
from kvpool.testing.processes import PoolProcess, start_master

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # bound of every wait on the browser; generous, the 2-core CI is shared

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # root in CI containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a 64 MiB /dev/shm
    "--remote-debugging-port=0",  # chromium writes the port it took to DevToolsActivePort
]


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "chromium is not installed; the status page is tested in a real browser. "
        "Run scripts/setup.sh (it installs Debian's chromium) or apt-get install chromium"
    )


class Browser:
    """A headless chromium of our own (its own profile, its own process group)."""

    def __init__(self, tmp: Path) -> None:
        executable = chromium_path()  # first: a missing browser must fail the test cleanly
        self.profile = tmp / "chromium-profile"
        self.profile.mkdir()
        self.log = open(tmp / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = lifetime.popen(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so close() can end its helpers with it, by group id
        )

    def devtools_port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited {self.proc.returncode}; see {self.log.name}")
            text = marker.read_text() if marker.exists() else ""
            if "\n" in text:
                return int(text.split("\n", 1)[0])
            time.sleep(0.1)
        raise AssertionError(f"chromium wrote no DevToolsActivePort in {WAIT_S}s")

    def close(self) -> None:
        if self.proc.poll() is None:
            with_group = os.getpgid(self.proc.pid) == self.proc.pid
            if with_group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL) if with_group else self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class Page:
    """One page target over the DevTools protocol: commands with ids, events collected."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.js_errors: list[str] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        async with asyncio.timeout(WAIT_S):
            while True:
                msg = await self.ws.receive_json()
                if msg.get("method") == "Runtime.exceptionThrown":
                    self.js_errors.append(json.dumps(msg["params"]["exceptionDetails"]))
                if msg.get("id") == msg_id:
                    if "error" in msg:
                        raise AssertionError(f"{method}: {msg['error']}")
                    result: dict[str, Any] = msg["result"]
                    return result

    async def eval(self, expression: str) -> Any:
        reply = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise AssertionError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, what: str) -> Any:
        """Poll a JS expression until it is truthy (bounded)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"page never showed {what} in {WAIT_S}s")

    async def screenshot(self, path: Path) -> None:
        reply = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(reply["data"]))


READ_NUMBERS = """JSON.stringify(Object.fromEntries(
  ["updates", "puts", "gets", "objects", "mem-used", "mem-pct", "get-hit", "get-hit-den",
   "prefix-hit-den", "evictions", "clients-count", "state", "flags"]
  .map(id => [id, document.getElementById(id).textContent])))"""


@pytest.fixture
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "2MiB", "--client_ttl", "30") as proc:
        yield proc


def use_pool(address: str, start: int, count: int) -> None:
    with Client(address, timeout_s=30) as c:
        for i in range(start, start + count):
            c.put(f"page-{i}", bytes([i % 256]) * 64 * 1024)
        for i in range(start, start + count + 2):  # two misses: the denominator grows more
            with contextlib.suppress(ObjectNotFound):  # misses are what the page must count
                c.get(f"page-{i}")
        c.prefix_lookup([f"page-{i}" for i in range(start, start + count)])


async def drive(url: str, master: PoolProcess, port: int, out: Path) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        target = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.send("Runtime.enable")
            await page.send("Page.enable")
            await page.send(
                "Emulation.setDeviceMetricsOverride",
                width=1280,
                height=900,
                deviceScaleFactor=1,
                mobile=False,
            )
            await page.send("Page.navigate", url=url)
            await page.wait_for(
                f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
                "the page loaded",
            )
            await page.wait_for(
                "Number(document.getElementById('updates').textContent) >= 2", "two updates"
            )
            before = json.loads(await page.eval(READ_NUMBERS))

            await asyncio.to_thread(use_pool, master.address, 0, 12)
            await page.wait_for(
                f"document.getElementById('puts').textContent !== {json.dumps(before['puts'])}",
                "the new puts",
            )
            # two more polls after the puts so the throughput chart has a rate point
            seen = int(await page.eval("Number(document.getElementById('updates').textContent)"))
            await page.wait_for(
                f"Number(document.getElementById('updates').textContent) >= {seen + 2}",
                "two more updates",
            )
            await asyncio.to_thread(use_pool, master.address, 12, 20)  # fills past 2 MiB
            await page.wait_for(
                "Number(document.getElementById('evictions').textContent) > 0", "evictions"
            )
            seen = int(await page.eval("Number(document.getElementById('updates').textContent)"))
            await page.wait_for(  # a few more points, so the screenshot shows lines over time
                f"Number(document.getElementById('updates').textContent) >= {seen + 3}",
                "three more updates",
            )
            after = json.loads(await page.eval(READ_NUMBERS))
            chart_paths = await page.eval(
                "['chart-use','chart-hit','chart-rate'].map("
                "id => document.querySelectorAll('#' + id + ' path').length)"
            )
            await page.screenshot(out / "status_page.png")

            await page.send(
                "Emulation.setDeviceMetricsOverride",
                width=390,
                height=844,
                deviceScaleFactor=2,
                mobile=True,
            )
            await page.wait_for(
                "document.documentElement.clientWidth === 390", "the phone viewport"
            )
            overflow = await page.eval(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            await page.screenshot(out / "status_page_phone.png")
            return {
                "before": before,
                "after": after,
                "charts": chart_paths,
                "overflow": overflow,
                "js_errors": page.js_errors,
            }


def test_status_page_is_live_in_a_real_browser(master: PoolProcess, tmp_path: Path) -> None:
    browser = Browser(tmp_path)
    try:
        port = browser.devtools_port()
        url = f"http://{master.address}{PAGE_PATH}"
        seen = asyncio.run(drive(url, master, port, tmp_path))
    finally:
        browser.close()
    before, after = seen["before"], seen["after"]

    assert before["state"] == "live"
    assert before["puts"] == "0" and before["objects"] == "0"
    assert before["get-hit-den"] == "no gets asked yet"
    assert before["clients-count"] == "1"  # the master's own segment
    assert after["state"] == "live"
    assert after["puts"] == "32"
    assert after["gets"] == "36"
    assert int(after["objects"]) > 0 and after["objects"] != before["objects"]
    assert after["mem-used"] != before["mem-used"]
    # the ratio is shown with its denominator: "N of 36 gets"
    assert after["get-hit-den"].endswith(" of 36 gets"), after
    assert int(after["evictions"]) > 0
    assert "segment_size=2097152" in after["flags"]  # the flags the master runs with
    assert seen["charts"] == [1, 2, 2], "use (memory), hit (gets+prefix), rate (puts+gets)"
    assert seen["overflow"] <= 0, "the page scrolls sideways on a phone"
    assert seen["js_errors"] == []

    for name in ("status_page.png", "status_page_phone.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
        artifacts = REPO / "artifacts"
        artifacts.mkdir(exist_ok=True)
        shutil.copy(tmp_path / name, artifacts / name)


def test_status_page_is_served_self_contained(master: PoolProcess) -> None:
    with urllib.request.urlopen(f"http://{master.address}{PAGE_PATH}", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers.get_content_type() == "text/html"
        body = resp.read()
    assert body == page_html()
    text = body.decode()
    assert '<meta name="viewport"' in text
    # no CDN: nothing is loaded from another host (cluster hosts often have no internet)
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert "<script src" not in text and "<link" not in text

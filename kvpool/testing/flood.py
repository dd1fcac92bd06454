"""A peer with no credential that floods ports with connections (the flood tests and
bench/flood.py): ``idle`` ones that never send a byte, ``slow`` ones that stall in the
handshake, re-opened as the server closes them; run as ``python -m kvpool.testing.flood``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvpool.net import split_address
from kvpool.security.handshake import AUTH_MAGIC
from kvpool.testing import lifetime

__all__ = ["Flood", "FloodProcess", "main"]

#: what a slow handshake sends before it stalls: the magic and half a frame header
SLOW_START = AUTH_MAGIC + b"\x01"
#: on an HTTP port (``--http``): a request whose headers never end
SLOW_HTTP = b"POST /v1/completions HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"


@dataclass
class Flood:
    """Connections held against one port."""

    address: tuple[str, int]
    idle: int
    slow: int
    slow_start: bytes = SLOW_START
    open: dict[socket.socket, bool] = field(default_factory=dict)  # socket -> slow?
    opened: int = 0
    failed: int = 0  # connects the server (or the kernel) refused

    def top_up(self, selector: selectors.BaseSelector, budget: int) -> int:
        """Open connections until ``idle`` and ``slow`` are held again (at most
        ``budget``); returns how many it opened."""
        n = 0
        for slow, want in ((False, self.idle), (True, self.slow)):
            have = sum(1 for s in self.open.values() if s == slow)
            while have < want and n < budget:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex(self.address)
                if code not in (0, errno.EINPROGRESS):
                    sock.close()
                    self.failed += 1
                    return n
                self.open[sock] = slow
                selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self)
                have += 1
                n += 1
                self.opened += 1
        return n

    def on_event(self, selector: selectors.BaseSelector, sock: socket.socket, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:  # connected (or failed)
            selector.modify(sock, selectors.EVENT_READ, self)
            if self.open.get(sock):
                with contextlib.suppress(OSError):
                    sock.send(self.slow_start)
        if mask & selectors.EVENT_READ:  # the server closed it (or refused, in words)
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.drop(selector, sock)

    def drop(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        self.open.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(sock)
        sock.close()


class FloodProcess:
    """This module as a child process against ``addresses``; :attr:`opened` follows its
    ``open`` lines (connections opened so far, per port)."""

    def __init__(
        self, *addresses: str, idle: int = 2000, slow: int = 2000, http: bool = False
    ) -> None:
        argv = [*addresses, "--idle", str(idle), "--slow", str(slow), "--seconds", "300"]
        argv += ["--http"] if http else []
        self.proc = lifetime.popen(
            [sys.executable, "-m", "kvpool.testing.flood", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.opened = [0] * len(addresses)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.opened = [int(f.split("/")[1]) for f in line.split()[1:]]

    def wait_opened(self, at_least: int, timeout_s: float = 120.0) -> None:
        """Until every port has met ``at_least`` connections (bounded)."""
        deadline = time.monotonic() + timeout_s
        while min(self.opened) < at_least:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"the flood opened {self.opened}, not {at_least} each")
            time.sleep(0.1)

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._reader.join(10)
            self.proc.stdout.close()

    def __enter__(self) -> FloodProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.testing.flood")
    parser.add_argument("addresses", nargs="+", metavar="HOST:PORT")
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--slow", type=int, default=2000)
    parser.add_argument("--reopen", type=int, default=500, help="connections opened a second")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--http", action="store_true", help="slow ones: unfinished HTTP")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(args.addresses) * (args.idle + args.slow) + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, need), hard), hard))
    floods = []
    for address in args.addresses:
        host, port = split_address(address)
        start = SLOW_HTTP if args.http else SLOW_START
        floods.append(Flood((host, port), args.idle, args.slow, start))
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ, None)
    end = time.monotonic() + args.seconds
    next_report = 0.0
    # --reopen a second on each port, however often this wakes
    tokens, last = [0.0] * len(floods), time.monotonic()
    while (now := time.monotonic()) < end:
        for i, flood in enumerate(floods):
            tokens[i] = min(tokens[i] + (now - last) * args.reopen, float(args.reopen))
            tokens[i] -= flood.top_up(selector, int(tokens[i]))
        last = now
        for key, mask in selector.select(0.1):
            if key.data is None:  # stdin: closed (or a line) ends the flood
                return _close(floods, selector)
            key.data.on_event(selector, key.fileobj, mask)
        if now >= next_report:
            next_report = now + 1.0
            held = " ".join(f"{len(f.open)}/{f.opened}/{f.failed}" for f in floods)
            print(f"open {held}", flush=True)
    return _close(floods, selector)


def _close(floods: list[Flood], selector: selectors.BaseSelector) -> int:
    for flood in floods:
        for sock in list(flood.open):
            flood.drop(selector, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())

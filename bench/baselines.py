"""The raw baselines ``bench/pool.py`` measures kvpool's paths against, in the same run:
no framing and no kvpool code, only the copy or the socket calls.

    memcpy(size)               one ``numpy.copyto`` between two page-aligned buffers
    raw_tcp(size)              (write, read, close) on one loopback connection to a peer
                               thread of this process: a 1-byte op tag, then the value and
                               a 1-byte ack (write), or the value back (read), one value
                               per round trip
    recv_exactly(sock, view)   ``recv_into`` until ``view`` is full (also the raw peer's
                               and raw client's of ``bench/transfer.py``)

Why page-aligned: where two buffers start decides a copy's speed at 64 KiB.  Two buffers
the heap puts one right after the other start 16 bytes apart modulo 4 KiB, and every copy
between them pays 4K aliasing: a quarter slower than at other placements on the 2-core
VM (2026-12-01), and whether the heap does so changes with unrelated code.  Page-aligned
buffers (as a KV tensor and a segment are) copy at the fast figure every time; from
1 MiB up numpy maps both buffers itself, aligned alike, so nothing changes there.

``bench/transfer.py`` keeps memcpy and raw TCP rows of its own: sharing these would
change its figures.  Its memcpy buffers are the adjacent kind (a random value, then
``empty_like``), so its 64 KiB memcpy is the slow placement; its raw peer runs in a
process of its own (as a storage node does), takes one connection per kind of op with no
tag per value, and adds a one-way stream.
"""

from __future__ import annotations

import functools
import mmap
import socket
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["memcpy", "raw_tcp", "recv_exactly"]


def memcpy(size: int) -> Callable[[], None]:
    """One ``size``-byte copy between two page-aligned buffers made once, here."""
    src = _page_aligned(size)
    src.fill(1)
    return functools.partial(np.copyto, _page_aligned(size), src)


def _page_aligned(size: int) -> np.ndarray:
    """``size`` bytes of their own anonymous mapping (its pages untouched until used)."""
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _raw_server(sock: socket.socket, size: int) -> None:
    conn, _ = sock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(size))
    while True:
        kind = conn.recv(1)
        if not kind:
            return
        if kind == b"w":
            recv_exactly(conn, buf)
            conn.sendall(b"k")
        else:
            conn.sendall(buf)


def raw_tcp(size: int) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(write, read, close) of ``size``-byte values against a peer thread (see above)."""
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(listener, size), daemon=True).start()
    c = socket.create_connection(listener.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(bytearray(size))
    into = memoryview(bytearray(size))

    def write() -> None:
        c.sendall(b"w")
        c.sendall(data)
        c.recv(1)

    def read() -> None:
        c.sendall(b"r")
        recv_exactly(c, into)

    def close() -> None:
        c.close()
        listener.close()

    return write, read, close

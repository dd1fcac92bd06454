"""A TCP relay on 127.0.0.1 that holds every reply back ``delay_s``: a slow peer (an etcd
whose disk syncs slowly, a loaded host) without a network namespace or netem, which this
kernel may lack.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

__all__ = ["SlowRelay"]


class SlowRelay:
    """``with SlowRelay(("127.0.0.1", port), 0.3) as relay: relay.endpoint``."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target, self.delay_s = target, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> SlowRelay:
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
        self._accepting.join(5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.delay_s), daemon=True
            ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()
        sender = threading.Thread(target=self._release, args=(held, sink), daemon=True)
        sender.start()
        try:
            while not self._closed.is_set():
                chunk = source.recv(65536)
                if not chunk:
                    break
                held.put((time.monotonic() + delay_s, chunk))
        except OSError:
            pass
        held.put((0.0, b""))  # the end, after what is held

    def _release(self, held: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        """Send each chunk at its time: a reply in several chunks is late once, not per
        chunk."""
        try:
            while True:
                at, chunk = held.get()
                if not chunk:
                    break
                time.sleep(max(0.0, at - time.monotonic()))
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            # the other direction may still carry bytes: only this one ends
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

"""Who may use the embedded backend's lookup channel, and how many at once.

The channel is a Unix socket: only this user's processes may ask it (a directory only
its owner may enter, a 600 socket, and the kernel's word on who connected), and it serves
at most ``max_connections`` at once.  Another user is a real process: a child forked and
switched to ``nobody`` (the suite runs as root, as its network namespaces need).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.connectors.store.lookup import (
    LOOKUP_CODEC,
    REPLY_CODEC,
    Lookup,
    LookupClient,
    LookupServer,
    channel_path,
)
from kvpool.datapath import framing
from kvpool.errors import ConfigError, TransferError
from tests.connectors.store.fake_pool import FakePool
from tests.waiting import wait_until

LOG = logging.getLogger("test")
NOBODY = 65534
Served = Callable[..., tuple[LookupServer, FakePool]]


def _as_nobody(path: str) -> str:
    """Connect to ``path`` as user nobody and ask one lookup; what happened, in words."""
    assert os.geteuid() == 0, "this test switches users: run the suite as root, as CI does"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only socket calls, then _exit
        os.close(read)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(path)
                reply, _ = framing.call(s, LOOKUP_CODEC, REPLY_CODEC, Lookup(["a"]), 5)
                said = f"reply {reply!r}"
        except BaseException as exc:
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode()[:4000])
        os._exit(0)
    os.close(write)
    try:
        chunks = []
        while chunk := os.read(read, 4096):
            chunks.append(chunk)
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    return b"".join(chunks).decode()


@pytest.fixture
def root() -> Iterator[Path]:
    """A root every user may pass through (as /tmp or /run/user is), unlike tmp_path's
    parents: what keeps another user out is then kvpool's own directory."""
    path = Path(tempfile.mkdtemp(prefix="kvpool-test-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def served(root: Path) -> Iterator[Callable[..., tuple[LookupServer, FakePool]]]:
    made: list[LookupServer] = []

    def serve(**kwargs: int) -> tuple[LookupServer, FakePool]:
        pool = FakePool()
        pool.objects["a"] = b"1"
        path = channel_path(
            instance_id="1", engine_id="e", dp_rank=0, lookup_rpc_port=0, root=str(root)
        )
        server = LookupServer(path, pool, LOG, **kwargs)
        made.append(server)
        return server, pool

    yield serve
    for server in made:
        server.close()


def test_the_socket_lies_in_a_directory_only_its_owner_may_enter(
    served: Served, root: Path
) -> None:
    server, _ = served()
    folder = Path(server.path).parent
    assert folder == root / f"kvpool-{os.geteuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    said = _as_nobody(server.path)
    assert said.startswith("PermissionError"), said


def test_another_user_is_refused_even_through_loosened_permissions(served: Served) -> None:
    server, pool = served()
    os.chmod(Path(server.path).parent, 0o777)  # as a careless umask or chmod would
    os.chmod(server.path, 0o777)
    said = _as_nobody(server.path)
    assert said.startswith("reply Failed("), said
    assert f"serves only user {os.geteuid()}'s processes, not user {NOBODY}'s" in said
    assert pool.calls["prefix_lookup"] == 0  # the pool was never asked
    assert server.refused == 1
    os.chmod(Path(server.path).parent, 0o700)
    with LookupClient(server.path, timeout_s=5) as mine:  # the owner still is served
        assert mine.prefix_lookup(["a"]) == 1


def test_a_directory_others_may_enter_or_another_users_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(ConfigError, match=r"chmod 700 .*loose"):
        LookupServer(str(loose / "l.sock"), FakePool(), LOG)
    with pytest.raises(TransferError, match="other users may enter"):
        LookupClient(str(loose / "l.sock"), timeout_s=1)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to user {NOBODY}"):
        LookupServer(str(theirs / "l.sock"), FakePool(), LOG)
    assert not (theirs / "l.sock").exists()


def test_past_the_cap_connections_are_refused_and_the_served_keep_working(served: Served) -> None:
    server, pool = served(max_connections=2)
    first = LookupClient(server.path, timeout_s=5)
    second = LookupClient(server.path, timeout_s=5)
    try:
        assert first.prefix_lookup(["a"]) == 1 and second.prefix_lookup(["a"]) == 1
        wait_until(lambda: server.connections == 2, 5, what="two served connections")
        with (
            LookupClient(server.path, timeout_s=5) as third,
            pytest.raises(TransferError, match=r"Overloaded: .* limit of 2 connections"),
        ):
            third.prefix_lookup(["a"])
        assert server.refused == 1 and server.connections == 2
        assert first.prefix_lookup(["a"]) == 1  # the served ones never noticed
        calls = pool.calls["prefix_lookup"]
        second.close()
        wait_until(lambda: server.connections == 1, 5, what="the closed connection to end")
        with LookupClient(server.path, timeout_s=5) as again:
            assert again.prefix_lookup(["a"]) == 1
        assert pool.calls["prefix_lookup"] == calls + 1
    finally:
        first.close()
        second.close()


def test_a_flood_of_connections_is_bounded(served: Served) -> None:
    server, _ = served(max_connections=4)
    socks = []
    try:
        for n in range(1, 41):  # bounded: far past the cap
            s = socket.socket(socket.AF_UNIX)
            socks.append(s)
            s.settimeout(5)
            s.connect(server.path)
            # one at a time, so the listen backlog never fills (that would be no test)
            wait_until(lambda: server.refused + server.connections == n, 5, what="an accept")  # noqa: B023
        assert server.refused == 36
        assert server.connections == 4
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: server.connections == 0, 5, what="every connection to end")
    with LookupClient(server.path, timeout_s=5) as client:
        reply = client.prefix_lookup(["a"])
    assert reply == 1

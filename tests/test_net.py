from __future__ import annotations

import socket

import pytest

from kvpool.net import DEFAULT_MASTER_PORT, free_port, http_get, port_free, split_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:7", ("10.0.0.1", 7)),
        ("node-a", ("node-a", DEFAULT_MASTER_PORT)),
        ("[::1]:9", ("::1", 9)),
        ("[::1]", ("::1", DEFAULT_MASTER_PORT)),
        ("::1", ("::1", DEFAULT_MASTER_PORT)),
        (":5", ("127.0.0.1", 5)),
    ],
)
def test_split_address(text: str, expected: tuple[str, int]) -> None:
    assert split_address(text) == expected


def test_a_port_that_is_not_a_number_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        split_address("host:http")


def test_port_free_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_free("127.0.0.1", s.getsockname()[1])
    assert port_free("127.0.0.1", free_port())


def test_http_get_reports_a_refusal_as_a_value() -> None:
    reply = http_get(f"http://127.0.0.1:{free_port()}/health", timeout_s=2)
    assert reply.status is None and not reply.ok and reply.error

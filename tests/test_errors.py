"""The error tree and its wire form: every class crosses the wire as itself, and every
master request has a handler (a missing one would be an INTERNAL error at run time)."""

from __future__ import annotations

import typing

import msgspec
import pytest

import kvpool.errors as errors
from kvpool.core.objects import IndexConfig
from kvpool.master.service import MasterService
from kvpool.protocol import messages as m
from kvpool.protocol.codec import HEADER_SIZE, Codec
from kvpool.protocol.data import DATA_REPLY_CODEC, Error, error_reply

TREE = [
    cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, errors.KVPoolError)
]
REPLY_CODECS: list[Codec[typing.Any]] = [m.MASTER_REPLY_CODEC, DATA_REPLY_CODEC]


def test_the_tree_is_every_kvpool_error_in_the_module() -> None:
    assert len(TREE) == 18  # QuotaExceeded joined NoSpace, NotLeader the HA masters
    assert set(TREE) == set(errors._BY_CODE.values())
    codes = [cls.code for cls in TREE]
    assert len(set(codes)) == len(codes)  # one code, one class


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("codec", REPLY_CODECS, ids=["master", "data"])
def test_every_error_round_trips_through_the_wire(
    cls: type[errors.KVPoolError], codec: Codec[typing.Any]
) -> None:
    sent = error_reply(cls("key k1: what went wrong"))
    frame = codec.encode(sent)
    got = codec.decode_body(frame[HEADER_SIZE:])
    assert got == Error(cls.code, "key k1: what went wrong")
    exc = got.to_exception()
    assert type(exc) is cls and str(exc) == "key k1: what went wrong"
    assert errors.error_code(exc) == cls.code


def test_what_is_not_ours_is_internal_and_comes_back_as_the_base_class() -> None:
    reply = error_reply(RuntimeError("a bug"))
    assert reply.code == "INTERNAL" and errors.error_code(KeyError("x")) == "INTERNAL"
    assert type(reply.to_exception()) is errors.KVPoolError
    assert type(errors.error_from_code("FROM_A_NEWER_VERSION", "x")) is errors.KVPoolError


def test_a_subclass_without_its_own_code_crosses_as_its_parent() -> None:
    class Refined(errors.TransferError):
        pass

    assert errors.error_code(Refined("x")) == "TRANSFER"
    assert type(errors.error_from_code("TRANSFER", "x")) is errors.TransferError


def test_every_master_request_has_a_handler_and_every_message_is_in_a_union() -> None:
    requests = set(typing.get_args(m.MasterRequest))
    replies = set(typing.get_args(m.MasterReply))
    service = MasterService(IndexConfig())
    assert requests == service.request_types
    structs = {
        cls
        for name in m.__all__
        if isinstance(cls := getattr(m, name), type) and issubclass(cls, msgspec.Struct)
    }
    assert structs == requests | replies  # no message outside the contract

from __future__ import annotations

import pytest

from kvpool.engines import ENGINES, EmbeddedEngine, MasterEngine, open_engine
from kvpool.errors import ConfigError
from tests.engines.conftest import HARNESSES


def test_open_engine_opens_each_engine_by_name() -> None:
    embedded = open_engine("embedded", capacity=1 << 20)
    try:
        assert isinstance(embedded, EmbeddedEngine) and embedded.engine == "embedded"
    finally:
        embedded.close()
    master = open_engine("kvpool", master="127.0.0.1:1", timeout_s=1)  # connects on first use
    try:
        assert isinstance(master, MasterEngine) and master.engine == "kvpool"
    finally:
        master.close()


def test_open_engine_refuses_what_it_cannot_open() -> None:
    with pytest.raises(ConfigError, match="unknown pool engine 'redis'"):
        open_engine("redis")
    with pytest.raises(ConfigError, match="needs the master"):
        open_engine("kvpool")


def test_the_contract_suite_covers_every_engine() -> None:
    assert sorted(HARNESSES) == sorted(ENGINES)


def test_open_engine_opens_mooncake_from_its_config() -> None:
    from kvpool.mooncake.engine import MooncakeEngine
    from kvpool.mooncake.settings import parse_mooncake_config

    config = parse_mooncake_config(
        {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": "127.0.0.1:1",
        }
    )
    engine = open_engine("mooncake", mooncake=config)  # connects on first use
    try:
        assert isinstance(engine, MooncakeEngine) and engine.engine == "mooncake"
        assert engine.pins is False and engine.probes_lease is True
    finally:
        engine.close()


def test_without_the_wheel_the_mooncake_tests_fail_and_say_how_to_install() -> None:
    from kvpool.testing.mooncake import MooncakeMissing, mooncake_binary

    with pytest.raises(MooncakeMissing, match=r"pip install 'kvpool\[mooncake\]'.*libibverbs1"):
        mooncake_binary(find_spec=lambda name: None)
    assert mooncake_binary().name == "mooncake_master"  # here, the wheel is installed

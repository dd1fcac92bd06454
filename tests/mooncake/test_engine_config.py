"""Which engine a mooncake.json is for, Mooncake's config as Mooncake reads it, the
adapter's pure parts, and a client pointed at the other engine's master."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.config.kv_transfer import StoreConfig, parse_store_config
from kvpool.config.node import node_engine, parse_node_config
from kvpool.errors import ConfigError, NoSpace, TransferError
from kvpool.mooncake.engine import put_error
from kvpool.mooncake.parts import HEADER_SIZE, pack_header, unpack_payload
from kvpool.mooncake.settings import load_any_node_config, parse_mooncake_config
from kvpool.ops.status import default_master
from kvpool.testing.mooncake import Namespace
from tests.mooncake.host import mooncake_json

# the production guide's mooncake.json (§4): kvpool's engine
GUIDE = {"local_hostname": "10.0.0.2", "metadata_server": "10.0.0.1:50088", "protocol": "tcp"}
# as vllm-ascend's Mooncake backend and Mooncake's docs write it
ASCEND = {
    "local_hostname": "10.0.0.2",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": "3.125GB",
    "local_buffer_size": 1073741824,
    "protocol": "rdma",
    "device_name": "mlx5_0",
    "master_server_address": "10.0.0.1:50051",
}


@pytest.fixture
def ascend_json(tmp_path: Path) -> Path:
    """:data:`ASCEND` written as a mooncake.json."""
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(ASCEND))
    return path


@pytest.fixture
def ascend_env(ascend_json: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:data:`ASCEND`'s mooncake.json, the one config path set, as vLLM's process sees it."""
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(ascend_json))
    monkeypatch.delenv("KVPOOL_CONFIG_PATH", raising=False)
    return ascend_json


def _mooncake_backend(role: str) -> StoreConfig:
    """The store connector's config for ``role`` with ``"backend": "mooncake"``."""
    return parse_store_config(role, {"backend": "mooncake"}, env={}, load_node=load_any_node_config)


@pytest.mark.parametrize(
    ("data", "engine"),
    [
        (GUIDE, "kvpool"),
        ({"local_hostname": "h", "master_server_address": "m:1234"}, "kvpool"),
        ({**GUIDE, "master_server_address": "10.0.0.1:50088"}, "kvpool"),  # one service
        (ASCEND, "mooncake"),
        ({**GUIDE, "metadata_server": "http://10.0.0.1:8080/metadata"}, "mooncake"),
        # etcd:// alone: kvpool's HA masters (docs/ha.md); beside a master: Mooncake's
        ({**GUIDE, "metadata_server": "etcd://10.0.0.1:2379"}, "kvpool"),
        (
            {**GUIDE, "metadata_server": "etcd://10.0.0.1:2379", "master_server_address": "m:1"},
            "mooncake",
        ),
        ({**GUIDE, "local_buffer_size": 1 << 30}, "mooncake"),
        ({**GUIDE, "master_server_address": "10.0.0.1:50051"}, "mooncake"),  # two services
        ({**ASCEND, "engine": "mooncake"}, "mooncake"),
        ({**GUIDE, "engine": "kvpool"}, "kvpool"),
    ],
)
def test_the_rule_tells_the_engines_apart(data: dict, engine: str) -> None:
    assert node_engine(data) == engine


def test_a_mooncake_config_parses_as_mooncake_reads_it() -> None:
    c = parse_mooncake_config(ASCEND)
    assert (c.metadata_server, c.master_server_address) == ("P2PHANDSHAKE", "10.0.0.1:50051")
    assert c.global_segment_size == 3355443200  # Mooncake's GB is 1024**3
    assert (c.local_buffer_size, c.protocol, c.device_name) == (1 << 30, "rdma", "mlx5_0")
    with pytest.raises(ConfigError, match=r"master_server_address.*missing"):
        parse_mooncake_config({k: v for k, v in ASCEND.items() if k != "master_server_address"})
    with pytest.raises(ConfigError, match=r"bogus.*not a key"):
        parse_mooncake_config({**ASCEND, "bogus": 1})
    with pytest.raises(ConfigError, match="engine"):
        node_engine({**GUIDE, "engine": "redis"})


def test_kvpools_parser_names_the_rule_that_made_it_mooncake() -> None:
    with pytest.raises(ConfigError, match=r"Mooncake config.*metadata_server is P2PHANDSHAKE"):
        parse_node_config(ASCEND)
    assert parse_node_config(GUIDE).master_address == "10.0.0.1:50088"
    # docs/ha.md: a node finds kvpool's HA masters through etcd
    ha = parse_node_config({**GUIDE, "metadata_server": "etcd://10.0.0.5:2379"})
    assert ha.master_address.startswith("etcd://10.0.0.5:2379")


def test_kvpool_node_stops_at_once_on_a_mooncake_config(ascend_json: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "node", "--config", str(ascend_json)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr  # a config error, not a retry loop
    assert "this is a Mooncake config" in done.stderr


def test_status_finds_the_master_a_mooncake_config_names(ascend_json: Path) -> None:
    assert default_master({"MOONCAKE_CONFIG_PATH": str(ascend_json)}) == "10.0.0.1:50051"


def test_objects_carry_a_checksummed_header() -> None:
    payload = b"x" * 1000
    stored = memoryview(pack_header(payload) + payload)
    assert len(stored) == HEADER_SIZE + 1000
    assert unpack_payload(stored) == payload
    damaged = bytearray(stored)
    damaged[HEADER_SIZE + 7] ^= 1
    assert unpack_payload(memoryview(damaged)) is None
    assert unpack_payload(memoryview(payload)) is None  # not a kvpool object
    assert unpack_payload(memoryview(b"")) is None


def test_mooncake_codes_become_kvpools_errors() -> None:
    assert put_error(0, "k") is None and put_error(-705, "k") is None  # already there
    assert isinstance(put_error(-200, "k"), NoSpace)
    failed = put_error(-800, "k")
    assert isinstance(failed, TransferError) and "transfer failed" in str(failed)


def test_a_mooncake_client_pointed_at_a_kvpool_master_says_what_answered() -> None:
    # in a namespace: were the check to miss, Mooncake's setup would open its listeners
    with Namespace() as ns:
        master = ns.new("kvpool.testing.processes:start_master")
        try:
            address = ns.call(master, "__getattribute__", "address")
            engine = ns.new("tests.mooncake.host:open_engine", mooncake_json(address, 0))
            with pytest.raises(TransferError, match="looks like a kvpool master"):
                ns.call(engine, "batch_exists", ["k"])
        finally:
            ns.call(master, "stop")  # the master is a process of its own: it outlives ns


def test_the_store_connectors_mooncake_backend_opens_mooncake_for_a_mooncake_config(
    ascend_env: Path,
) -> None:
    from kvpool.connectors.store.pool import EmbeddedPools, open_pool
    from kvpool.mooncake.engine import MooncakeEngine

    config = _mooncake_backend("kv_producer")
    assert config.master == "10.0.0.1:50051"
    name = "mooncake:10.0.0.1:50051"
    try:
        pools = [open_pool(config), open_pool(config)]  # opens nothing yet: lazy
        assert [p.engine for p in pools] == ["mooncake", "mooncake"]
        assert isinstance(EmbeddedPools.peek(name), MooncakeEngine)  # one per process
    finally:
        EmbeddedPools.release(name)
    ascend_env.write_text(json.dumps(GUIDE))  # the guide's JSON stays on kvpool's master
    config = _mooncake_backend("kv_producer")
    pool = open_pool(config)
    try:
        assert pool.engine == "kvpool" and config.master == "10.0.0.1:50088"
    finally:
        pool.close()


def test_the_schedulers_lookups_open_mooncake_as_a_pure_client(ascend_env: Path) -> None:
    """Only the workers (which hold KV) contribute global_segment_size to the pool; the
    scheduler half's lookups mount no segment (under ``vllm serve`` it is a process of its
    own, which otherwise mounted a second segment per instance)."""
    from kvpool.connectors.store.pool import EmbeddedPools, open_pool
    from kvpool.mooncake.engine import MooncakeEngine

    config = _mooncake_backend("kv_both")
    names = ["mooncake:10.0.0.1:50051", "mooncake-lookups:10.0.0.1:50051"]
    try:
        open_pool(config)  # the worker's (lazy: opens nothing yet)
        open_pool(config, lookups=True)  # the scheduler's
        worker, lookups = (EmbeddedPools.peek(name) for name in names)
        assert isinstance(worker, MooncakeEngine) and isinstance(lookups, MooncakeEngine)
        assert worker.config.global_segment_size == int(3.125 * (1 << 30))
        assert lookups.config.global_segment_size == 0
        assert lookups.config.master_server_address == worker.config.master_server_address
    finally:
        for name in names:
            EmbeddedPools.release(name)

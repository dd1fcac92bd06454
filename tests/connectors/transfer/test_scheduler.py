from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.transfer.jobs import HoldJob, RecvJob, ReleaseJob
from kvpool.connectors.transfer.scheduler import PARAM_KEYS, TransferScheduler

BLOCK = 128


class Status(Enum):
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_STOPPED = 2
    FINISHED_ABORTED = 3
    WAITING = 4


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    status: Status = Status.WAITING


@dataclass
class FakeBlock:
    block_id: int
    block_hash: bytes | None = None
    is_null: bool = False


@dataclass
class FakeBlocks:
    """vLLM's KVCacheBlocks, one group: the local prefix hits first, then new blocks."""

    blocks: tuple[list[FakeBlock], ...] = field(default_factory=lambda: ([],))

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [
            [b.block_id for b in g if b.block_hash is None and not b.is_null] for g in self.blocks
        ]


def sched(role: str, engine_id: str = "g0", **kw: Any) -> TransferScheduler:
    # a D's peer is the prefill of prefill_params: dp_size 2 (it is DP rank 1), tp_size 2
    peer = kw.get("peer", Topology(2, 2) if role == "kv_consumer" else Topology(1, 1))
    cfg = TransferConfig(role, 30000, engine_id, peer, kv_host="10.1.1.1")
    return TransferScheduler(
        cfg,
        block_size=BLOCK,
        tp_size=kw.get("tp", 2),
        dp_rank=kw.get("dp", 1),
        num_kv_cache_groups=kw.get("groups", 1),
    )


def prefill_params(p: TransferScheduler, n_blocks: int = 3) -> dict[str, Any]:
    req = FakeRequest("p-1", 300, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED)
    delay, params = p.request_finished(req, list(range(10, 10 + n_blocks)))
    assert delay and params is not None
    return params


def test_prefill_holds_blocks_and_returns_params_for_decode() -> None:
    p = sched("kv_producer")
    params = prefill_params(p)
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "g0",
        "remote_host": "10.1.1.1",
        "remote_port": 30002,  # kv_port + dp_rank 1 * tp_size 2: rank 0 of this DP engine
        "remote_block_ids": [10, 11, 12],
        "remote_request_id": "p-1",
        "remote_block_size": BLOCK,
        "remote_dp_rank": 1,
        "remote_num_tokens": 300,
        "tp_size": 2,
    }
    assert set(params) == set(PARAM_KEYS)
    assert p.build_jobs().holds == [HoldJob("p-1", (10, 11, 12))]
    assert not p.build_jobs()  # jobs go out once


def test_prefill_does_not_hold_aborted_or_plain_requests() -> None:
    p = sched("kv_producer")
    aborted = FakeRequest("a", 300, {"do_remote_decode": True}, Status.FINISHED_ABORTED)
    plain = FakeRequest("b", 300, None, Status.FINISHED_LENGTH_CAPPED)
    assert p.request_finished(aborted, [1, 2]) == (False, None)
    assert p.request_finished(plain, [1, 2]) == (False, None)
    assert not p.build_jobs()
    # and it never claims tokens: P computes its prompts
    assert p.get_num_new_matched_tokens(FakeRequest("c", 300, {"do_remote_decode": True}), 0) == (
        0,
        False,
    )


def test_decode_claims_the_prompt_beyond_its_local_hit_asynchronously() -> None:
    d = sched("kv_consumer", tp=1, dp=0)
    params = prefill_params(sched("kv_producer"))
    req = FakeRequest("d-1", 300, params)
    assert d.get_num_new_matched_tokens(req, 0) == (300, True)
    assert d.get_num_new_matched_tokens(req, 128) == (172, True)
    assert d.get_num_new_matched_tokens(FakeRequest("x", 300, None), 0) == (0, False)


def test_decode_sent_the_prompt_plus_the_first_token_pulls_only_what_p_computed() -> None:
    # The proxy's first-token mode: D's prompt is P's 300 tokens plus P's sampled token.
    d = sched("kv_consumer", tp=1, dp=0)
    params = prefill_params(sched("kv_producer"))
    req = FakeRequest("d-1", 301, params)
    assert d.get_num_new_matched_tokens(req, 0) == (300, True)  # not 301: P has no KV for it
    assert d.get_num_new_matched_tokens(req, 128) == (172, True)
    # P's prompt exactly fills its blocks: D still pulls whole blocks only, never one more
    full = dict(params, remote_num_tokens=256, remote_block_ids=[10, 11, 12])
    assert d.get_num_new_matched_tokens(FakeRequest("d-2", 257, full), 0) == (256, True)
    # a P from before the key: the whole prompt, as before
    old = {k: v for k, v in params.items() if k != "remote_num_tokens"}
    assert d.get_num_new_matched_tokens(FakeRequest("d-3", 300, old), 0) == (300, True)


def test_prefill_that_stopped_does_not_hold_its_blocks() -> None:
    # EOS or a stop string on P's one token: the answer is complete, no D will pull.
    p = sched("kv_producer")
    stopped = FakeRequest("s", 300, {"do_remote_decode": True}, Status.FINISHED_STOPPED)
    assert p.request_finished(stopped, [1, 2]) == (False, None)
    assert not p.build_jobs()


def test_decode_maps_its_new_blocks_onto_the_same_prefill_positions() -> None:
    d = sched("kv_consumer", tp=1, dp=0)
    params = prefill_params(sched("kv_producer"))
    req = FakeRequest("d-1", 300, params)
    # one block came from D's own prefix cache; the other two must be pulled
    blocks = FakeBlocks(([FakeBlock(7, b"h"), FakeBlock(8), FakeBlock(9)],))
    d.update_state_after_alloc(req, blocks, 172)
    jobs = d.build_jobs()
    assert jobs.recvs == [RecvJob("d-1", (8, 9), (11, 12), "p-1", "10.1.1.1", 30002, 2, "g0")]
    assert params["do_remote_prefill"] is False  # one transfer per request
    d.update_state_after_alloc(req, blocks, 0)  # vLLM's second call after the load
    assert not d.build_jobs()


def test_decode_with_nothing_to_load_releases_the_prefill() -> None:
    d = sched("kv_consumer")
    params = prefill_params(sched("kv_producer"))
    d.update_state_after_alloc(FakeRequest("d-2", 300, params), FakeBlocks(), 0)
    assert d.build_jobs().releases == [ReleaseJob("d-2", "p-1", "10.1.1.1", 30002, 2)]


def test_decode_aborted_before_scheduling_releases_the_prefill() -> None:
    d = sched("kv_consumer")
    params = prefill_params(sched("kv_producer"))
    req = FakeRequest("d-3", 300, params, Status.FINISHED_ABORTED)
    assert d.request_finished(req, []) == (False, None)
    assert d.build_jobs().releases == [ReleaseJob("d-3", "p-1", "10.1.1.1", 30002, 2)]


def test_decode_computes_locally_when_params_do_not_fit() -> None:
    params = prefill_params(sched("kv_producer"))
    broken = {k: v for k, v in params.items() if k != "remote_host"}
    other_block = {**params, "remote_block_size": 16}
    other_group = {**params, "remote_engine_id": "another-group_dp0"}
    d = sched("kv_consumer")
    for bad in (broken, other_block, other_group):
        assert d.get_num_new_matched_tokens(FakeRequest("d", 300, dict(bad)), 0) == (0, False)
    hybrid = sched("kv_consumer", groups=2)
    assert hybrid.get_num_new_matched_tokens(FakeRequest("d", 300, dict(params)), 0) == (0, False)
    # computing locally, D lets P go when it knows where P is
    d.update_state_after_alloc(FakeRequest("d-b", 300, dict(other_block)), FakeBlocks(), 0)
    d.update_state_after_alloc(FakeRequest("d-c", 300, dict(broken)), FakeBlocks(), 0)
    assert [r.request_id for r in d.build_jobs().releases] == ["d-b"]


def test_generated_engine_ids_pair_with_anything() -> None:
    params = prefill_params(sched("kv_producer", engine_id="eb936a3b-b9c7-4fe8-a829-51e4ea181170"))
    d = sched("kv_consumer", engine_id="g0")
    assert d.get_num_new_matched_tokens(FakeRequest("d", 300, params), 0) == (300, True)


def test_decode_whose_config_describes_the_wrong_prefill_layout_names_the_key(
    caplog: Any,
) -> None:
    # P runs tp 2 (DP rank 1 of 2); a D whose "prefill" block says its own tp 1 instead
    params = prefill_params(sched("kv_producer"))
    caplog.set_level("WARNING", logger="vllm.kvpool.transfer")
    for wrong in (Topology(2, 1), Topology(1, 2)):  # tp_size wrong; dp_size too small
        d = sched("kv_consumer", peer=wrong)
        assert d.get_num_new_matched_tokens(FakeRequest("d", 300, dict(params)), 0) == (0, False)
        # it computes locally and lets P go at once
        d.update_state_after_alloc(FakeRequest("d-w", 300, dict(params)), FakeBlocks(), 0)
        assert [r.request_id for r in d.build_jobs().releases] == ["d-w"]
    text = caplog.text
    assert 'kv_connector_extra_config["prefill"]' in text
    assert "the prefill runs tp_size 2 but this decode" in text
    assert "the prefill is DP rank 1" in text
    right = sched("kv_consumer", peer=Topology(2, 2))
    assert right.get_num_new_matched_tokens(FakeRequest("d", 300, dict(params)), 0) == (300, True)

"""One broken configuration per row of the production guide's §8.3 table and box of §9 that concerns
the connectors, each asserting doctor's diagnosis; and the correct guide config passing."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.config import Topology
from kvpool.ops.doctor.checks import Check, Status
from kvpool.ops.doctor.checks_connector import (
    Side,
    check_connector_classes,
    check_consumer_is_to_put,
    check_engine_id,
    check_failure_policy,
    check_kv_cache_groups,
    check_kv_ports,
    check_load_async,
    check_lookup_rpc_ports,
    check_roles,
    check_topology,
    connector_checks,
    model_info,
)
from kvpool.ops.kvconfig import parse_kv_transfer_config
from tests.ops.helpers import GQA_MODEL, MLA_MODEL, children, guide_d, guide_p, guideify


def side(name: str, config: dict[str, Any], own: Topology | None = None) -> Side:
    return Side(name, parse_kv_transfer_config(config), own)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_the_guides_pd_pair_with_kvpool_names_passes_every_check() -> None:
    sides = [
        side("prefill", guide_p(), Topology(4, 8)),
        side("decode", guide_d(), Topology(8, 4)),
    ]
    checks = connector_checks(sides, model_info(MLA_MODEL))
    bad = [c for c in checks if c.status is not Status.PASS]
    assert bad == []
    names = {c.name for c in checks}
    for expected in (
        "connector.roles[prefill]",
        "connector.roles[decode]",
        "connector.failure_policy[prefill]",
        "connector.kv_port[pair]",
        "connector.peer_topology[prefill]",
        "connector.peer_topology[decode]",
        "connector.load_async[decode]",
    ):
        assert expected in names


# §9 "MultiConnector on Prefill uses kv_producer" / "on Decode uses kv_consumer"
def test_prefill_with_kv_consumer_fails() -> None:
    p = guide_p()
    p["kv_role"] = "kv_consumer"
    check = check_roles(side("prefill", p))
    assert check.status is Status.FAIL
    assert "kv_producer" in check.message and "kv_consumer" in check.message
    assert '"kv_role": "kv_producer"' in check.fix


def test_decode_child_left_as_kv_producer_fails() -> None:
    d = guide_d()
    children(d)[1]["kv_role"] = "kv_producer"
    check = check_roles(side("decode", d))
    assert check.status is Status.FAIL
    assert "KVPoolStoreConnector" in check.message


# §8.3 "KV load fails, logs full of recompute": policy in a child connector
def test_failure_policy_inside_a_child_is_the_guides_most_common_mistake() -> None:
    p = guide_p()
    del p["kv_load_failure_policy"]
    children(p)[0]["kv_load_failure_policy"] = "recompute"
    check = check_failure_policy(side("prefill", p))
    assert check.status is Status.FAIL
    assert "KVPoolTransferConnector" in check.message
    assert "top level" in check.fix and '"recompute"' in check.fix


def test_failure_policy_missing_or_fail_warns_and_bad_value_fails() -> None:
    p = guide_p()
    del p["kv_load_failure_policy"]
    assert check_failure_policy(side("prefill", p)).status is Status.WARN
    p["kv_load_failure_policy"] = "fail"
    assert check_failure_policy(side("prefill", p)).status is Status.WARN
    p["kv_load_failure_policy"] = "retry"
    assert check_failure_policy(side("prefill", p)).status is Status.FAIL


def test_failure_policy_at_top_and_in_a_child_warns_about_the_ignored_copy() -> None:
    p = guide_p()
    children(p)[1]["kv_load_failure_policy"] = "fail"
    check = check_failure_policy(side("prefill", p))
    assert check.status is Status.WARN and "ignored" in check.message


# §9 "kv_port differs on P and D (30000 vs 30100)"
def test_same_kv_port_on_p_and_d_fails() -> None:
    d = guide_d()
    children(d)[0]["kv_port"] = "30000"
    checks = by_name(check_kv_ports([side("prefill", guide_p()), side("decode", d)]))
    assert checks["connector.kv_port[pair]"].status is Status.FAIL
    assert "30100" in checks["connector.kv_port[pair]"].fix


def test_kv_port_ranges_of_many_ranks_overlapping_fail() -> None:
    # P has 4 x 8 = 32 ranks from 30000: 30000..30031, so D at 30010 collides.
    d = guide_d()
    children(d)[0]["kv_port"] = 30010
    sides = [side("prefill", guide_p(), Topology(4, 8)), side("decode", d)]
    checks = by_name(check_kv_ports(sides))
    assert checks["connector.kv_port[pair]"].status is Status.FAIL
    assert "30000..30031" in checks["connector.kv_port[pair]"].message


def test_missing_or_bad_kv_port_fails() -> None:
    p = guide_p()
    del children(p)[0]["kv_port"]
    assert check_kv_ports([side("prefill", p)])[0].status is Status.FAIL
    children(p)[0]["kv_port"] = "thirty thousand"
    assert check_kv_ports([side("prefill", p)])[0].status is Status.FAIL


# §9 "dp_size/tp_size are the PEER's topology (not your own)"
def test_prefill_describing_itself_instead_of_decode_fails_on_cross_check() -> None:
    p = guide_p()
    children(p)[0]["kv_connector_extra_config"]["decode"] = {"dp_size": 4, "tp_size": 8}
    checks = by_name(
        check_topology(
            [side("prefill", p, Topology(4, 8)), side("decode", guide_d(), Topology(8, 4))]
        )
    )
    check = checks["connector.peer_topology[prefill]"]
    assert check.status is Status.FAIL
    assert "PEER" in check.message
    assert '"decode": {"dp_size": 8, "tp_size": 4}' in check.fix


def test_decode_peer_block_checked_against_the_prefill_config_without_commands() -> None:
    d = guide_d()
    children(d)[0]["kv_connector_extra_config"]["prefill"] = {"dp_size": 8, "tp_size": 4}
    checks = by_name(check_topology([side("prefill", guide_p()), side("decode", d)]))
    assert checks["connector.peer_topology[decode]"].status is Status.FAIL
    assert checks["connector.peer_topology[prefill]"].status is Status.PASS


def test_missing_peer_block_fails_and_own_copy_alone_warns() -> None:
    p = guide_p()
    del children(p)[0]["kv_connector_extra_config"]["decode"]
    assert check_topology([side("prefill", p)])[0].status is Status.FAIL
    lone = guide_p()
    children(lone)[0]["kv_connector_extra_config"]["decode"] = {"dp_size": 4, "tp_size": 8}
    check = check_topology([side("prefill", lone, Topology(4, 8))])[0]
    assert check.status is Status.WARN and "own layout" in check.message


def test_peer_block_not_cross_checked_without_the_peer_is_a_skip() -> None:
    check = check_topology([side("prefill", guide_p())])[0]
    assert check.status is Status.SKIP


def test_own_block_disagreeing_with_the_command_line_warns() -> None:
    checks = by_name(check_topology([side("prefill", guide_p(), Topology(2, 8))]))
    assert checks["connector.own_topology[prefill]"].status is Status.WARN


# §8.3 "port conflict between ranks on one node: lookup_rpc_port equal"
def test_ascend_store_with_the_same_fixed_lookup_port_on_one_host_fails() -> None:
    p, d = guideify(guide_p()), guideify(guide_d())
    children(p)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "5555"
    children(d)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "5555"
    checks = by_name(
        check_lookup_rpc_ports([side("prefill", p), side("decode", d)], same_host=True)
    )
    assert checks["connector.lookup_rpc_port[pair]"].status is Status.FAIL
    assert '"0"' in checks["connector.lookup_rpc_port[pair]"].fix
    apart = check_lookup_rpc_ports([side("prefill", p), side("decode", d)], same_host=False)
    assert all(c.status is not Status.FAIL for c in apart)


def test_ascend_store_fixed_lookup_port_for_many_ranks_warns() -> None:
    p = guideify(guide_p())
    children(p)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "5555"
    check = check_lookup_rpc_ports([side("prefill", p, Topology(4, 8))], same_host=True)[0]
    assert check.status is Status.WARN


def test_kvpool_store_lookup_port_cannot_collide() -> None:
    p, d = guide_p(), guide_d()
    children(p)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "5555"
    children(d)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "5555"
    checks = check_lookup_rpc_ports([side("prefill", p), side("decode", d)], same_host=True)
    assert [c.status for c in checks] == [Status.PASS, Status.PASS]
    children(p)[1]["kv_connector_extra_config"]["lookup_rpc_port"] = "port"
    assert check_lookup_rpc_ports([side("prefill", p)], same_host=True)[0].status is Status.FAIL


# §9 "consumer_is_to_put only for MLA models"
def test_consumer_is_to_put_on_a_non_mla_model_fails() -> None:
    d = guide_d()
    children(d)[1]["kv_connector_extra_config"]["consumer_is_to_put"] = True
    check = check_consumer_is_to_put(side("decode", d), model_info(GQA_MODEL))
    assert check is not None and check.status is Status.FAIL
    assert "not MLA" in check.message and "consumer_is_to_put" in check.fix
    ok = check_consumer_is_to_put(side("decode", d), model_info(MLA_MODEL))
    assert ok is not None and ok.status is Status.PASS
    unknown = check_consumer_is_to_put(side("decode", d), None)
    assert unknown is not None and unknown.status is Status.WARN and "--model" in unknown.fix


def test_consumer_is_to_put_on_a_non_mla_model_passes_when_both_sides_share_tp() -> None:
    d = guide_d()
    extra = children(d)[0]["kv_connector_extra_config"]
    extra["prefill"]["tp_size"] = extra["decode"]["tp_size"] = 4
    children(d)[1]["kv_connector_extra_config"]["consumer_is_to_put"] = True
    check = check_consumer_is_to_put(side("decode", d), model_info(GQA_MODEL))
    assert check is not None and check.status is Status.PASS
    assert "tp_size 4" in check.message


def test_consumer_is_to_put_on_prefill_warns_and_absent_is_no_check() -> None:
    p = guide_p()
    assert check_consumer_is_to_put(side("prefill", p), None) is None
    children(p)[1]["kv_connector_extra_config"]["consumer_is_to_put"] = True
    check = check_consumer_is_to_put(side("prefill", p), model_info(MLA_MODEL))
    assert check is not None and check.status is Status.WARN


@pytest.mark.parametrize(
    ("config", "mla"),
    [
        (MLA_MODEL, True),
        ({"model_type": "deepseek_v2"}, True),
        ({"model_type": "glm_moe_dsa", "kv_lora_rank": 512}, True),
        ({"model_type": "llava", "text_config": {"kv_lora_rank": 512}}, True),
        (GQA_MODEL, False),
        ({"model_type": "glm4_moe", "kv_lora_rank": None}, False),
    ],
)
def test_model_info_detects_mla(config: dict[str, Any], mla: bool) -> None:
    assert model_info(config).is_mla is mla


# the guide's §5.4 / §7: load_async true on the decode side
def test_decode_without_load_async_warns() -> None:
    d = guide_d()
    del children(d)[1]["kv_connector_extra_config"]["load_async"]
    check = check_load_async(side("decode", d))
    assert check is not None and check.status is Status.WARN
    assert '"load_async": true' in check.fix
    assert check_load_async(side("prefill", guide_p())) is None


def test_the_guides_class_names_warn_with_the_kvpool_replacement() -> None:
    check = check_connector_classes(side("prefill", guideify(guide_p())))
    assert check.status is Status.WARN
    assert '"kv_connector": "KVPoolTransferConnector"' in check.fix
    assert '"kv_connector_module_path": "kvpool.connectors.store"' in check.fix


def test_kvpool_class_with_a_wrong_module_path_fails() -> None:
    p = guide_p()
    children(p)[1]["kv_connector_module_path"] = "kvpool.connectors.transfer"
    check = check_connector_classes(side("prefill", p))
    assert check.status is Status.FAIL
    assert '"kv_connector_module_path": "kvpool.connectors.store"' in check.fix


def test_pd_side_without_a_store_child_fails() -> None:
    p = guide_p()
    p["kv_connector_extra_config"]["connectors"] = children(p)[:1]
    check = check_connector_classes(side("prefill", p))
    assert check.status is Status.FAIL and "store" in check.message


def test_kv_both_store_alone_is_the_guides_colocated_mode() -> None:
    both = {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": "kvpool"},
    }
    s = Side.infer(parse_kv_transfer_config(both))
    assert s.side == "both"
    checks = connector_checks([s], None)
    assert all(c.status is Status.PASS for c in checks), checks


def test_engine_ids_that_differ_within_a_pair_warn() -> None:
    p, d = guide_p(), guide_d()
    p["engine_id"], d["engine_id"] = "group-a", "group-b"
    check = check_engine_id([side("prefill", p), side("decode", d)])
    assert check is not None and check.status is Status.WARN
    d["engine_id"] = "group-a"
    same = check_engine_id([side("prefill", p), side("decode", d)])
    assert same is not None and same.status is Status.PASS


# ------------------------------------------------------------------ hybrid models (HMA)

GEMMA3 = {
    "model_type": "gemma3_text",
    "sliding_window": 1024,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}


@pytest.mark.parametrize(
    ("config", "kinds"),
    [
        (GEMMA3, ("sliding window 1024", "full attention")),
        (QWEN3_NEXT, ("Mamba/linear-attention state", "full attention")),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-M"},
            ("Mamba/linear-attention state", "full attention"),
        ),
        (
            {"model_type": "jamba", "attn_layer_period": 8},
            ("full attention", "Mamba/linear-attention state"),
        ),
        (
            {"model_type": "deepseek_v32", "kv_lora_rank": 512, "index_topk": 2048},
            ("MLA", "MLA sparse indexer"),
        ),
        (MLA_MODEL, ("MLA",)),
        (GQA_MODEL, ("full attention",)),
    ],
)
def test_the_kinds_of_kv_cache_a_model_config_describes(
    config: dict[str, Any], kinds: tuple[str, ...]
) -> None:
    assert model_info(config).kv_kinds == kinds


def hybrid_side(child: str = "KVPoolStoreConnector", *switches: str) -> Side:
    modules = {"KVPoolStoreConnector": "kvpool.connectors.store"}
    config = {
        "kv_connector": child,
        "kv_role": "kv_both",
        **({"kv_connector_module_path": modules[child]} if child in modules else {}),
    }
    return Side("both", parse_kv_transfer_config(config), None, frozenset(switches))


def test_a_hybrid_model_keeps_hma_on_with_kvpools_connectors() -> None:
    check = check_kv_cache_groups(hybrid_side(), model_info(GEMMA3))
    assert check.status is Status.PASS and "sliding window 1024, full attention" in check.message
    state = check_kv_cache_groups(
        hybrid_side("KVPoolStoreConnector", "--enable-prefix-caching"), model_info(QWEN3_NEXT)
    )
    assert state.status is Status.PASS
    plain = check_kv_cache_groups(hybrid_side(), model_info(GQA_MODEL))
    assert plain.status is Status.PASS and "HMA not needed" in plain.message


def test_what_turns_hma_off_is_named_and_costs_what_it_costs() -> None:
    flag = hybrid_side("KVPoolStoreConnector", "--disable-hybrid-kv-cache-manager")
    window = check_kv_cache_groups(flag, model_info(GEMMA3))
    assert window.status is Status.WARN and "--disable-hybrid-kv-cache-manager" in window.message
    foreign = check_kv_cache_groups(hybrid_side("SomeOtherConnector"), model_info(QWEN3_NEXT))
    assert foreign.status is Status.FAIL and "will not start" in foreign.message
    assert "SomeOtherConnector does not declare" in foreign.message


def test_a_state_model_without_prefix_caching_is_told_to_turn_it_on() -> None:
    check = check_kv_cache_groups(hybrid_side(), model_info(QWEN3_NEXT))
    assert check.status is Status.WARN and "--enable-prefix-caching" in check.fix
    # a bare --kv-transfer-config (no command line): nothing is known of the flags
    bare = Side("both", hybrid_side().config)
    assert check_kv_cache_groups(bare, model_info(QWEN3_NEXT)).status is Status.PASS

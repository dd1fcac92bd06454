"""Doctor checks over the ``--kv-transfer-config`` of a P, a D, or both (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.config import Topology
from kvpool.ops.doctor.checks import Check, fail, pass_, skip, warn
from kvpool.ops.kvconfig import (
    GUIDE_CONNECTORS,
    KVPOOL_CONNECTORS,
    ConnectorSpec,
    KVTransferConfig,
)

__all__ = [
    "EXPECTED_ROLE",
    "ModelInfo",
    "Side",
    "check_connector_classes",
    "check_consumer_is_to_put",
    "check_engine_id",
    "check_failure_policy",
    "check_kv_ports",
    "check_load_async",
    "check_lookup_rpc_ports",
    "check_roles",
    "check_topology",
    "connector_checks",
    "model_info",
]

EXPECTED_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
_SIDE_OF_ROLE = {role: side for side, role in EXPECTED_ROLE.items()}
_PEER = {"prefill": "decode", "decode": "prefill"}
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa")


@dataclass(frozen=True, slots=True)
class Side:
    """One instance's connector config, with what we know of its own layout."""

    side: str  # "prefill" | "decode" | "both"
    config: KVTransferConfig
    own_topology: Topology | None = None  # from its vLLM command line, when given
    switches: frozenset[str] | None = None  # its vLLM command's switches (None: no command)

    @staticmethod
    def infer(
        config: KVTransferConfig,
        own_topology: Topology | None = None,
        switches: frozenset[str] | None = None,
    ) -> Side:
        """For a config given without saying which side it is: its top-level role decides."""
        side = _SIDE_OF_ROLE.get(config.top.role or "", "prefill")
        return Side(side, config, own_topology, switches)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What doctor reads from the model's ``config.json``."""

    model_type: str
    is_mla: bool
    reason: str
    # its kinds of KV cache, as vLLM groups them ("full attention", "sliding window 4096",
    # "Mamba/linear-attention state", ...): more than one, or a window or a state, is a
    # hybrid model, which needs vLLM's hybrid KV cache manager
    kv_kinds: tuple[str, ...] = ("full attention",)

    @property
    def has_state(self) -> bool:
        return any("state" in kind for kind in self.kv_kinds)

    @property
    def hybrid(self) -> bool:
        return len(self.kv_kinds) > 1 or self.kv_kinds[0] not in ("full attention", "MLA")


def model_info(config: Mapping[str, Any]) -> ModelInfo:
    """MLA (multi-head latent attention) stores one compressed latent per token, the same
    on P and D whatever their TP: that is why the production guide allows decode
    write-back only there."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):  # multimodal wrappers nest the LM's config
        config = {**config, **text_config}
    model_type = str(config.get("model_type", "unknown"))
    kinds = kv_kinds(config)
    if config.get("kv_lora_rank") not in (None, 0):
        return ModelInfo(model_type, True, f"kv_lora_rank={config['kv_lora_rank']} (MLA)", kinds)
    if model_type in _MLA_MODEL_TYPES:
        return ModelInfo(model_type, True, f"model_type {model_type} uses MLA", kinds)
    reason = f"model_type {model_type} has no kv_lora_rank (not MLA)"
    return ModelInfo(model_type, False, reason, kinds)


_LAYER_TYPES = {
    "full_attention": "full attention",
    "attention": "full attention",
    "sliding_attention": "sliding window",
    "chunked_attention": "chunked local attention",
    "linear_attention": "Mamba/linear-attention state",
    "mamba": "Mamba/linear-attention state",
}


def kv_kinds(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The kinds of KV cache a model's ``config.json`` describes, in the order met: from
    ``layer_types`` (Gemma 3, gpt-oss, Qwen3-Next), Nemotron-H's
    ``hybrid_override_pattern``, Jamba's ``attn_layer_period``, MLA's ``kv_lora_rank``
    (and DeepSeek-V3.2's sparse indexer, ``index_topk``), a model-wide ``sliding_window``."""
    window = config.get("sliding_window")
    found: list[str] = []

    def add(kind: str) -> None:
        if kind == "sliding window" and window:
            kind = f"sliding window {window}"
        if kind not in found:
            found.append(kind)

    if config.get("kv_lora_rank") not in (None, 0):
        add("MLA")
        if config.get("index_topk"):
            add("MLA sparse indexer")
    layer_types = config.get("layer_types")
    pattern = config.get("hybrid_override_pattern")
    if isinstance(layer_types, list) and layer_types:
        for kind in layer_types:
            add(_LAYER_TYPES.get(str(kind), str(kind)))
    elif isinstance(pattern, str) and pattern:
        for symbol in pattern:
            if symbol == "M":
                add("Mamba/linear-attention state")
            elif symbol == "*":
                add("full attention")
    elif config.get("attn_layer_period"):
        add("full attention")
        add("Mamba/linear-attention state")
    elif window and not found:
        add("sliding window")
    return tuple(found) or ("full attention",)


def _where(side: Side, entry: ConnectorSpec) -> str:
    if entry is side.config.top:
        return f"{side.side}: top level ({entry.name})"
    return f"{side.side}: {entry.name}"


def check_connector_classes(side: Side) -> Check:
    name = f"connector.classes[{side.side}]"
    problems: list[str] = []
    fixes: list[str] = []
    notes: list[str] = []
    for entry in side.config.entries:
        if entry.kind == "multi":
            continue
        if entry.name in GUIDE_CONNECTORS:
            kvpool_name = GUIDE_CONNECTORS[entry.name][1]
            module = KVPOOL_CONNECTORS[kvpool_name][1]
            notes.append(f"{entry.name} is the production guide's class")
            fixes.append(
                f'replace "kv_connector": "{entry.name}" with "kv_connector": "{kvpool_name}",'
                f' "kv_connector_module_path": "{module}"'
            )
        elif entry.name in KVPOOL_CONNECTORS:
            module = KVPOOL_CONNECTORS[entry.name][1]
            if entry.module_path != module:
                problems.append(
                    f"{entry.name} has kv_connector_module_path {entry.module_path!r}:"
                    " vLLM cannot import it"
                )
                fixes.append(f'set "kv_connector_module_path": "{module}" in {entry.name}')
        else:
            notes.append(f"{entry.name} is not a kvpool connector (not checked further)")
    kinds = {e.kind for e in side.config.entries}
    if side.side in ("prefill", "decode") and not {"transfer", "store"} <= kinds:
        missing = sorted({"transfer", "store"} - kinds)
        problems.append(
            f"no {' or '.join(missing)} connector (the production guide's P/D layout has both)"
        )
        fixes.append(
            "use MultiConnector with KVPoolTransferConnector and KVPoolStoreConnector children"
            " (kvpool config render writes one)"
        )
    if problems:
        return fail(name, "; ".join(problems + notes), "; ".join(fixes))
    if fixes:
        return warn(
            name, "; ".join(notes) + ": kvpool serves it under its own name", "; ".join(fixes)
        )
    return pass_(name, "connector classes: " + ", ".join(e.name for e in side.config.entries))


def check_roles(side: Side) -> Check:
    name = f"connector.roles[{side.side}]"
    expected = EXPECTED_ROLE[side.side]
    wrong = [
        f"{_where(side, e)} has kv_role {e.role!r}"
        for e in side.config.entries
        if e.role != expected
    ]
    if wrong:
        return fail(
            name,
            f"the {side.side} side must use {expected}: " + "; ".join(wrong),
            f'set "kv_role": "{expected}" at the top level and in every child connector',
        )
    return pass_(name, f"{side.side} uses {expected} throughout")


def check_failure_policy(side: Side) -> Check:
    name = f"connector.failure_policy[{side.side}]"
    top = side.config.top
    policy = top.raw.get("kv_load_failure_policy")
    in_children = [c.name for c in side.config.children if "kv_load_failure_policy" in c.raw]
    move = (
        '"kv_load_failure_policy": "recompute" at the top level, next to'
        f' "kv_connector": "{top.name}"'
    )
    if policy is None and in_children:
        return fail(
            name,
            f"kv_load_failure_policy is inside the child connector(s) {', '.join(in_children)};"
            " vLLM reads it only at the top level, so a failed load fails the request"
            " (the production guide's most common mistake)",
            f"move it out of the child: {move}",
        )
    if policy not in (None, "recompute", "fail"):
        return fail(name, f"kv_load_failure_policy {policy!r} is not recompute or fail", move)
    if policy != "recompute":
        told = "is not set (vLLM's default is fail)" if policy is None else "is fail"
        return warn(
            name, f"kv_load_failure_policy {told}: a failed KV load fails the request", move
        )
    if in_children:
        return warn(
            name,
            f"recompute is set at the top level, but {', '.join(in_children)} also carry it"
            " (ignored there)",
            "remove kv_load_failure_policy from the child connectors",
        )
    return pass_(name, "kv_load_failure_policy is recompute at the top level")


def check_kv_ports(sides: Sequence[Side]) -> list[Check]:
    """Each transfer connector has a kv_port; P's and D's per-rank port ranges are disjoint."""
    results: list[Check] = []
    ranges: dict[str, range] = {}
    for side in sides:
        name = f"connector.kv_port[{side.side}]"
        transfer = side.config.transfer
        if transfer is None:
            continue
        port = transfer.port("kv_port")
        if not isinstance(port, int) or not 0 < port < 65536:
            fix = '"kv_port": "30000" on P, "kv_port": "30100" on D'
            results.append(fail(name, f"{transfer.name} has kv_port {port!r}", f"set {fix}"))
            continue
        ranks = side.own_topology.ranks if side.own_topology else 1
        ranges[side.side] = range(port, port + ranks)
        results.append(pass_(name, f"kv_port {port} ({ranks} rank(s): {port}..{port + ranks - 1})"))
    if "prefill" in ranges and "decode" in ranges:
        p, d = ranges["prefill"], ranges["decode"]
        if p.start == d.start or (p.start < d.stop and d.start < p.stop):
            results.append(
                fail(
                    "connector.kv_port[pair]",
                    f"P's kv_port range {p.start}..{p.stop - 1} and D's {d.start}..{d.stop - 1}"
                    " overlap: on a shared host the second instance cannot listen",
                    'use "kv_port": "30000" on P and "kv_port": "30100" on D'
                    " (the production guide's values)",
                )
            )
        else:
            results.append(pass_("connector.kv_port[pair]", "P and D use distinct kv_ports"))
    return results


def _topology_of(side: Side, which: str) -> Topology | str | None:
    transfer = side.config.transfer
    return None if transfer is None else transfer.topology(which)


def check_topology(sides: Sequence[Side]) -> list[Check]:
    """The production guide's trap: the extra config's dp_size/tp_size must describe the PEER."""
    results: list[Check] = []
    by_side = {s.side: s for s in sides}
    for side in sides:
        if side.side not in _PEER or side.config.transfer is None:
            continue
        peer_name = _PEER[side.side]
        name = f"connector.peer_topology[{side.side}]"
        told = _topology_of(side, peer_name)
        if told is None:
            results.append(
                fail(
                    name,
                    f'the {side.side} side\'s transfer connector has no "{peer_name}" block, so it'
                    " cannot route KV to the peer's ranks",
                    f'add "{peer_name}": {{"dp_size": N, "tp_size": M}} with the {peer_name}'
                    " side's real layout to kv_connector_extra_config",
                )
            )
            continue
        if isinstance(told, str):
            results.append(
                fail(name, f"malformed topology {told}", 'write {"dp_size": N, "tp_size": M}')
            )
            continue
        peer = by_side.get(peer_name)
        actual = _actual_topology(peer) if peer is not None else None
        if actual is not None and actual != told:
            results.append(
                fail(
                    name,
                    f'the {side.side} side says "{peer_name}": {told}, but the {peer_name}'
                    f" side runs {actual}: dp_size/tp_size must describe the PEER, not itself",
                    f'set "{peer_name}": {actual} in the {side.side} side\'s transfer connector',
                )
            )
        elif actual is None and side.own_topology is not None and told == side.own_topology:
            results.append(
                warn(
                    name,
                    f'"{peer_name}": {told} equals this {side.side} side\'s own layout; it must'
                    f" describe the {peer_name} side (fine only if both really match)",
                    f"give the {peer_name} side's config (--{peer_name}-config) to cross-check",
                )
            )
        elif actual is None:
            results.append(
                skip(name, f'"{peer_name}": {told} not cross-checked (no {peer_name} config)')
            )
        else:
            results.append(pass_(name, f'"{peer_name}": {told} matches the {peer_name} side'))
        own = _topology_of(side, side.side)
        if isinstance(own, Topology) and side.own_topology and own != side.own_topology:
            results.append(
                warn(
                    f"connector.own_topology[{side.side}]",
                    f'"{side.side}": {own} disagrees with its vLLM command ({side.own_topology})',
                    f'set "{side.side}": {side.own_topology} or fix -tp/-dp',
                )
            )
    return results


def _actual_topology(side: Side) -> Topology | None:
    """A side's real layout: its command line, else the block describing itself."""
    if side.own_topology is not None:
        return side.own_topology
    own = _topology_of(side, side.side)
    return own if isinstance(own, Topology) else None


def check_lookup_rpc_ports(sides: Sequence[Side], *, same_host: bool) -> list[Check]:
    results: list[Check] = []
    fixed: dict[int, list[str]] = {}
    for side in sides:
        store = side.config.store
        if store is None:
            continue
        name = f"connector.lookup_rpc_port[{side.side}]"
        port = store.port("lookup_rpc_port")
        if port is None or port == 0:
            results.append(pass_(name, "lookup_rpc_port 0: each rank picks a free port"))
            continue
        if not isinstance(port, int) or port >= 65536:
            results.append(fail(name, f"lookup_rpc_port {port!r} is not a port", 'set "0"'))
            continue
        if store.name in KVPOOL_CONNECTORS:
            results.append(
                pass_(
                    name,
                    f"lookup_rpc_port {port}: {store.name} takes no TCP port for lookups (it"
                    " asks the master, or a per-instance Unix socket when embedded), so it"
                    " cannot collide",
                )
            )
            continue
        fixed.setdefault(port, []).append(side.side)
        ranks = side.own_topology.ranks if side.own_topology else 1
        if ranks > 1:
            results.append(
                warn(
                    name,
                    f"lookup_rpc_port {port} is fixed for {ranks} ranks of one instance",
                    '"lookup_rpc_port": "0" lets every rank pick a free port',
                )
            )
        else:
            results.append(pass_(name, f"lookup_rpc_port {port}"))
    for port, owners in fixed.items():
        if same_host and len(owners) > 1:
            results.append(
                fail(
                    "connector.lookup_rpc_port[pair]",
                    f"{' and '.join(owners)} both use lookup_rpc_port {port} on one host",
                    'set "lookup_rpc_port": "0" (auto) or a different port on each instance',
                )
            )
    return results


def check_load_async(side: Side) -> Check | None:
    store = side.config.store
    if store is None or side.side != "decode":
        return None
    name = "connector.load_async[decode]"
    if store.extra.get("load_async") is True:
        return pass_(name, "the decode side loads from the pool asynchronously")
    return warn(
        name,
        f"load_async is {store.extra.get('load_async', 'unset')!r} on the decode side:"
        " loads from the pool stall the engine",
        f'add "load_async": true to {store.name}\'s kv_connector_extra_config',
    )


def check_consumer_is_to_put(side: Side, model: ModelInfo | None) -> Check | None:
    store = side.config.store
    if store is None or not store.extra.get("consumer_is_to_put"):
        return None
    name = f"connector.consumer_is_to_put[{side.side}]"
    if side.side != "decode":
        return warn(
            name,
            f"consumer_is_to_put is set on the {side.side} side, where it has no effect",
            "remove it; it is a decode-side (kv_consumer) option",
        )
    if model is not None and model.is_mla:
        return pass_(name, f"consumer_is_to_put on an MLA model ({model.reason})")
    # Not MLA (or unknown): decode's blocks match prefill's only when KV heads are split
    # alike, i.e. both sides run the same tp_size (the store connector refuses otherwise).
    prefill = _topology_of(side, "prefill")
    decode = _actual_topology(side)
    what = f"the model is not MLA ({model.reason})" if model is not None else "the model is unknown"
    if isinstance(prefill, Topology) and decode is not None:
        if prefill.tp_size != decode.tp_size and model is None:
            return warn(
                name,
                f"consumer_is_to_put is on, prefill tp_size {prefill.tp_size} != decode tp_size"
                f" {decode.tp_size}, and {what}: it is only safe for an MLA model here",
                "run doctor with --model /path/to/model (the directory with config.json)",
            )
        if prefill.tp_size != decode.tp_size:
            return fail(
                name,
                f"consumer_is_to_put is on, {what}, and prefill tp_size {prefill.tp_size} !="
                f" decode tp_size {decode.tp_size}: decode's KV layout differs from prefill's,"
                " so written-back blocks could never be read by prefill",
                f'remove "consumer_is_to_put" from {store.name}, or run both sides with the'
                " same tp_size",
            )
        return pass_(
            name,
            f"consumer_is_to_put with {what}: both sides use tp_size {decode.tp_size}, so the"
            " KV layouts match",
        )
    return warn(
        name,
        f"consumer_is_to_put is on, {what}, and the two sides' tp_size is not known: it is"
        " only safe for MLA models or when prefill and decode use the same tp_size",
        'give --model, and "prefill"/"decode" dp_size/tp_size in the transfer connector',
    )


def check_engine_id(sides: Sequence[Side]) -> Check | None:
    ids = {s.side: s.config.top.raw.get("engine_id") for s in sides if s.side in _PEER}
    if len(ids) < 2 or None in ids.values():
        return None
    if ids["prefill"] != ids["decode"]:
        return warn(
            "connector.engine_id[pair]",
            f"P has engine_id {ids['prefill']!r} and D {ids['decode']!r};"
            " the production guide pairs a P and its D by one engine_id",
            "give the paired P and D the same engine_id (or leave it unset on both)",
        )
    return pass_("connector.engine_id[pair]", f"P and D share engine_id {ids['prefill']!r}")


# Connectors of vLLM's own that declare SupportsHMA (vLLM 0.32), besides kvpool's two and
# MultiConnector (which does when every child does).
_HMA_CONNECTORS = frozenset(
    {
        "MultiConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "NixlConnector",
        "OffloadingConnector",
        "LMCacheMPConnector",
    }
)


def check_kv_cache_groups(side: Side, model: ModelInfo) -> Check:
    """The model's kinds of KV cache, and whether vLLM's hybrid KV cache manager stays on
    with this instance's connectors and flags (vLLM turns it off for any connector that
    does not declare SupportsHMA: a model with a recurrent state then does not start, and
    a sliding-window model keeps every layer's KV for the whole context)."""
    name = f"connector.kv_cache_groups[{side.side}]"
    kinds = ", ".join(model.kv_kinds)
    if not model.hybrid:
        return pass_(name, f"{model.model_type}: one kind of KV cache ({kinds}); HMA not needed")
    off: list[str] = []
    switches = side.switches or frozenset()
    if "--disable-hybrid-kv-cache-manager" in switches:
        off.append("--disable-hybrid-kv-cache-manager is set")
    for entry in side.config.entries:
        known = entry.name in KVPOOL_CONNECTORS or entry.name in _HMA_CONNECTORS
        if not known and entry.name not in GUIDE_CONNECTORS:
            off.append(f"{entry.name} does not declare vLLM's SupportsHMA")
    if off:
        effect = (
            "the model will not start (its recurrent state needs HMA)"
            if model.has_state
            else "its window layers keep KV for the whole context (less KV cache)"
        )
        return (fail if model.has_state else warn)(
            name,
            f"{model.model_type} is hybrid ({kinds}) but vLLM turns its hybrid KV cache"
            f" manager off: {'; '.join(off)}: {effect}",
            "drop --disable-hybrid-kv-cache-manager; use kvpool's connectors (both keep HMA on)",
        )
    if model.has_state and side.switches is not None and "--enable-prefix-caching" not in switches:
        return warn(
            name,
            f"{model.model_type} keeps a recurrent state ({kinds}); without prefix caching vLLM"
            " keeps no state at block boundaries, and KVPoolStoreConnector refuses to start",
            "add --enable-prefix-caching (vLLM then sets --mamba-cache-mode align)",
        )
    return pass_(name, f"{model.model_type} is hybrid ({kinds}); HMA stays on with its connectors")


def connector_checks(
    sides: Sequence[Side], model: ModelInfo | None, *, same_host: bool = True
) -> list[Check]:
    """Every connector check, in report order."""
    if not sides:
        return [skip("connector", "no --kv-transfer-config / --prefill-config / --decode-config")]
    results: list[Check] = []
    for side in sides:
        results += [check_connector_classes(side), check_roles(side), check_failure_policy(side)]
    results += check_kv_ports(sides)
    results += check_topology(sides)
    results += check_lookup_rpc_ports(sides, same_host=same_host)
    for side in sides:
        for optional in (check_load_async(side), check_consumer_is_to_put(side, model)):
            if optional is not None:
                results.append(optional)
        if model is not None:
            results.append(check_kv_cache_groups(side, model))
    engine = check_engine_id(sides)
    if engine is not None:
        results.append(engine)
    return results

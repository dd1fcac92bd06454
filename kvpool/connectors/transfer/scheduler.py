"""The scheduler half of the transfer connector: decides what to hold, pull and release.

No vLLM import: it reads a few request attributes and vLLM's ``KVCacheBlocks``, so it is
unit-tested with fakes; the P/D flow is described on :class:`TransferScheduler`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.config.kv_transfer import TRANSFER_CONNECTOR, TransferConfig, pairing_group
from kvpool.config.topology import Topology, rank_port
from kvpool.connectors.transfer.jobs import GroupPull, HoldJob, RecvJob, ReleaseJob, TransferJobs

__all__ = ["PARAM_KEYS", "TransferScheduler"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{TRANSFER_CONNECTOR}]"
# Only a prefill cut at its max_tokens has an answer left for a D to continue: one that
# stopped (EOS, a stop string) is complete, so no D will come for its blocks (as vLLM's
# own NixlConnector decides).
_FINISHED_OK = ("FINISHED_LENGTH_CAPPED",)
# Keys of kv_transfer_params are vLLM's P/D convention (do_remote_prefill, remote_*,
# tp_size), so any P/D proxy works unchanged; another connector under the same
# MultiConnector must not return these keys (MultiConnector rejects duplicates).
PARAM_KEYS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "remote_block_size",
    "remote_dp_rank",
    "remote_num_tokens",
    "tp_size",
)
_REQUIRED = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "tp_size",
)


def _layout_problem(params: dict[str, Any], peer: Topology) -> str | None:
    """Why the prefill that sent ``params`` is not the one D's config describes.

    The P→D routing itself follows the ``tp_size`` P reports, but a config that
    describes the wrong side (the guide's §5.4 trap: a side's own layout instead of its
    peer's) is wrong on P as well, where it decides which D ranks P waits for.  So D
    refuses to pull and says which key to fix, rather than half-working.
    """
    key = 'kv_connector_extra_config["prefill"]'
    remote_tp = params["tp_size"]
    if remote_tp != peer.tp_size:
        return (
            f"the prefill runs tp_size {remote_tp} but this decode's {key} says {peer}; "
            f'it must describe the prefill side: set {key} to {{"tp_size": {remote_tp}, ...}}'
        )
    remote_dp = params.get("remote_dp_rank", 0)
    if not isinstance(remote_dp, int) or not 0 <= remote_dp < peer.dp_size:
        return (
            f"the prefill is DP rank {remote_dp} but this decode's {key} says {peer}; "
            "its dp_size must be the prefill side's"
        )
    return None


def _block_lists_problem(blocks: Any, groups: int) -> str | None:
    """Why ``remote_block_ids`` are not what this D's model needs: a list of block ids (one
    KV cache group), or one such list per group (a hybrid model)."""

    def ids(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(b, int) for b in value)

    if groups == 1:
        return None if ids(blocks) else "remote_block_ids must be a list of block ids"
    if not isinstance(blocks, list) or len(blocks) != groups or not all(map(ids, blocks)):
        return (
            f"remote_block_ids must be {groups} lists of block ids, one per KV cache group"
            " (the prefill serves another model?)"
        )
    return None


def _remote_problem(
    params: dict[str, Any],
    block_size: int,
    group: str | None,
    peer: Topology | None = None,
    groups: int = 1,
) -> str | None:
    """Why this D should not pull with ``params`` (``None``: it should)."""
    missing = [key for key in _REQUIRED if key not in params]
    if missing:
        return f"kv_transfer_params lack {missing}"
    if peer is not None:
        problem = _layout_problem(params, peer)
        if problem is not None:
            return problem
    problem = _block_lists_problem(params["remote_block_ids"], groups)
    if problem is not None:
        return problem
    remote_block_size = params.get("remote_block_size", block_size)
    if remote_block_size != block_size:
        return f"prefill block size {remote_block_size} differs from this decode's {block_size}"
    remote_group = pairing_group(str(params["remote_engine_id"]))
    if group is not None and remote_group is not None and remote_group != group:
        return f"prefill engine_id group {remote_group!r} does not pair with {group!r}"
    return None


class TransferScheduler:
    """Scheduler-side state of one engine (one DP rank).

    The P/D flow, as vLLM's proxy pattern drives it:

    1. The proxy sends the request to P with
       ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``.  When it
       finishes, :meth:`request_finished` keeps its blocks (returns ``True``), queues a
       :class:`HoldJob` for P's workers, and returns the params D needs
       (:data:`PARAM_KEYS`); vLLM puts them in P's response.
    2. The proxy sends the request to D with those params.
       :meth:`get_num_new_matched_tokens` claims every prompt token not already in D's
       local prefix cache, asynchronously; :meth:`update_state_after_alloc` turns the
       claim into a :class:`RecvJob` that maps D's new blocks onto P's blocks for the
       same tokens.  D's prompt may be longer than P's (a proxy that sends D the prompt
       plus P's first token): only the ``remote_num_tokens`` P computed are pulled, and
       D computes the rest.
    3. D's workers pull; P's workers free the blocks when D has them (or after
       ``hold_timeout_ms``).  A D that will not pull (abort before scheduling, nothing
       left to load) sends a :class:`ReleaseJob` so P frees at once.
    """

    def __init__(
        self,
        config: TransferConfig,
        *,
        block_size: int,
        tp_size: int,
        dp_rank: int,
        num_kv_cache_groups: int = 1,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.num_kv_cache_groups = num_kv_cache_groups
        self.state_groups = state_groups  # a hybrid model's groups of recurrent state
        self._local_hits: dict[str, int] = {}  # D: vLLM's own hit, at lookup
        self._jobs = TransferJobs()
        self._warned: set[str] = set()
        # the prefill side's layout as this D's config describes it (kv_both: its own
        # peer section is ambiguous, so it trusts what the prefill reports)
        self._peer = config.peer if config.role == "kv_consumer" else None

    # -- D ---------------------------------------------------------------------------

    def _should_pull(self, request: Any) -> bool:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return False
        problem = _remote_problem(
            params, self.block_size, self.config.group, self._peer, self.num_kv_cache_groups
        )
        if problem is None and self.state_groups and params["tp_size"] != self.tp_size:
            problem = (
                f"the prefill runs tp_size {params['tp_size']} and this decode"
                f" {self.tp_size}: a recurrent state (KV cache groups"
                f" {sorted(self.state_groups)}) is split by rank and moves only between"
                " equal TP sizes"
            )
        if problem is not None:
            if problem not in self._warned:  # once per kind of problem, not per request
                self._warned.add(problem)
                logger.warning("%s computing locally, not pulling: %s", _PREFIX, problem)
            return False
        return True

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """D: every prompt token P computed beyond the local prefix hit comes from P,
        asynchronously.  P's count, not D's prompt: a D sent the prompt plus P's first
        token has one token more than P has KV for, and computes that one itself."""
        if not self._should_pull(request):
            return 0, False
        params = request.kv_transfer_params
        num_tokens = int(request.num_prompt_tokens)
        remote = params.get("remote_num_tokens")
        if isinstance(remote, int) and not isinstance(remote, bool) and remote >= 0:
            num_tokens = min(num_tokens, remote)  # absent: a P from before the key
        count = num_tokens - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        local_hit = self._local_hits.pop(request.request_id, 0)
        if not params or not params.get("do_remote_prefill"):
            return
        should_pull = self._should_pull(request)
        # One transfer per request: a second call (after the load) must not pull again.
        params["do_remote_prefill"] = False
        if not should_pull:
            if all(key in params for key in _REQUIRED):
                # A reachable P that this D will not read from (other block size, hybrid
                # model): let it free the blocks now.  P refuses it for a foreign group.
                self._jobs.releases.append(self._release(request.request_id, params))
            return
        if num_external_tokens == 0:
            # Nothing to load (another connector or the local cache has it all): let P go.
            self._jobs.releases.append(self._release(request.request_id, params))
            return
        if self.num_kv_cache_groups > 1:
            self._jobs.recvs.append(self._group_job(request, params, blocks, local_hit))
            return
        (local,) = blocks.get_unhashed_block_ids_all_groups()
        # Blocks vLLM already had (a local prefix hit) lead the list; P's blocks for the
        # same tokens are at the same positions of its list.
        num_hit = sum(1 for block in blocks.blocks[0] if block.block_hash is not None)
        remote = list(params["remote_block_ids"])[num_hit : num_hit + len(local)]
        # A length mismatch is left to the worker, which reports it as a failed load:
        # the request already waits for this load and must hear back.
        self._jobs.recvs.append(
            RecvJob(
                request_id=request.request_id,
                local_block_ids=tuple(local),
                remote_block_ids=tuple(remote),
                remote_request_id=str(params["remote_request_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                remote_tp_size=int(params["tp_size"]),
                remote_engine_id=str(params["remote_engine_id"]),
            )
        )

    def _group_job(
        self, request: Any, params: dict[str, Any], blocks: Any, local_hit: int
    ) -> RecvJob:
        """A hybrid model's pull: per KV cache group, each block vLLM allocated for the
        load (not null: a window's skipped chunks are) paired with P's block at the same
        position; a state group's one state with P's last one (the state after all the
        tokens P computed, wherever each side's manager keeps it)."""
        skip = local_hit // self.block_size  # chunks vLLM had: not pulled
        groups = []
        for g, (mine, theirs) in enumerate(
            zip(blocks.get_block_ids(), params["remote_block_ids"], strict=True)
        ):
            if g in self.state_groups:
                mine_live = [b for b in mine if b]
                theirs_live = [b for b in theirs if b]
                pairs = list(zip(mine_live[-1:], theirs_live[-1:], strict=False))
                if len(mine_live) and not theirs_live:
                    pairs = [(mine_live[-1], 0)]  # the worker fails it: P kept no state
            else:
                pairs = [
                    (b, theirs[i] if i < len(theirs) else 0)
                    for i, b in enumerate(mine[: len(theirs)])
                    if i >= skip and b
                ]
            if pairs:
                local, remote = zip(*pairs, strict=True)
                groups.append(GroupPull(g, tuple(local), tuple(remote)))
        return RecvJob(
            request_id=request.request_id,
            local_block_ids=tuple(b for group in groups for b in group.local_block_ids),
            remote_block_ids=(),
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_tp_size=int(params["tp_size"]),
            remote_engine_id=str(params["remote_engine_id"]),
            groups=tuple(groups),
        )

    def _release(self, request_id: str, params: dict[str, Any]) -> ReleaseJob:
        return ReleaseJob(
            request_id=request_id,
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_tp_size=int(params["tp_size"]),
        )

    # -- P ---------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (a hybrid model: one list per group)."""
        self._local_hits.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self.config.is_consumer:
            # D: finished (aborted) before it was ever scheduled; P still holds the blocks.
            params["do_remote_prefill"] = False
            groups = self.num_kv_cache_groups
            if _remote_problem(params, self.block_size, self.config.group, None, groups) is None:
                self._jobs.releases.append(self._release(request.request_id, params))
            return False, None
        if not params.get("do_remote_decode") or not self.config.is_producer:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        lists: list[list[int]] = (
            [list(ids) for ids in block_ids] if isinstance(block_ids, tuple) else [list(block_ids)]
        )
        hybrid = len(lists) > 1
        held = [b for ids in lists for b in ids if b or not hybrid]
        if status not in _FINISHED_OK or not held:
            return False, None  # aborted or errored: nothing for a D to pull
        self._jobs.holds.append(HoldJob(request.request_id, tuple(dict.fromkeys(held))))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.kv_host,
            "remote_port": rank_port(self.config.kv_port, self.dp_rank, self.tp_size, 0),
            "remote_block_ids": lists if hybrid else lists[0],
            "remote_request_id": request.request_id,
            "remote_block_size": self.block_size,
            "remote_dp_rank": self.dp_rank,
            # the prompt tokens P has KV for: a D's prompt may be longer (P's first token)
            "remote_num_tokens": int(request.num_prompt_tokens),
            "tp_size": self.tp_size,
        }

    # -- every step --------------------------------------------------------------------

    def build_jobs(self) -> TransferJobs:
        jobs, self._jobs = self._jobs, TransferJobs()
        return jobs

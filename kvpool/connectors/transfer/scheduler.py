"""The scheduler half of the transfer connector: decides what to hold, pull and release.

No vLLM import: it reads the few request attributes it needs (``request_id``,
``kv_transfer_params``, ``num_prompt_tokens``, ``status``) and vLLM's ``KVCacheBlocks``
(``blocks``, ``get_unhashed_block_ids_all_groups``), so it is unit-tested with fakes.
The P/D flow it drives is described on :class:`TransferScheduler`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.config.kv_transfer import TRANSFER_CONNECTOR, TransferConfig, pairing_group
from kvpool.config.topology import Topology, rank_port
from kvpool.connectors.transfer.jobs import HoldJob, RecvJob, ReleaseJob, TransferJobs

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


def _remote_problem(
    params: dict[str, Any], block_size: int, group: str | None, peer: Topology | None = None
) -> str | None:
    """Why this D should not pull with ``params`` (``None``: it should)."""
    missing = [key for key in _REQUIRED if key not in params]
    if missing:
        return f"kv_transfer_params lack {missing}"
    if peer is not None:
        problem = _layout_problem(params, peer)
        if problem is not None:
            return problem
    blocks = params["remote_block_ids"]
    if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
        return "remote_block_ids must be a list of block ids"
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
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.num_kv_cache_groups = num_kv_cache_groups
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
        problem = _remote_problem(params, self.block_size, self.config.group, self._peer)
        if problem is None and self.num_kv_cache_groups != 1:
            problem = (
                f"{self.num_kv_cache_groups} KV cache groups (hybrid models) are not supported"
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
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
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
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self.config.is_consumer:
            # D: finished (aborted) before it was ever scheduled; P still holds the blocks.
            params["do_remote_prefill"] = False
            if _remote_problem(params, self.block_size, self.config.group) is None:
                self._jobs.releases.append(self._release(request.request_id, params))
            return False, None
        if not params.get("do_remote_decode") or not self.config.is_producer:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if status not in _FINISHED_OK or not block_ids:
            return False, None  # aborted or errored: nothing for a D to pull
        self._jobs.holds.append(HoldJob(request.request_id, tuple(block_ids)))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.kv_host,
            "remote_port": rank_port(self.config.kv_port, self.dp_rank, self.tp_size, 0),
            "remote_block_ids": list(block_ids),
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

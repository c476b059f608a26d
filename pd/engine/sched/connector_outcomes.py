"""What the connector reports, applied to the scheduler's requests: finished loads and sends, load
failures and pages that failed verification (a part of `Scheduler`, kept apart for its size).

Guarantees: a failed load never counts as computed; its pages never enter the prefix cache; the
request either recomputes its prompt locally or ends with the load's error
(`EngineConfig.kv_load_failure_policy`).
"""
from __future__ import annotations

import logging
import time
import collections
from collections.abc import Callable

from kvcache import KVCacheManager, RequestStatus

from connectors.base import ConnectorOutput, KVConnectorScheduler
from connectors.metrics import FailureCause
from connectors.params import TransferParams
from pd.engine.outputs import FinishReason, RequestOutput
from pd.engine.config import EngineConfig
from pd.engine.sched.request_state import RequestState
from pd.engine.sched.stats import SchedulerStats

logger = logging.getLogger(__name__)


class ConnectorOutcomes:
    """Methods of `Scheduler` that apply the connector's reports (mixed into it; the attributes below
    are the scheduler's)."""

    config: EngineConfig
    mgr: KVCacheManager
    connector: KVConnectorScheduler
    requests: dict[str, RequestState]
    running: list[RequestState]
    waiting: collections.deque[RequestState]
    remote_waiting: list[RequestState]
    held: dict[str, RequestState]
    finished_recving: set[str]
    stats: SchedulerStats
    _finish: Callable[..., TransferParams | None]
    _release: Callable[[RequestState], None]
    on_load_landed: Callable[[RequestState], None] | None = None  # the KV audit's sampler (runner/kv_audit.py)

    def _promote_finished_loads(self) -> None:
        """Requests whose async load finished go back to the front of the waiting queue."""
        done = [s for s in self.remote_waiting if s.request.request_id in self.finished_recving]
        for state in reversed(done):
            req = state.request
            self.remote_waiting.remove(state)
            self.finished_recving.discard(req.request_id)
            if state.load_failed:
                if self.config.kv_load_failure_policy == "fail":
                    self._finish(state, RequestStatus.FINISHED_ERROR, *_load_error(state))
                    continue
                # Recompute locally: drop every block of the failed load (never cache unverified pages).
                logger.warning("KV load for %s failed; recomputing the prompt locally", req.request_id)
                self.mgr.free(req)
                req.num_computed_tokens = 0
                state.skip_connector_load = True
                state.restart_compute()
                self.stats.num_load_failures_recomputed += 1
            else:
                self.mgr.cache_blocks(req, req.num_computed_tokens)
                if self.on_load_landed is not None:  # before any forward of it writes its blocks
                    self.on_load_landed(state)
                self.stats.num_remote_tokens += state.num_external_tokens
                state.num_loaded_tokens = min(state.num_external_tokens,
                                              req.num_prompt_tokens - 1 - (state.num_cached_tokens or 0))
                if req.num_computed_tokens >= req.num_tokens:
                    req.num_computed_tokens = req.num_tokens - 1  # recompute the last token for its logits
            req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
            self.waiting.appendleft(state)
    def _apply_connector_output(self, out: ConnectorOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid, cause in out.load_failures.items():  # before the invalid blocks are acted on
            state = self.requests.get(rid)
            if state is not None:
                state.load_failure = FailureCause(cause)
        if out.invalid_block_ids:
            outputs.extend(self._handle_invalid_blocks(set(out.invalid_block_ids)))
        self.connector.update_connector_output(out)
        for rid in out.finished_recving:
            state = self.requests.get(rid)
            if state is None:
                logger.warning("connector reported finished load of unknown request %s", rid)
            elif state in self.remote_waiting:
                self.finished_recving.add(rid)
                state.load_ended_s = time.perf_counter()
            elif state.awaiting_recv:  # aborted during the load: its blocks are safe to free now
                state.awaiting_recv = False
                if not state.awaiting_send:
                    self._release(state)
        for rid in out.finished_sending:
            state = self.held.get(rid)
            if state is None:
                logger.warning("connector reported finished send of unknown request %s", rid)
                continue
            state.awaiting_send = False
            if not state.awaiting_recv:
                self._release(state)
        return outputs

    def _handle_invalid_blocks(self, invalid: set[int]) -> list[RequestOutput]:
        """Requests holding pages that failed verification never use them."""
        outputs: list[RequestOutput] = []
        for state in list(self.remote_waiting) + list(self.running):
            req = state.request
            if not any(b in invalid for ids in self.mgr.get_block_ids(req.request_id) for b in ids):
                continue
            if state in self.remote_waiting:
                state.load_failed = True  # acted on when the load is reported finished
                continue
            # A running request (synchronous load) holding bad pages.
            if self.config.kv_load_failure_policy == "fail":
                self._finish(state, RequestStatus.FINISHED_ERROR)
                error, cause = _load_error(state)
                outputs.append(RequestOutput(req.request_id, [], True, FinishReason.ERROR, error=error,
                                             error_cause=cause))
            else:
                self.running.remove(state)
                self.mgr.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                state.skip_connector_load = True
                state.restart_compute()
                self.waiting.appendleft(state)
                self.stats.num_load_failures_recomputed += 1
        return outputs

def _load_error(state: RequestState) -> tuple[str, FailureCause | None]:
    """The error text and cause of a request ended by a failed KV load."""
    cause = state.load_failure
    return ("KV load failed" if cause is None else f"KV load failed: {cause.value}"), cause

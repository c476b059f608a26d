"""Continuous-batching scheduler on a KVCacheManager.

Each `schedule()` first gives running requests their next tokens (decode
tokens or the next prefill chunk; allocated in one `allocate_slots_in_order`
call while they fit), preempting by recompute from the back of the running
list when an allocation fails; then, if nothing was preempted,
admits waiting requests in arrival order (prefix hit via
`get_computed_blocks`, then the connector's external tokens) until the token
budget, the burst split (`admission.py`), the running-request limit or the KV
cache stops it.
`update_from_output` applies the step: advances computed tokens, appends
sampled tokens, finishes requests and frees (or, for the connector, keeps)
their blocks. `fail_chunks` ends the requests of a step's failed chunks, and
every request sharing the blocks they were writing (the one failure rule).

The scheduler always holds a connector's scheduler half (the engine gives it
`connectors.noop`'s where it has no connector) and calls it at fixed points:
a request's acceptance, admission (external tokens, then after allocation),
once per step (`build_connector_meta`, `update_connector_output`), a streamed
prefill's progress, and a request's end.

Invariants:
- a request is in exactly one of `running`, `waiting`, `remote_waiting`, or is
  finished; finished requests still holding blocks for the connector sit in
  `held` until the connector releases them;
- blocks of an async load are allocated with `delay_cache_blocks` and enter the
  prefix cache only after the connector reports the load finished and
  verified; a failed load never counts as computed;
- the engine calls everything here from one thread.
"""
from __future__ import annotations

import collections
import logging
import time

from kvcache import KVCacheManager, RequestStatus

from connectors.base import ConnectorOutput, KVConnectorScheduler
from connectors.metrics import FailureCause
from connectors.params import TransferParams
from pd.engine.config import EngineConfig
from pd.engine.outputs import FinishReason, RequestOutput
from pd.engine.sched.admission import admission_tokens
from pd.engine.sched.request_state import RequestState
from pd.engine.sched.connector_outcomes import ConnectorOutcomes
from pd.engine.sched.output import RunnerRequests, ScheduledChunk, SchedulerOutput, StreamStep
from pd.engine.sched.stats import SchedulerStats

logger = logging.getLogger(__name__)

SHARED_BLOCKS_ERROR = "engine step failed for a request whose KV blocks this one shares"
FINISH_STATUS = {FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
                 FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
                 FinishReason.ABORT: RequestStatus.FINISHED_ABORTED, FinishReason.ERROR: RequestStatus.FINISHED_ERROR}


class Scheduler(ConnectorOutcomes):
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler, eos_token_id: int | None = None):
        self.config = config
        self.mgr = kv_cache_manager
        self.connector = connector
        self.eos_token_id = eos_token_id
        self.max_model_len = config.resolved_max_model_len
        self.block_size = config.block_size
        self.requests: dict[str, RequestState] = {}
        self.running: list[RequestState] = []
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.remote_waiting: list[RequestState] = []  # WAITING_FOR_REMOTE_KVS, arrival order
        self.held: dict[str, RequestState] = {}  # finished, blocks kept for the connector
        self.finished_recving: set[str] = set()
        self.stats = SchedulerStats()
        self._error_outputs: list[RequestOutput] = []
        self._stream_chunks: dict[str, int] = {}  # streamed prefills (connector's KV streaming): largest chunk
        self._runner_requests = RunnerRequests()

    # ------------------------------------------------------------------ requests
    def add_request(self, state: RequestState) -> None:
        rid = state.request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        # Prompt length and KV capacity were checked at the engine's edge (Engine.check_fits).
        assert state.request.num_tokens < self.max_model_len, (rid, state.request.num_tokens, self.max_model_len)
        params = state.params
        stop = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop.add(self.eos_token_id)
        state.stop_token_ids = frozenset(stop)
        state.max_num_tokens = min(state.request.num_prompt_tokens + params.max_tokens, self.max_model_len)
        self.requests[rid] = state
        self.waiting.append(state)
        # e.g. lease heartbeats start now, not when the request reaches the head (the no-op connector
        # warns here about kv_transfer_params nothing can act on)
        self.connector.on_new_request(state.request)
        cap = self.connector.prefill_stream_chunk(state.request)
        if cap is not None:
            self._stream_chunks[rid] = cap

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request wherever it is; None if it is unknown or already finished."""
        state = self.requests.get(request_id)
        if state is None or state.request.is_finished():
            return None
        req = state.request
        # An async load may still be writing into the blocks: keep them until the connector says done.
        state.awaiting_recv = (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                               and request_id not in self.finished_recving)
        self._finish(state, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(request_id, [], True, FinishReason.ABORT)

    def _fail_request(self, request_id: str, error: str, written_block_ids: set[int]) -> None:
        """Finish a request whose step failed, with `error`. The blocks that step was writing
        (`written_block_ids`) leave the prefix cache first: their pages hold no valid KV."""
        state = self.requests.get(request_id)
        if state is None or state.request.is_finished():
            return
        if written_block_ids:
            self.mgr.evict_blocks(sorted(written_block_ids))
        self._finish(state, RequestStatus.FINISHED_ERROR, error)

    def fail_chunks(self, chunks: list[ScheduledChunk], errors: dict[str, str]) -> set[str]:
        """The one failure rule of a step. Each chunk in `errors` (request id -> error) ends its request
        with that error, and the blocks it was writing leave the prefix cache: they hold no valid KV.
        Every other request holding one of those blocks fails too: a prefix hit taken on them in the same
        pass read garbage (so does an async load admitted on them), and the blocks such a request wrote in
        this step leave the prefix cache as well. Returns the ids of every request this failed."""
        written = {c.request_id: c.written_block_ids(self.block_size) for c in chunks}
        bad = set().union(*(written.get(rid, set()) for rid in errors))
        sharers = [rid for rid, state in self.requests.items() if rid not in errors
                   and not state.request.is_finished()
                   and any(bad.intersection(ids) for ids in self.mgr.get_block_ids(rid))] if bad else []
        for rid, error in errors.items():
            self._fail_request(rid, error, written.get(rid, set()))
        for rid in sharers:
            self._fail_request(rid, SHARED_BLOCKS_ERROR, written.get(rid, set()))
        return set(errors).union(sharers)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.remote_waiting or self.held)

    def has_runnable_work(self) -> bool:
        """Work a forward pass can make progress on now (not only waiting on the network)."""
        return bool(self.running or self.waiting or self.finished_recving)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        budget, preempted = self._schedule_running(chunks)
        num_running_chunks = len(chunks)
        self._promote_finished_loads()
        if not preempted:
            self._admit_waiting(chunks, budget)
        meta = self.connector.build_connector_meta()
        self.stats.num_steps += 1
        finished = self._runner_requests.take_finished()
        # (a running request's chunk is never its first: the runner met it when it was admitted)
        new = self._runner_requests.new(chunks[num_running_chunks:], self.requests)
        return SchedulerOutput(chunks=chunks, connector_metadata=meta, stream_steps=self._stream_steps(chunks),
                               num_preempted=len(preempted), new_requests=new, finished_request_ids=finished)

    def _schedule_running(self, chunks: list[ScheduledChunk]) -> tuple[int, list[RequestState]]:
        """Gives running requests their next tokens in order, preempting from the back of `running` when the
        KV cache is full; returns the token budget left and the requests preempted. Written for the steady
        decode step: the requests that fit the budget are planned, then allocated in one call
        (`allocate_slots_in_order`); only where the cache runs out does a request go one at a time."""
        budget = self.config.max_num_batched_tokens
        preempted: list[RequestState] = []
        running, mgr = self.running, self.mgr
        streamed, max_len = self._stream_chunks, self.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            planned: list[RequestState] = []
            nums: list[int] = []
            places: list[int] = []
            left = budget
            for j in range(i, len(running)):
                if left <= 0:
                    break
                req = running[j].request
                start = req.num_computed_tokens
                num_new = req.num_tokens - start
                if num_new != 1 or streamed or start >= max_len:  # (else one decode token: every cap allows it)
                    num_new = self._num_new_tokens(req, start, left)
                    if num_new <= 0:
                        continue
                planned.append(running[j])
                nums.append(num_new)
                places.append(j)
                left -= num_new
            served = mgr.allocate_slots_in_order([state.request for state in planned], nums)
            budget -= self._append_chunks(chunks, planned, nums, served)
            if len(served) == len(planned):
                break  # (the plan went to the end of `running` or of the budget)
            # the KV cache is full: preempt from the back until this request fits or is itself preempted
            state, num_new = planned[len(served)], nums[len(served)]
            new_blocks = None
            while new_blocks is None:
                victim = running.pop()
                if victim.request.request_id in streamed:  # its published blocks are leased
                    self._finish(victim, RequestStatus.FINISHED_ERROR, "preempted while its KV streamed")
                else:
                    self._preempt(victim)
                preempted.append(victim)
                if victim is state:
                    return budget, preempted
                new_blocks = mgr.allocate_slots(state.request, num_new)
            budget -= self._append_chunks(chunks, [state], [num_new], [new_blocks])
            i = places[len(served)] + 1  # (victims leave from the back: its place is unchanged)
        return budget, preempted

    def _append_chunks(self, chunks: list[ScheduledChunk], states: list[RequestState], nums: list[int],
                       served: list) -> int:
        """The chunks of running requests `states[:len(served)]` (`served`: their allocations), each with the
        block ids of its previous chunk while it gained no block; returns their tokens."""
        mgr = self.mgr
        no_new_blocks, ids_only_grow, get_block_ids = mgr.empty_kv_cache_blocks, mgr.block_ids_only_grow, \
            mgr.get_block_ids
        make_chunk, append = ScheduledChunk.of, chunks.append
        num_tokens = 0
        for state, num_new, new_blocks in zip(states, nums, served, strict=False):  # (served: a prefix)
            req = state.request
            block_ids = state.block_ids
            if block_ids is None or new_blocks is not no_new_blocks or not ids_only_grow:
                block_ids = state.block_ids = get_block_ids(req.request_id)
            start = req.num_computed_tokens
            end = start + num_new
            append(make_chunk(req.request_id, req.all_token_ids[start:end], start, block_ids, end == req.num_tokens))
            num_tokens += num_new
        return num_tokens

    def _stream_steps(self, chunks: list[ScheduledChunk]) -> list[StreamStep]:
        """The chunks of streamed prefills, as the connector's `layer_hook` takes them."""
        if not self._stream_chunks:
            return []
        steps = []
        for c in chunks:
            if c.request_id in self._stream_chunks:
                request = self.requests[c.request_id].request
                end = c.start + len(c.token_ids)
                steps.append((request, c.block_ids, end, end >= request.num_prompt_tokens))
        return steps

    def _num_new_tokens(self, req, num_computed: int, budget: int) -> int:
        num_new = req.num_tokens - num_computed
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if self._stream_chunks and req.request_id in self._stream_chunks:
            num_new = min(num_new, self._stream_chunks[req.request_id])
        return min(num_new, budget, self.max_model_len - num_computed)

    def _chunk(self, state: RequestState, num_new: int) -> ScheduledChunk:
        req = state.request
        start = req.num_computed_tokens
        state.block_ids = self.mgr.get_block_ids(req.request_id)
        return ScheduledChunk.of(req.request_id, req.all_token_ids[start:start + num_new], start, state.block_ids,
                                 start + num_new == req.num_tokens)

    def _preempt(self, state: RequestState) -> None:
        req = state.request
        self.mgr.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        state.restart_compute()
        self.waiting.appendleft(state)
        self.stats.num_preemptions += 1
        logger.debug("preempted %s (preemption #%d)", req.request_id, req.num_preemptions)

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        skipped: list[RequestState] = []
        # a burst of prompts is admitted over a few steps, whole prompts each (sched/admission.py)
        left = admission_tokens(budget, self.config.step_overhead_tokens,
                                (s.request.num_tokens - s.request.num_computed_tokens for s in self.waiting))
        while self.waiting and budget > 0 and left > 0 and len(self.running) < self.config.max_num_seqs:
            state = self.waiting[0]
            req = state.request
            hit_blocks, num_local, num_external, load_async = None, 0, 0, False
            looked_up = req.num_computed_tokens == 0  # else: an async load landed, or a chunked prefill goes on
            if looked_up:
                hit_blocks, num_local = self.mgr.get_computed_blocks(req)
                self.stats.record_prefix_lookup(req.num_tokens, num_local)
                if state.num_cached_tokens is None:
                    state.num_cached_tokens = num_local
                    state.admitted_s = time.perf_counter()
                if not state.skip_connector_load:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                    if num_external is None:  # the connector cannot tell yet: retry next step
                        skipped.append(self.waiting.popleft())
                        continue
                    if not load_async and num_local + num_external >= req.num_tokens:
                        num_external = req.num_tokens - num_local - 1  # leave one token for logits
            num_computed = req.num_computed_tokens + num_local + num_external
            num_new = 0 if load_async else self._num_new_tokens(req, num_computed, budget)
            new_blocks = self.mgr.allocate_slots(
                req, num_new,
                num_new_computed_tokens=num_local,
                new_computed_blocks=hit_blocks,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_async,
                full_sequence_must_fit=self.config.full_sequence_must_fit,
                reserved_blocks=self._inflight_reserved_blocks() if load_async else 0,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.connector.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), num_external)
            req.num_computed_tokens = num_computed
            if load_async:
                state.num_external_tokens = num_external
                state.load_started_s, state.load_ended_s = time.perf_counter(), None
                num_end_blocks = -(-(num_local + num_external) // self.block_size)
                state.num_loaded_blocks = num_end_blocks - num_local // self.block_size
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.remote_waiting.append(state)
                continue
            req.status = RequestStatus.RUNNING
            state.mark_admitted()
            self.running.append(state)
            chunks.append(self._chunk(state, num_new))
            budget -= num_new
            left -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _inflight_reserved_blocks(self) -> int:
        """Blocks that in-flight prefills (chunked or async load) still need for their full sequence."""
        inflight = [s for s in self.running if s.request.num_computed_tokens < s.request.num_prompt_tokens]
        inflight += self.remote_waiting
        return sum(self.mgr.num_blocks_needed_for_full_sequence(s.request) for s in inflight)


    # ------------------------------------------------------------------ update
    def update_from_output(self, sched: SchedulerOutput, sampled: dict[str, int],
                           connector_output: ConnectorOutput) -> list[RequestOutput]:
        """Applies the step: first what the connector reported, then each chunk's progress and token."""
        outputs = self._apply_connector_output(connector_output)
        requests, running_status = self.requests, RequestStatus.RUNNING
        num_step_tokens = -1  # (counted when a prompt's first token needs it)
        step_output = RequestOutput.step_tokens
        for chunk in sched.chunks:
            rid = chunk.request_id
            state = requests.get(rid)
            if state is None:
                continue
            req = state.request
            if req.status != running_status:
                continue  # finished (every finished status differs) or reset while the step ran
            num_new = len(chunk.token_ids)
            req.num_computed_tokens += num_new
            if not state.timed:  # the batch its prompt shared: what its compute time also paid for
                if num_step_tokens < 0:
                    num_step_tokens = sum(len(c.token_ids) for c in sched.chunks)
                state.num_batched_tokens += num_step_tokens - num_new
            if not chunk.needs_logits:
                if rid in self._stream_chunks:
                    self.connector.on_prefill_progress(req, self.mgr.get_block_ids(rid))
                continue
            token = sampled[rid]
            req.append_output_token_ids(token)
            if token in state.stop_token_ids:
                reason: FinishReason | None = FinishReason.STOP
            else:
                reason = FinishReason.LENGTH if req.num_tokens >= state.max_num_tokens else None
            timing = None if state.timed else state.take_timing(req.num_prompt_tokens)
            if reason is None:
                outputs.append(step_output(rid, [token], state.num_cached_tokens or 0, timing))
                continue
            params = self._finish(state, FINISH_STATUS[reason])
            outputs.append(RequestOutput(rid, [token], True, reason, kv_transfer_params=params,
                                         num_cached_tokens=state.num_cached_tokens or 0, timing=timing))
        return outputs

    def _finish(self, state: RequestState, status: RequestStatus, error: str | None = None,
                error_cause: FailureCause | None = None) -> TransferParams | None:
        """Mark finished, leave every queue, and free or hand the blocks to the connector."""
        req = state.request
        rid = req.request_id
        req.status = status
        if state in self.running:
            self.running.remove(state)
        elif state in self.remote_waiting:
            self.remote_waiting.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self.finished_recving.discard(rid)
        self._stream_chunks.pop(rid, None)
        self._runner_requests.finished(rid)
        num_blocks = -(-req.num_computed_tokens // self.block_size)
        block_ids = tuple(ids[:num_blocks] for ids in self.mgr.get_block_ids(rid))
        delay_free, params = self.connector.request_finished(req, block_ids)
        state.awaiting_send = bool(delay_free)
        if status == RequestStatus.FINISHED_ERROR:
            self.stats.num_errors += 1
        if state.awaiting_send or state.awaiting_recv:
            self.held[rid] = state
        else:
            self._release(state)
        if error is not None:
            self._error_outputs.append(RequestOutput(rid, [], True, FinishReason.ERROR, error=error,
                                                     error_cause=error_cause))
        return None if status == RequestStatus.FINISHED_ABORTED else params

    def _release(self, state: RequestState) -> None:
        rid = state.request.request_id
        self.mgr.free(state.request)
        self.held.pop(rid, None)
        self.requests.pop(rid, None)

    def take_error_outputs(self) -> list[RequestOutput]:
        """Outputs of requests finished with an error outside `update_from_output`."""
        out, self._error_outputs = self._error_outputs, []
        return out

"""The engine: model + page pool + KVCacheManager + scheduler + KV connector.

Use it synchronously (`add_request` then `step()` until done) or start the
background step loop (`start()`) and consume `generate()` from asyncio: the
loop runs the model on its own thread, so the caller's event loop stays free.

Guarantees:
- `add_request` / `abort_request` are safe from any thread; they take effect
  at the start of the next step (an abort is reported in that step's outputs);
- only the step (one thread at a time) touches the scheduler, the KV cache
  manager, the page pool and the connector;
- there is always a connector: an engine built without one holds the no-op
  connector (`connectors.noop`). A step talks to it through the scheduler
  (which plans what moves) and the runner's connector seam
  (`pd.engine.runner.kv_connector`: once before the forward, once after, one
  `ConnectorOutput` per step);
- every request ends with exactly one output with `finished=True`;
- an exception while computing a step fails only the requests that caused it
  (`pd.engine.step_isolation` finds them): each gets an error output, its blocks
  are freed and the others go on in the same step, except those sharing the
  blocks a failed chunk was writing (`Scheduler.fail_chunks`, the one rule).
  Should the loop thread still die, every waiting caller gets the error, `dead`
  says why, new requests are refused and `on_death` is called once.
- with `tp` (rank 0 of a TP gang: runner/compute.py, runner/tp_runner.py), each forward's plan goes to the
  other ranks first; a failure after that ends the loop (never retried), and `shutdown` stops them;
- with `kv_audit_rate` > 0, a sampled request's landed KV is checked after the step's outputs went out
  (`pd.engine.runner.kv_audit`): no request waits for the result, and no block stays taken past the step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

import torch

from kvcache import BlockHasher, KVCacheConfig, KVCacheManager, Request
from kvcache.audit import assert_all_free, check_invariants

from connectors.base import KVConnector
from connectors.noop import or_noop
from connectors.params import TransferParams
from pd.engine.kv.capacity import check_fits
from pd.engine.runner.kv_audit import KVAuditor
from pd.engine.config import EngineConfig
from pd.engine.parallel.group import TPGroup
from pd.engine.inputs import CheckedRequest
from pd.engine.outputs import FinishReason, PoolAudit, RequestOutput
from pd.engine.sched.request_state import RequestState
from pd.engine.sched.output import SchedulerOutput
from pd.engine.runner.kv_connector import ConnectorSeam
from pd.engine.runner.compute import build_compute
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.scheduler import Scheduler
from pd.engine.step_isolation import LOOP, PERTURB_KV, STEP, FaultMarks, execute_isolated
from pd.engine.text.tokenizer import ByteTokenizer, Tokenizer, text_tokenizer, valid_token_ids

logger = logging.getLogger(__name__)

__all__ = ["CheckedRequest", "Engine", "PoolAudit", "RequestOutput"]

IDLE_WAIT_S = 0.05  # loop thread sleep when there is nothing at all to do (woken early by new work)
NETWORK_POLL_S = 0.001  # pause between steps when only remote transfers are pending
MAX_FAILED_STEPS = 3  # steps in a row whose every chunk failed: the engine is broken, not a request


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class Engine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None,
                 tokenizer: Tokenizer | None = None, tp: TPGroup | None = None):
        """`tp`: this process's group as rank 0 of a TP gang (pd/engine/parallel/follower.py runs the other
        ranks); None or a group of one: one process, today's path."""
        self.config = config
        connector = or_noop(connector)  # (a connector object always: the no-op where none is given)
        compute = build_compute(config, connector.shares_page_pool, tp)
        self.model_config, self.tp_shape = compute.model_config, compute.tp_shape
        # `layout`: this process's pages (a TP rank's heads only); `canonical_layout`: a TP 1 worker's, what the
        # block manager, the wire and the compat hash describe (the same object without TP)
        self.layout, self.canonical_layout = compute.layout, compute.canonical_layout
        self.page_pool, self.runner, self._gang = compute.page_pool, compute.runner, compute.gang
        del compute  # (the runner holds the model: see build_compute)
        # text prompts: the tokenizer given, else the checkpoint's own (read when first needed), else bytes
        self._tokenizer: Tokenizer | None = tokenizer if tokenizer is not None or config.model_path else ByteTokenizer()
        self._edge = object()  # marks the requests this engine checked (CheckedRequest.checked_by)
        kv_config = KVCacheConfig(num_blocks=self.page_pool.num_blocks, groups=self.canonical_layout.kv_cache_groups())
        self._kv_specs = [group.spec for group in kv_config.groups]  # for check_request's check_fits
        self.kv_cache_manager = KVCacheManager(
            kv_config, config.resolved_max_model_len, enable_caching=config.enable_prefix_caching,
            watermark=config.watermark, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_kv_cache_events=config.enable_kv_events)
        self.block_hasher = BlockHasher(block_size=config.block_size, algorithm=config.hash_algorithm,
                                        seed=config.hash_seed)
        # called on the step thread with each step's prefix-cache events, under the step lock
        self.kv_event_sink: Callable[[list], None] | None = None
        self.connector: KVConnector = connector
        self.scheduler = Scheduler(config, self.kv_cache_manager, connector,
                                   eos_token_id=self.model_config.eos_token_id)
        self.kv_connector = ConnectorSeam(connector, self.page_pool,  # (registers the page pool)
                                          None if self._gang is None else self._gang.zero_blocks)
        self.kv_audit = KVAuditor(config.kv_audit_rate, config.kv_audit_tolerance, config.engine_id, self.layout,
                                  self.page_pool, self.kv_cache_manager, self.runner.final_hidden)
        if self.kv_audit.enabled:
            self.scheduler.on_load_landed = self.kv_audit.on_load_landed
        self._lock = threading.Lock()  # guards _pending, _active_ids, _listeners
        self._step_lock = threading.Lock()  # one step at a time
        self._pending: list[tuple[str, Any]] = []
        self._active_ids: set[str] = set()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None  # called on the loop thread as it dies
        self.fault_marks = FaultMarks()  # request ids that fault plans make fail (none by default)
        self._num_failed_steps = 0
        # torch intra-op threads the steps compute with (the fused kernels split over them too); the
        # loop thread reads it again as it starts, since torch keeps the count per thread
        self.num_threads = torch.get_num_threads()
        # totals since start; inputs_s: the step's input build, apart from model_s (the rest of the forward)
        self.timing = {"schedule_s": 0.0, "inputs_s": 0.0, "model_s": 0.0, "update_s": 0.0}
        self.last_timing = dict(self.timing)  # of the latest step
        logger.info("engine %s: %d KV blocks of %d bytes, groups=%s", config.engine_id, self.page_pool.num_blocks,
                    self.layout.page_size_bytes, [g.layer_indices for g in self.layout.groups])

    # ------------------------------------------------------------------ requests
    @property
    def tokenizer(self) -> Tokenizer:
        """What text prompts are encoded with: the tokenizer given, else the checkpoint's own (read at the
        first text prompt; ValueError when it has none), else for random weights the byte tokenizer."""
        if self._tokenizer is None:
            self._tokenizer = text_tokenizer(self.config.model_path)
        return self._tokenizer

    def check_request(self, request_id: str, prompt_token_ids: Sequence[int] | str,
                      sampling_params: SamplingParams | None = None,
                      kv_transfer_params: TransferParams | Mapping[str, Any] | None = None,
                      cache_salt: str | None = None) -> CheckedRequest:
        """The engine's edge, checked once: text is encoded with `tokenizer`, ids must lie in the model's
        vocabulary, the request must be able to run here (`pd.engine.kv.capacity.check_fits`), a dict of
        kv_transfer_params is parsed (`TransferParams.from_dict`). ValueError naming what is wrong."""
        params = sampling_params or SamplingParams()
        prompt = self.tokenizer.encode(prompt_token_ids) if isinstance(prompt_token_ids, str) else prompt_token_ids
        ids = valid_token_ids(prompt, self.model_config.vocab_size)
        # block 0 is the null block: the pool holds one block fewer
        check_fits(self._kv_specs, self.page_pool.num_blocks - 1, self.config.resolved_max_model_len, len(ids),
                   params.max_tokens, request_id)
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, TransferParams):
            kv_transfer_params = TransferParams.from_dict(kv_transfer_params)
        return CheckedRequest(request_id, ids, params, kv_transfer_params, cache_salt, checked_by=self._edge)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | str,
                    sampling_params: SamplingParams | None = None,
                    kv_transfer_params: TransferParams | Mapping[str, Any] | None = None,
                    cache_salt: str | None = None) -> None:
        """Checks the request (`check_request`) and queues it for the next step."""
        self.submit(self.check_request(request_id, prompt_token_ids, sampling_params, kv_transfer_params,
                                       cache_salt))

    def submit(self, request: CheckedRequest) -> None:
        """Queues a request this engine checked (`check_request`), without checking it again."""
        if request.checked_by is not self._edge:
            raise ValueError(f"request {request.request_id!r} was not checked by this engine (check_request)")
        req = Request(request.request_id, request.prompt_token_ids, block_hasher=self.block_hasher,
                      max_tokens=request.sampling.max_tokens, kv_transfer_params=request.kv_transfer_params,
                      cache_salt=request.cache_salt)
        state = RequestState(req, request.sampling)
        with self._lock:
            if self._dead is not None:
                raise RuntimeError("engine step loop died") from self._dead
            if request.request_id in self._active_ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._active_ids.add(request.request_id)
            self._pending.append(("add", state))
        self._wake.set()

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(("abort", request_id))
        self._wake.set()

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._pending) or self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + update cycle; returns this step's outputs."""
        with self._step_lock:
            outputs = self._apply_pending()
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            outputs.extend(self.scheduler.take_error_outputs())
            t1 = time.perf_counter()
            self.kv_connector.before_forward(sched)
            self.fault_marks.check(sched.chunks, LOOP)  # a fault plan's stand-in for a bug in the loop
            self.runner.update_requests(sched)
            self.runner.last_inputs_s = 0.0
            sampled, failed = execute_isolated(self._run_chunks, sched.chunks) if sched.chunks else ({}, {})
            if self._gang is not None:  # a failure after the plan went out: the gang (this loop) ends
                self._gang.raise_if_broken()
            if self.fault_marks.has_marks:  # a fault plan's wrong KV, before the connector seals it
                self._perturb_marked(sched)
            connector_output = self.kv_connector.after_forward()
            t2 = time.perf_counter()
            self._fail(sched, failed)
            outputs.extend(self.scheduler.update_from_output(sched, sampled, connector_output))
            outputs.extend(self.scheduler.take_error_outputs())
            t3 = time.perf_counter()
            inputs_s = self.runner.last_inputs_s
            self.last_timing = {"schedule_s": t1 - t0, "inputs_s": inputs_s, "model_s": t2 - t1 - inputs_s,
                                "update_s": t3 - t2}
            for key, value in self.last_timing.items():
                self.timing[key] += value
            self._publish_kv_events()  # before the outputs: a router sees the blocks before the answer
            self._dispatch(outputs)
            self.kv_audit.run_pending(self.scheduler.requests)  # after the outputs went out: nobody waits on it
            return outputs

    def _perturb_marked(self, sched: SchedulerOutput) -> None:
        requests = self.scheduler.requests
        lengths = {c.request_id: requests[c.request_id].request.num_prompt_tokens
                   for c in sched.chunks if c.request_id in requests}
        self.kv_audit.perturb_prompt_chunks(sched.chunks, lengths,
                                            lambda rid: self.fault_marks.is_marked(rid, PERTURB_KV))

    def _publish_kv_events(self) -> None:
        events = self.kv_cache_manager.take_events()
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def kv_snapshot(self, snapshot_fn: Callable[[dict[int, list[bytes]]], Any]) -> Any:
        """Calls `snapshot_fn({group: [cached hashes]})` between steps (under the step lock), so
        the snapshot and the events published so far describe the same cache."""
        with self._step_lock:
            self._publish_kv_events()
            pool = self.kv_cache_manager.block_pool
            groups = range(len(self._kv_specs))
            return snapshot_fn({g: list(pool.cached_map(g)) for g in groups})

    def _apply_pending(self) -> list[RequestOutput]:
        with self._lock:
            pending, self._pending = self._pending, []
        outputs = []
        for op, arg in pending:
            if op == "add":
                try:
                    self.scheduler.add_request(arg)
                except ValueError as exc:
                    outputs.append(RequestOutput(arg.request.request_id, [], True, FinishReason.ERROR,
                                                 error=str(exc)))
            else:
                out = self.scheduler.abort_request(arg)
                if out is not None:
                    outputs.append(out)
                else:
                    # Finished already, maybe during the step that ran while this abort waited: a lease
                    # kept for it exists only now, so ending it here closes that race.
                    self.connector.abort_lease(arg)
        return outputs

    def _run_chunks(self, chunks: list) -> dict[str, int]:
        """The tokens of a forward of these chunks (the step's, or one retried alone: `execute_isolated`)."""
        self.fault_marks.check(chunks, STEP)
        ids = [c.request_id for c in chunks if c.needs_logits]
        tokens = self.runner.next_tokens(chunks, on_layer=self.kv_connector.layer_hook(chunks))
        return dict(zip(ids, tokens, strict=True))

    def _fail(self, sched: SchedulerOutput, failed: dict[str, str]) -> None:
        """Fails the failed chunks' requests and those sharing their blocks (the scheduler's rule). Every
        chunk failing, step after step (a device error, memory exhausted), is the engine's fault: the loop
        dies, so the worker reports it and restarts instead of failing every request sent to it."""
        if not sched.chunks:
            return
        ended = self.scheduler.fail_chunks(sched.chunks, failed) if failed else set()
        num_failed = sum(c.request_id in ended for c in sched.chunks)
        self._num_failed_steps = self._num_failed_steps + 1 if num_failed == len(sched.chunks) else 0
        if self._num_failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{self._num_failed_steps} engine steps in a row failed for every request in them")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One hand-off per event loop per step, not one per request: each call_soon_threadsafe
        # wakes the loop through its self-pipe, and a step of 32 decodes made 32 of them.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._active_ids.discard(out.request_id)
                    self.fault_marks.forget(out.request_id)
                target = self._listeners.get(out.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], out))
        for loop, items in batches.items():  # (outside the lock: only this thread dispatches, in step order)
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                logger.debug("dropped %d outputs for a closed event loop", len(items))

    @staticmethod
    def _notify(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            logger.debug("dropped an output for a closed event loop")

    # ------------------------------------------------------------------ loop thread
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_loop, name=f"pd-engine-{self.config.engine_id}", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        self.num_threads = torch.get_num_threads()
        try:
            while not self._stop.is_set():
                if self._gang is not None:  # (under the step lock: one sender on the gang's channel at a time)
                    with self._step_lock:
                        self._gang.keepalive()
                with self._lock:
                    has_pending = bool(self._pending)
                if has_pending or self.scheduler.has_runnable_work():
                    self.step()
                elif self.scheduler.has_work():
                    self.step()  # only remote transfers pending: poll the connector
                    self._stop.wait(NETWORK_POLL_S)
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting caller
            logger.exception("engine step loop died")
            if self._gang is not None:
                self._gang.abandon()  # the followers' pending collective fails now, not at its timeout
            with self._lock:
                self._dead = exc
                for target in self._listeners.values():
                    self._notify(target, exc)
            if self.on_death is not None:
                try:
                    self.on_death(exc)
                except Exception:  # noqa: BLE001 - the loop is gone either way
                    logger.exception("engine on_death callback failed")

    @property
    def dead(self) -> BaseException | None:
        """Why the step loop died (None while it runs, or before it starts)."""
        return self._dead

    def shutdown(self) -> None:
        """Stop the loop thread and the connector; idempotent."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)
        if self._gang is not None and (thread is None or not thread.is_alive()):
            with self._step_lock:  # the followers' loops end (not while a step may still be in a collective)
                self._gang.stop()
        with self._lock:  # callers still awaiting generate() must not hang
            for target in self._listeners.values():
                self._notify(target, RuntimeError("engine shut down"))
        self.connector.shutdown()

    def generate(self, request_id: str, prompt_token_ids: Sequence[int] | str,
                 sampling_params: SamplingParams | None = None,
                 kv_transfer_params: TransferParams | Mapping[str, Any] | None = None,
                 cache_salt: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Checks the request now (`check_request`, ValueError) and returns its outputs' stream (`stream`)."""
        return self.stream(self.check_request(request_id, prompt_token_ids, sampling_params, kv_transfer_params,
                                              cache_salt))

    async def stream(self, request: CheckedRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yields the outputs of a request this engine checked as steps produce them (it is not checked
        again); aborts it if the consumer stops early."""
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request.request_id
        with self._lock:
            self._listeners[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self.submit(request)
            self.start()
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"engine stopped: {out}") from out
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._listeners.pop(request_id, None)
            if not finished:
                self.abort_request(request_id)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_waiting_for_remote_kvs": len(s.remote_waiting),
            "num_held_for_transfer": len(s.held),
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
            "num_blocks": self.page_pool.num_blocks,
            "prefix_cache_hit_rate": s.stats.prefix_hit_rate,
            "prefix_cache_queries": s.stats.prefix_queries,
            "prefix_cache_hits": s.stats.prefix_hits,
            "num_preemptions": s.stats.num_preemptions,
            "num_steps": s.stats.num_steps,
            "num_errors": s.stats.num_errors,
            **{k: round(v, 6) for k, v in self.timing.items()},
            **self.kv_audit.stats(),
        }

    def audit(self) -> PoolAudit:
        """Pool audit between steps (`kvcache.audit`), taken under the step lock so the loop
        thread cannot change the pool mid-audit; never raises on a failed check."""
        passed: dict[str, bool] = {}
        detail = ""
        with self._step_lock:
            for name, check in (("consistent", check_invariants), ("all_free", assert_all_free)):
                try:
                    check(self.kv_cache_manager)
                    passed[name] = True
                except AssertionError as exc:
                    passed[name] = False
                    detail += str(exc)[:2000] + " "
        return PoolAudit(detail=detail, **passed)

    def generate_sync(self, prompts: dict[str, Sequence[int]], params: SamplingParams) -> dict[str, list[int]]:
        """Run `prompts` to completion on the calling thread (tests, benchmarks)."""
        for rid, ids in prompts.items():
            self.add_request(rid, ids, params)
        result: dict[str, list[int]] = {rid: [] for rid in prompts}
        while self.has_unfinished_requests():
            for out in self.step():
                result.setdefault(out.request_id, []).extend(out.new_token_ids)
        return result

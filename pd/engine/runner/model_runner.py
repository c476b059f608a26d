"""The model runner: one forward pass per engine step over the page pool, and the step's tokens.

Per step it writes the scheduler's chunks into the step metadata (attention/metadata.py, persistent
buffers on the engine's device) and runs it: through the step executor where one applies (the CPU's,
cpu/step_executor.py: the whole layer stack in one kernel call), else through the model's per-layer
path, each layer's attention by the attention backend (attention/backend.py: K/V write plus attention,
planned once a step by `prepare`). The rows that end a sequence then get their tokens: greedy rows from
the step executor where it can pick them without the full logits, every other row from the logits and
the sampler, under the request's `SamplingParams`.

The page pool's per-layer K/V views are bound once, here, when the runner meets the pool the engine
allocated (`KVLayout.bind`); the backend and the executor read those.

The runner keeps each request's sampling params and random generator from the step that first
schedules it (`SchedulerOutput.new_requests`) until the step after it finishes
(`SchedulerOutput.finished_request_ids`): nothing flows back from the engine or the scheduler.

On a GPU (`RunnerOptions`): a decode step whose batch fits a bucket replays a CUDA graph captured at
start over the step metadata's buffers (runner/cuda_graphs.py; only for a backend that plans nothing on
the host, `capabilities.graph_safe`: the Triton backend), every other step runs eagerly; and the tokens
are sampled on the device (sample/batched.py) with one device-to-host copy a step. On the CPU the step
runs eagerly and the tokens come from sample/sampler.py.

The runner holds one model (`self.model`): the model as given, or the step executor's copy of it over
weights re-laid for its kernels (the CPU's packed panels). The executor is then the only holder of those
weights once the engine drops the model it loaded: no second full copy stays alive.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from pd.engine.attention.backend import AttentionBackend
from pd.engine.attention.capabilities import DEFAULT_ATTENTION_BACKEND
from pd.engine.attention.metadata import StepCapacity, StepInputBuilder, StepMetadata
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import CausalLM
from pd.engine.runner import selector
from pd.engine.runner.cuda_graphs import DecodeGraphs
from pd.engine.sample.batched import BatchedSampler, RowRng, make_row_rng
from pd.engine.sample.params import SamplingParams
from pd.engine.sample.sampler import make_generator, sample
from pd.engine.sched.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)
_FORWARD = CausalLM.forward.__wrapped__  # type: ignore[attr-defined]  # (inference_mode's wrapper undone)


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """What the runner holds for one request: how to pick its tokens."""

    params: SamplingParams
    generator: torch.Generator | None  # the CPU sampler's stream
    rng: RowRng | None = None  # the device sampler's stream


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """How the runner runs a step on a GPU (`EngineConfig.cuda_graphs`, `device_sampler`)."""

    cuda_graphs: bool = True  # decode steps through captured graphs, where the device and backend allow
    device_sampler: bool | None = None  # sample/batched.py; None: on every device but the CPU


class ModelRunner:
    """Owns the step metadata builder, the attention backend, the step executor (where one goes with
    the backend) and the requests' sampling state.

    Guarantees: a step writes K/V only into the slots of the chunks' own positions; `next_tokens`
    returns one token per chunk with `needs_logits`, in chunk order, each below `num_ids` (the ids the
    tokenizer can decode); `self.model` is the model as given, never changed, or the step executor's
    copy of it over re-laid weights; a graph replays only a pure decode step.
    """

    def __init__(self, model: CausalLM, layout: KVLayout, page_pool: PagePool,
                 attention_backend: str = DEFAULT_ATTENTION_BACKEND,
                 capacity: StepCapacity | None = None, num_ids: int | None = None,
                 options: RunnerOptions | None = None):
        options = options or RunnerOptions()
        self.layout = layout
        self.page_pool = page_pool
        self.device = page_pool.device
        vocab = model.config.vocab_size
        if num_ids is not None and not 0 < num_ids <= vocab:
            raise ValueError(f"the tokenizer's vocabulary ({num_ids} ids) must be positive and at most the model's "
                             f"({vocab})")
        self.num_ids = vocab if num_ids is None else num_ids
        self.kv = layout.bind(page_pool)  # each layer's K/V views: bound once, here
        runners = selector.build(attention_backend, model, self.kv)
        del model  # the runners' model is the one the runner keeps (see the module docstring)
        self.backend: AttentionBackend = runners.backend
        self.executor: selector.StepExecutor | None = runners.executor
        self.model: CausalLM = runners.model
        # (fixed-width tables wherever a graph could replay the step: on the CPU too, so tests see its inputs)
        graphs = options.cuda_graphs and self.backend.capabilities.graph_safe
        self.inputs = StepInputBuilder(layout, self.device, capacity, fixed_table_width=graphs)
        self.graphs = DecodeGraphs(self.inputs, self.forward_hidden, self.inputs.capacity.max_num_seqs, graphs)
        self.graph_report = self.graphs.capture()  # (after the warm-up of each bucket; says why when it does not)
        batched = options.device_sampler if options.device_sampler is not None else self.device.type != "cpu"
        self.batched_sampler = BatchedSampler(self.num_ids) if batched else None
        self.requests: dict[str, RequestSampling] = {}
        self.last_inputs_s = 0.0  # input build time (`StepInputBuilder.build`) since the engine last reset it

    @property
    def description(self) -> str:
        """What runs a step, in words (for logs and benchmark reports)."""
        return self.executor.description if self.executor is not None else self.backend.description

    @property
    def num_held_requests(self) -> int:
        """Requests whose block tables a rank of this runner may still hold: those with a table row here
        (a gang's runner adds those released here whose release has not reached its followers yet)."""
        return self.inputs.rows.num_assigned

    # ------------------------------------------------------------------ requests
    def update_requests(self, sched: SchedulerOutput) -> None:
        """Forgets the requests finished since the previous step, then meets this step's new ones."""
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        self.inputs.release(sched.finished_request_ids)  # (their block-table rows)
        for rid, params in sched.new_requests.items():
            if self.batched_sampler is not None:
                self.requests[rid] = RequestSampling(params, None, make_row_rng(params))
            else:
                self.requests[rid] = RequestSampling(params, make_generator(params))

    # ------------------------------------------------------------------ step
    def next_tokens(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> list[int]:
        """One token per chunk with `needs_logits`, in chunk order, under its request's params (met
        through `update_requests`). `on_layer`: see `final_hidden`."""
        hidden = self.final_hidden(chunks, on_layer)
        rows = [self.requests[c.request_id] for c in chunks if c.needs_logits]
        if self.batched_sampler is not None:  # on the device: one host copy, of the tokens
            logits = self.model.compute_logits(hidden)
            return self.batched_sampler.sample(logits, [r.params for r in rows], [r.rng for r in rows])
        tokens: list[int | None] = [None] * hidden.shape[0]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy and self.executor is not None:
            picked = hidden if len(greedy) == len(tokens) else hidden[torch.tensor(greedy)]
            for i, token in zip(greedy, self.executor.greedy_tokens(picked, self.num_ids), strict=True):
                tokens[i] = token
        rest = [i for i, t in enumerate(tokens) if t is None]
        if rest:
            picked = hidden if len(rest) == len(tokens) else hidden[torch.tensor(rest)]
            drawn = sample(self.model.compute_logits(picked), [rows[i].params for i in rest],
                           [rows[i].generator for i in rest], self.num_ids)
            for i, token in zip(rest, drawn, strict=True):
                tokens[i] = token
        return [t for t in tokens if t is not None]  # (every row has its token by now)

    def final_hidden(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None = None
                     ) -> torch.Tensor:
        """The final-norm hidden states (R, hidden) of the chunks with `needs_logits`, in chunk order.
        `on_layer(i)`: called once layer i's K/V are in the pages, on the per-layer path (a step executor
        that runs every layer in one call tells its caller when the step is over)."""
        if not chunks:
            return torch.empty((0, self.model.config.hidden_size))
        if self.graphs.graphs_ready:
            plan = self.graphs.plan(len(chunks), sum(len(c.token_ids) for c in chunks), on_layer is not None)
            if plan.bucket is not None:
                metadata = self._build(chunks, plan.bucket)
                return self.graphs.replay(plan.bucket)[metadata.logits_indices]
        metadata = self._build(chunks, None)
        return self._run(metadata, on_layer)

    def _build(self, chunks: Sequence[ScheduledChunk], pad_to: int | None) -> StepMetadata:
        t0 = time.perf_counter()
        metadata = self.inputs.build(chunks, pad_to=pad_to)
        self.last_inputs_s += time.perf_counter() - t0  # (summed: a step retried chunk by chunk builds more than once)
        return metadata

    def forward_hidden(self, metadata: StepMetadata) -> torch.Tensor:
        """The final-norm hidden states of every token of the step (padding rows included), through the
        per-layer path: what a decode graph captures. It reads its inputs only from the metadata's tensors
        (no host sync for a backend with `capabilities.graph_safe`), and runs the model's forward without
        its inference-mode wrapper, which `torch.compile` cannot trace, under no_grad instead."""
        with torch.no_grad():
            return _FORWARD(self.model, metadata.input_ids, metadata.positions, self.backend, metadata)

    def _run(self, metadata: StepMetadata, on_layer: Callable[[int], None] | None) -> torch.Tensor:
        if self.executor is not None and self.executor.applies(metadata):
            return self.executor.run_step(metadata)
        self.backend.prepare(metadata)
        hidden = self.model(metadata.input_ids, metadata.positions, self.backend, metadata, on_layer)
        return hidden[metadata.logits_indices]

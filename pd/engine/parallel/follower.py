"""A rank r > 0 of a TP gang: its model shard, its page pool, and the loop that runs rank 0's steps.

    group = TPGroup(rank, size, address, device, timeout_s=...)
    follower = Follower(config, group)   # the same EngineConfig as rank 0's engine
    follower.run()                       # until rank 0 sends `stop` (returns) or the gang fails (raises)
    follower.close()

Built like rank 0's engine (`setup_rank`, in the same order of collectives): the shard of the same
weights, a local KV layout (this rank's heads), and a pool of the gang's common number of blocks, so a
block id means the same tokens on every rank. There is no scheduler, block manager, sampler or
connector here: rank 0 decides everything and sends each step's plan (`pd.engine.runner.tp_runner`);
this rank frees the block-table rows of finished requests, zeroes the blocks it is told to, and runs
the forward of the plan's chunks over its shard (whose all-reduces meet rank 0's). It computes no
logits and keeps nothing of a request but its block-table row.

`page_pool`, `layout` and `shape` are what a per-rank KV transfer agent needs (this rank's pages and
the heads it holds: `shape.heads_of(group.rank)`).

Guarantees: `run` returns only on `stop`; any failure (a peer gone, a timeout, a plan it cannot run)
raises, and the gang must be torn down (a follower never skips a step); nothing is ever unpickled.
"""
from __future__ import annotations

import logging

from pd.engine.config import EngineConfig
from pd.engine.kv.page_pool import PagePool
from pd.engine.parallel.group import TPGroup
from pd.engine.parallel.sharded_model import setup_rank, tp_backend
from pd.engine.parallel.step_channel import NOOP, STOP, StepChannel
from pd.engine.runner.compute import step_capacity
from pd.engine.runner.model_runner import ModelRunner, RunnerOptions
from pd.engine.runner.tp_runner import decode_chunks

log = logging.getLogger(__name__)


class Follower:
    """Rank `group.rank` (> 0) of a TP gang whose rank 0 runs `Engine(config, ..., tp=group)`."""

    def __init__(self, config: EngineConfig, group: TPGroup, shareable_pool: bool = False):
        if group.rank == 0:
            raise ValueError("rank 0 of a TP gang is the engine (Engine(config, tp=group)), not a Follower")
        self.config, self.group = config, group
        setup = setup_rank(config, group)
        self.shape, self.model_config = setup.shape, setup.model_config
        self.layout, self.canonical_layout = setup.layout, setup.canonical_layout
        self.page_pool = PagePool(setup.num_blocks, self.layout.page_size_bytes, device=config.device,
                                  shareable=shareable_pool)
        self.runner: ModelRunner | None = ModelRunner(
            setup.model, self.layout, self.page_pool, tp_backend(config.attention_backend, config.device),
            step_capacity(config), config.tokenizer_vocab_size, RunnerOptions(False, False))
        del setup  # (the runner holds the shard)
        self.channel = StepChannel(group)
        self.num_steps = 0

    def run(self) -> None:
        """Serves rank 0's plans until `stop`; raises when the gang fails (see the module docstring)."""
        log.info("TP rank %d/%d following (KV heads %s)", self.group.rank, self.group.world_size,
                 list(self.shape.heads_of(self.group.rank)))
        while True:
            message = self.channel.receive()
            if message.kind == STOP:
                log.info("TP rank %d: stop after %d steps", self.group.rank, self.num_steps)
                return
            if message.kind != NOOP:
                self._step(message.plan or {})

    def _step(self, plan: dict) -> None:
        runner = self.runner
        if runner is None:
            raise RuntimeError(f"TP rank {self.group.rank} was closed")
        chunks = decode_chunks(plan)
        finished = plan.get("finished", [])
        if finished:
            runner.inputs.release(frozenset(finished))
        zero = plan.get("zero", [])
        if zero:
            self.page_pool.zero_blocks(set(zero))
        if chunks:
            runner.final_hidden(chunks)  # (the same forward as rank 0's: its all-reduces meet theirs)
            self.num_steps += 1

    def close(self) -> None:
        """Drops the shard and the runner (the group belongs to the caller, who closes it). Idempotent."""
        self.runner = None

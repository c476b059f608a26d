"""Rank 0's model runner in a TP gang: before each forward, the step's plan goes to the other ranks.

A plan (msgpack, over `pd.engine.parallel.step_channel`) is what a follower needs to run the same
forward over its shard: the chunks (request id, token ids, start position, block ids per KV cache
group, needs_logits), the requests finished since the last plan (their block-table rows are freed),
and the blocks to zero first (`zero_blocks`: pages of failed loads, zeroed on rank 0 by the connector
seam, on every other rank before the next forward). Followers never sample: only rank 0 holds the
LM head and the requests' sampling state.

Failure: every collective of a forward needs every rank, so nothing is retried once a plan went out.
Any exception after a broadcast (in the forward, or the broadcast itself failing) marks the runner
`broken`: later forwards raise at once without touching the group (a chunk-by-chunk retry of the step
isolation fails fast), and the engine raises `broken` after the step, which ends its loop (the gang is
the unit of failure). An error before the broadcast (a fault mark, a bad input caught by the engine)
still fails only its requests.

Idle: `keepalive` sends a `noop` after `KEEPALIVE_S` without a message (an empty plan when blocks wait
to be zeroed), so a follower never sits in a collective long enough to time out and a dead follower is
seen within about that time. `stop` ends the followers' loops.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pd.engine.model.llama import CausalLM
from pd.engine.parallel.group import TPGroup
from pd.engine.parallel.step_channel import StepChannel
from pd.engine.runner.model_runner import ModelRunner
from pd.engine.sched.output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # longest a gang goes without a message while rank 0 idles (well inside any sane timeout)


class GangError(RuntimeError):
    """A TP gang cannot go on: a rank died or hung, or a step failed after its plan went out."""


def encode_plan(chunks: Sequence[ScheduledChunk], finished: Sequence[str], zero: Sequence[int]) -> dict:
    """A step plan of plain values (what `decode_chunks` reads back)."""
    return {"finished": sorted(finished), "zero": sorted(zero),
            "chunks": [[c.request_id, list(c.token_ids), c.start, [list(ids) for ids in c.block_ids],
                        c.needs_logits] for c in chunks]}


def decode_chunks(plan: dict) -> list[ScheduledChunk]:
    """The chunks of a plan, checked to be plain values of the right kinds."""
    chunks = []
    for item in plan.get("chunks", []):
        rid, tokens, start, blocks, logits = item
        if not (isinstance(rid, str) and isinstance(start, int) and isinstance(logits, bool)
                and all(isinstance(t, int) for t in tokens) and all(isinstance(b, int) for g in blocks for b in g)):
            raise ValueError(f"a step plan's chunk is malformed: {item!r}"[:300])
        chunks.append(ScheduledChunk(rid, list(tokens), start, tuple(list(g) for g in blocks), logits))
    return chunks


class TPModelRunner(ModelRunner):
    """A `ModelRunner` over rank 0's shard that sends each forward's plan to the gang first.

    Guarantees: every forward of rank 0 is preceded by exactly one plan with the same chunks, so every
    rank runs the same collectives in the same order; no plan is sent once `broken` is set; blocks
    zeroed here are zeroed on every rank before the next forward."""

    def __init__(self, model: CausalLM, *args, group: TPGroup, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.group = group
        self.channel = StepChannel(group)
        self.broken: GangError | None = None
        self._finished: set[str] = set()
        self._zero: set[int] = set()
        self._last_sent = time.monotonic()

    @property
    def num_held_requests(self) -> int:
        """Rank 0's table rows, plus the requests released here whose release goes to the followers
        with the next plan (until then a follower still holds their tables)."""
        return super().num_held_requests + len(self._finished)

    # ------------------------------------------------------------------ what the engine calls
    def update_requests(self, sched: SchedulerOutput) -> None:
        super().update_requests(sched)
        self._finished.update(sched.finished_request_ids)

    def zero_blocks(self, block_ids: set[int]) -> None:
        """Zeroes these pages here now, and on every other rank before the next forward."""
        self.page_pool.zero_blocks(block_ids)
        self._zero.update(block_ids)

    def next_tokens(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None = None
                    ) -> list[int]:
        self.raise_if_broken()
        self._send(chunks)
        try:
            return super().next_tokens(chunks, on_layer)
        except Exception as exc:
            self.broken = GangError(f"TP rank 0: a step failed after its plan went to the gang "
                                    f"({type(exc).__name__}: {exc}); the gang cannot go on")
            raise self.broken from exc

    def keepalive(self) -> None:
        """Between steps: an empty plan when blocks wait to be zeroed, a `noop` after `KEEPALIVE_S` of
        silence; raises GangError when a rank is gone."""
        if self.broken is None and (self._zero or time.monotonic() - self._last_sent >= KEEPALIVE_S):
            self._send(())

    def raise_if_broken(self) -> None:
        if self.broken is not None:
            raise self.broken

    def stop(self) -> None:
        """Ends the followers' loops (nothing is sent once the gang is broken)."""
        if self.broken is None and not self.channel.stopped:
            try:
                self.channel.send_stop()
            except Exception as exc:  # noqa: BLE001 - stopping anyway; the followers see the group fail
                logger.warning("TP rank 0: sending stop failed: %s", exc)

    def abandon(self) -> None:
        """After the engine died: leaves the group at once, so the followers' pending collective fails
        now instead of at its timeout."""
        self.broken = self.broken or GangError("TP rank 0 left the gang")
        self.group.close()

    # ------------------------------------------------------------------ the channel
    def _send(self, chunks: Sequence[ScheduledChunk]) -> None:
        try:
            if chunks or self._zero:
                self.channel.send(encode_plan(chunks, tuple(self._finished), tuple(self._zero)))
                self._finished.clear()
                self._zero.clear()
            else:
                self.channel.send_noop()
        except Exception as exc:
            self.broken = GangError(f"TP rank 0 lost its gang (a rank died or hung; {self.group.world_size} "
                                    f"ranks, timeout {self.group.timeout_s} s): {type(exc).__name__}: {exc}")
            raise self.broken from exc
        self._last_sent = time.monotonic()

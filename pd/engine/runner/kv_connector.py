"""The runner's one seam to the KV connector: what a step asks of the connector's worker half.

The engine calls `before_forward(sched)` once the scheduler planned a step and `after_forward()` once
its forward ran (or failed), and gets back the step's one `ConnectorOutput`, which it hands to the
scheduler. Between the two, `layer_hook(chunks)` is the per-layer callback the runner's forward calls
(layer streaming). An engine built without a connector holds `connectors.noop`'s, so nothing here or
in the engine asks whether there is one.

    sched = scheduler.schedule()                  # builds the connector's metadata and stream steps
    seam.before_forward(sched)                    # bind the metadata, start the loads, ask for the layer hook
    runner.next_tokens(chunks, on_layer=seam.layer_hook(chunks))
    output = seam.after_forward()                 # saves done, finished sends/loads, failed loads
    scheduler.update_from_output(sched, sampled, output)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from connectors.base import ConnectorOutput, KVConnector
from pd.engine.kv.page_pool import PagePool
from pd.engine.sched.output import ScheduledChunk, SchedulerOutput


class ConnectorSeam:
    """Drives a connector's worker half around each step's forward.

    Guarantees: the connector sees the page pool (`register_kv_caches`) once, as the seam is built;
    per step, `before_forward` binds the step's metadata and starts its loads before any
    forward runs; `after_forward` returns exactly one `ConnectorOutput` (empty where nothing moved),
    after the connector finished its saves; pages whose load failed are zeroed before that output is
    returned (a failed load may leave NaN bytes, which attention's 0 weights would still turn into NaN);
    the connector is asked for a step's layer hook at most once, and the hook runs only in a forward of
    the whole step (a chunk retried alone after a failed step publishes nothing layer by layer: what is
    due goes after the step, with the prefill's progress). Called from the step thread only.
    """

    def __init__(self, connector: KVConnector, page_pool: PagePool,
                 zero_blocks: Callable[[set[int]], None] | None = None) -> None:
        self.connector = connector
        self.page_pool = page_pool
        # (a TP gang's rank 0 zeroes them on every rank: `TPModelRunner.zero_blocks`)
        self._zero_blocks = zero_blocks or page_pool.zero_blocks
        connector.register_kv_caches(page_pool)
        self._num_chunks = 0  # of the step between before_forward and after_forward
        self._layer_hook: Callable[[int], None] | None = None

    def before_forward(self, sched: SchedulerOutput) -> None:
        connector = self.connector
        connector.bind_connector_metadata(sched.connector_metadata)
        connector.start_load_kv()
        self._num_chunks = len(sched.chunks)
        self._layer_hook = connector.layer_hook(sched.stream_steps) if sched.stream_steps else None

    def layer_hook(self, chunks: Sequence[ScheduledChunk]) -> Callable[[int], None] | None:
        """The connector's per-layer callback for a forward of these chunks: the step's hook when they
        are the whole step, None for a part of it (the hook would publish the others' layers too)."""
        return self._layer_hook if len(chunks) == self._num_chunks else None

    def after_forward(self) -> ConnectorOutput:
        self._layer_hook, self._num_chunks = None, 0
        connector = self.connector
        connector.wait_for_save()
        sending, recving = connector.get_finished()
        invalid = set(connector.get_block_ids_with_load_errors())
        if invalid:
            self._zero_blocks(invalid)
        return ConnectorOutput(set(sending), set(recving), invalid, dict(connector.get_load_failures()))

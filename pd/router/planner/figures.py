"""The planner's cost figures, learned online from the timings workers report.

Every figure comes from measurement (`pd.cluster.messages.StepTiming` on a worker's
first event): nothing is configured or guessed. Per worker, the seconds it takes to
compute a request's prompt up to its first token, as a quadratic in the tokens it
computed plus a linear term in the tokens of other requests that shared its steps (the
batch: the decodes running beside it, other prompts' chunks); a decode worker's 1-token
admission steps after a pull are samples of the same curve. A prediction counts the
decodes running on the worker in each of the prompt's steps (`ceil(n / step budget)`
steps); other prompts pending there are the wait, not the batch. Per P->D pair, the
seconds a pull takes as a line in the bytes pulled (fixed latency + bytes / bandwidth);
the KV bytes per block; the work each worker still has ahead (router-side: the requests
sent to it that have not produced their first token yet, each costed by the curve, less
the time spent on them); and, per decision kind, the residual between the measured TTFT and the sum of the parts
(router hops, HTTP), as the median of the recent ones, taken only from predictions
that read every curve within its sampled sizes (an extrapolation's miss is the fit's,
not overhead, and would weigh on every short prompt after it).

Guarantees: a figure reports None until it has `min_samples` samples; windows are
bounded (`window` samples each), so figures follow a worker whose speed changes.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
import time

from pd.router.planner.fit import WindowFit

NUM_RESIDUALS = 32  # recent residuals per decision kind; their median is the figure
NUM_ARRIVALS = 64  # recent arrivals the overlap rate is measured over


@dataclasses.dataclass(frozen=True)
class FitSettings:
    window: int = 256
    min_samples: int = 4
    block_size: int = 16  # tokens per KV block (KV moves in whole blocks)
    max_num_batched_tokens: int = 2048  # a worker's step budget: a prompt of n tokens takes ceil(n / it) steps


class WorkerCosts:
    """One worker: its prefill curve and the requests it still has to compute (router-side)."""

    def __init__(self, settings: FitSettings) -> None:
        self.prefill = WindowFit(2, settings.window, settings.min_samples)
        self._step_budget = max(1, settings.max_num_batched_tokens)
        self._pending: dict[int, tuple[int, float]] = {}  # ticket -> (tokens to compute, sent at)
        self._tickets = itertools.count()
        self.last_queue_s = 0.0

    @property
    def num_pending_tokens(self) -> int:
        return sum(n for n, _ in self._pending.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def prefill_s(self, num_tokens: int, num_running: int = 0) -> float | None:
        """Predicted seconds to compute `num_tokens` prompt tokens to the first token while the
        worker runs `num_running` requests (router-side, in flight): those not still waiting for
        their own first token decode a token in each of the prompt's steps."""
        return self.prefill.predict(num_tokens, self.batch_tokens(num_tokens, num_running))

    def covers(self, num_tokens: int, num_running: int = 0) -> bool:
        """Whether `prefill_s` reads the curve within its sampled prompt sizes and batches."""
        return self.prefill.covers(num_tokens, self.batch_tokens(num_tokens, num_running))

    def batch_tokens(self, num_tokens: int, num_running: int) -> int:
        num_decodes = max(0, num_running - self.num_pending)
        return num_decodes * -(-max(1, num_tokens) // self._step_budget)

    def add_pending(self, num_tokens: int) -> int:
        ticket = next(self._tickets)
        self._pending[ticket] = (num_tokens, time.monotonic())
        return ticket

    def remove_pending(self, ticket: int) -> None:
        self._pending.pop(ticket, None)

    def wait_s(self, now: float | None = None) -> float | None:
        """Seconds before a new request's own compute starts: the predicted prefill of each request
        still pending here, less the time the worker has been at them (it works on them since the
        oldest was sent)."""
        if not self._pending:
            return 0.0
        total = 0.0
        for n, _ in self._pending.values():
            seconds = self.prefill.predict(n)
            if seconds is None:
                return None
            total += seconds
        now = time.monotonic() if now is None else now
        return max(0.0, total - (now - min(t for _, t in self._pending.values())))


class LinkCosts:
    """One P->D pair: pull seconds = latency + bytes / bandwidth, fitted."""

    def __init__(self, settings: FitSettings) -> None:
        self.pull = WindowFit(1, settings.window, settings.min_samples)

    def describe(self) -> dict:
        coefs = self.pull.coefficients()
        out: dict = {"num_samples": self.pull.num_samples, "latency_s": None, "gbps": None}
        if coefs is not None:
            out["latency_s"] = round(coefs[0], 6)
            out["gbps"] = round(1.0 / coefs[1] / 1e9, 4) if coefs[1] > 0 else None
        return out


class CostFigures:
    def __init__(self, settings: FitSettings | None = None) -> None:
        self.settings = settings or FitSettings()
        self._workers: dict[str, WorkerCosts] = {}
        self._links: dict[tuple[str, str], LinkCosts] = {}
        self.bytes_per_block: float | None = None
        self._residuals: dict[str, collections.deque[float]] = {}
        self._arrivals: collections.deque[tuple[float, bool]] = collections.deque(maxlen=NUM_ARRIVALS)
        self._num_decodes = 1

    def worker(self, worker_id: str) -> WorkerCosts:
        costs = self._workers.get(worker_id)
        if costs is None:
            costs = self._workers[worker_id] = WorkerCosts(self.settings)
        return costs

    def link(self, prefill_id: str, decode_id: str) -> LinkCosts:
        costs = self._links.get((prefill_id, decode_id))
        if costs is None:
            costs = self._links[(prefill_id, decode_id)] = LinkCosts(self.settings)
        return costs

    # -- samples ----------------------------------------------------------
    def observe_compute(self, worker_id: str, num_computed_tokens: int, compute_s: float, queue_s: float,
                        num_batched_tokens: int = 0) -> None:
        costs = self.worker(worker_id)
        costs.prefill.add(max(1, num_computed_tokens), compute_s, num_batched_tokens)
        costs.last_queue_s = queue_s

    def observe_pull(self, prefill_id: str, decode_id: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or num_blocks <= 0:
            return
        self.link(prefill_id, decode_id).pull.add(num_bytes, seconds)
        self.bytes_per_block = num_bytes / num_blocks

    def pull_bytes(self, num_tokens: int) -> float | None:
        """KV bytes a pull of `num_tokens` prompt tokens moves (whole blocks); None before any pull."""
        if self.bytes_per_block is None:
            return None
        return -(-num_tokens // self.settings.block_size) * self.bytes_per_block

    def observe_residual(self, kind: str, seconds: float) -> None:
        """Measured TTFT minus the predicted parts, for decisions of `kind`."""
        self._residuals.setdefault(kind, collections.deque(maxlen=NUM_RESIDUALS)).append(seconds)

    def residual_s(self, kind: str) -> float:
        recent = self._residuals.get(kind)
        return max(0.0, statistics.median(recent)) if recent else 0.0

    def observe_arrival(self, num_in_flight: int, num_decodes: int = 1, now: float | None = None) -> None:
        """A request reached the router while `num_in_flight` others were in flight, over `num_decodes` D."""
        self._arrivals.append((time.monotonic() if now is None else now, num_in_flight > 0))
        self._num_decodes = max(1, num_decodes)

    def overlap_rate(self, now: float | None = None) -> float:
        """Requests per second, per D, that arrive while others are in flight: how many reach a D
        while it computes (the recent arrivals that found none in flight do not count: a closed loop
        of one client never sends during its own request). Zero until two arrivals are known."""
        if len(self._arrivals) < 2:
            return 0.0
        now = time.monotonic() if now is None else now
        span = now - self._arrivals[0][0]
        num_overlapping = sum(busy for _, busy in itertools.islice(self._arrivals, 1, None))
        return num_overlapping / span / self._num_decodes if span > 0 else 0.0

    # -- pending work -----------------------------------------------------
    def add_pending(self, worker_id: str, num_tokens: int) -> int | None:
        """Counts a request sent to `worker_id` that computes `num_tokens` before its first token;
        the ticket (None for nothing to compute) goes back to `remove_pending` at that token."""
        return self.worker(worker_id).add_pending(num_tokens) if num_tokens > 0 else None

    def remove_pending(self, worker_id: str, ticket: int | None) -> None:
        if ticket is not None:
            self.worker(worker_id).remove_pending(ticket)

    def describe_worker(self, worker_id: str) -> dict:
        """One worker's figures (its prefill curve, pending work, and its links), for `GET /pd/workers`."""
        costs = self.worker(worker_id)
        links = {f"{p}->{d}": c.describe() for (p, d), c in self._links.items() if worker_id in (p, d)}
        return {"prefill": costs.prefill.describe(), "num_pending_tokens": costs.num_pending_tokens,
                "last_queue_s": round(costs.last_queue_s, 6), "links": links,
                "bytes_per_block": self.bytes_per_block}

    def describe(self) -> dict:
        """The current parameters, for `GET /pd/planner`."""
        return {
            "workers": {wid: {"prefill": c.prefill.describe(), "num_pending_tokens": c.num_pending_tokens,
                              "last_queue_s": round(c.last_queue_s, 6)} for wid, c in self._workers.items()},
            "links": {f"{p}->{d}": c.describe() for (p, d), c in self._links.items()},
            "bytes_per_block": self.bytes_per_block,
            "residual_s": {k: round(self.residual_s(k), 6) for k in self._residuals},
            "overlap_rate_per_s": round(self.overlap_rate(), 4),
        }

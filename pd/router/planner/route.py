"""The router's planner: the mode, the figures, the decision, and what it learns per request.

`RoutePlanner` is what the dispatcher talks to (pd.router.dispatch):
- `decide` gives the request's `Plan` (the mode's fixed kind, or the decider's choice
  in `planner` mode) from the pool's healthy workers and prefix hits;
- `observe_timing` feeds a worker's reported timing into the figures;
- `observe_ttft` closes the request: the residual, the prediction error metric.

Guarantees: in the fixed modes the workers stay the policy's choice (the plan only
names the kind, and its prediction is for the candidates the decider finds best of that
kind, exact on 1P1D); figures are learned in every mode, so switching to `planner`
starts from what the fixed mode measured.
"""
from __future__ import annotations

import logging

from pd.cluster.planner_config import PlannerSection
from pd.cluster.messages import StepTiming
from pd.router.choice import Role, WorkerPool
from pd.router.planner.decision import (Candidate, Decider, DecisionSettings, Kind, Option, Plan, Reason,
                                        rank)
from pd.router.planner.explain import OptionNote, RouteNote
from pd.router.planner.figures import CostFigures, FitSettings

logger = logging.getLogger(__name__)

_FIXED = {"always_disaggregate": Kind.REMOTE, "always_local": Kind.LOCAL}


class RoutePlanner:
    def __init__(self, settings: PlannerSection | None = None, metrics=None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048) -> None:
        self.settings = settings or PlannerSection()
        self.figures = CostFigures(FitSettings(self.settings.window, self.settings.min_samples, block_size,
                                               max_num_batched_tokens))
        self.decider = Decider(self.figures, DecisionSettings(self.settings.exploration_rate,
                                                              self.settings.tpot_weight, self.settings.seed))
        self._metrics = metrics

    @property
    def mode(self) -> str:
        return self.settings.mode

    def decide(self, pool: WorkerPool, prompt_token_ids: list[int], cache_salt: str | None = None) -> Plan | None:
        """The plan for this prompt; None when no plan can be made (no healthy decode worker):
        the dispatcher's acquire then answers 503, as without a planner. In every mode, no
        healthy P means local prefill on D (reason `no_prefill`: degrade, don't refuse)."""
        decodes = _candidates(pool, Role.DECODE, prompt_token_ids, cache_salt)
        prefills = _candidates(pool, Role.PREFILL, prompt_token_ids, cache_salt)
        fixed = _FIXED.get(self.mode)
        if not decodes:
            return None
        self.figures.observe_arrival(sum(c.num_running for c in decodes + prefills), len(decodes))
        n = len(prompt_token_ids)
        short = self._short(n, prefills, decodes)
        if short is not None:
            plan = short
        elif fixed is not None or not prefills:
            kind = fixed if prefills and fixed is not None else Kind.LOCAL
            options = self.decider.options(n, prefills, decodes, kinds=(kind,))
            known = [o for o in options if o.predicted_ttft_s is not None]
            plan = Plan(min(known, key=rank) if known else options[0], options,
                        Reason.FIXED if prefills or fixed is Kind.LOCAL else Reason.NO_PREFILL)
        else:
            plan = self.decider.plan(n, prefills, decodes)
        if self._metrics is not None:
            self._metrics.record_plan(plan.chosen.kind.value, plan.reason.value)
        return plan

    def _short(self, num_tokens: int, prefills: list[Candidate], decodes: list[Candidate]) -> Plan | None:
        """The local plan of a prompt with at most `local_prefill_max_tokens` left to compute on
        some D (after its prefix hit), in every mode: such a prefill costs D less than the pull
        and the first step would, and it never waits behind a long prompt on P. None otherwise."""
        limit = self.settings.local_prefill_max_tokens
        if not limit or not prefills or self.mode == "always_local":
            return None
        options = [o for o in self.decider.options(num_tokens, [], decodes, kinds=(Kind.LOCAL,))
                   if o.num_prefill_tokens <= limit]
        if not options:
            return None
        known = [o for o in options if o.predicted_ttft_s is not None]
        # without figures, the least busy D (then the longest hit): never always the first one
        chosen = min(known, key=rank) if known else min(options, key=lambda o: (o.decode.num_running,
                                                                                 -o.decode.hit_tokens))
        return Plan(chosen, options, Reason.SHORT)

    def fallback(self, pool: WorkerPool, prompt_token_ids: list[int], cache_salt: str | None = None) -> Plan | None:
        """The local plan for a request whose prefill worker was lost before it answered (None
        without a healthy decode worker)."""
        decodes = _candidates(pool, Role.DECODE, prompt_token_ids, cache_salt)
        if not decodes:
            return None
        options = self.decider.options(len(prompt_token_ids), [], decodes, kinds=(Kind.LOCAL,))
        known = [o for o in options if o.predicted_ttft_s is not None]
        plan = Plan(min(known, key=rank) if known else options[0], options, Reason.NO_PREFILL)
        if self._metrics is not None:
            self._metrics.record_plan(plan.chosen.kind.value, plan.reason.value)
        return plan

    def note(self, plan: Plan, note: RouteNote) -> None:
        chosen = plan.chosen
        note.decision, note.reason = chosen.kind.value, plan.reason.value
        note.predicted_ttft_s = chosen.predicted_ttft_s
        note.options = [OptionNote(o.kind.value, o.prefill.worker_id if o.prefill else None, o.decode.worker_id,
                                   o.predicted_ttft_s, o.tpot_cost_s, o.queue_cost_s) for o in plan.options]

    def observe_timing(self, worker_id: str, timing: StepTiming | None, source_id: str | None = None) -> None:
        """A worker's timing of one request; `source_id` the P worker its KV was pulled from."""
        if timing is None:
            return
        self.figures.observe_compute(worker_id, timing.num_computed_tokens, timing.compute_s, timing.queue_s,
                                     timing.num_batched_tokens)
        if source_id is not None and timing.num_loaded_bytes > 0:
            self.figures.observe_pull(source_id, worker_id, timing.num_loaded_blocks, timing.num_loaded_bytes,
                                      timing.load_s)

    def observe_ttft(self, chosen: Option, ttft_s: float) -> None:
        if chosen.parts_s is not None and chosen.interpolated:  # beyond the samples, the miss is the fit's
            self.figures.observe_residual(chosen.kind.value, ttft_s - chosen.parts_s)
        if self._metrics is not None:
            self._metrics.record_plan_ttft(chosen.kind.value, chosen.predicted_ttft_s, ttft_s)

    def describe(self) -> dict:
        return {"mode": self.mode, "exploration_rate": self.settings.exploration_rate,
                "tpot_weight": self.settings.tpot_weight, **self.figures.describe()}


def _candidates(pool: WorkerPool, role: Role, prompt_token_ids: list[int],
                cache_salt: str | None = None) -> list[Candidate]:
    return [Candidate(load.endpoint.worker_id, hit or 0, load.num_in_flight)
            for load, hit in pool.candidates(role, prompt_token_ids, cache_salt)]

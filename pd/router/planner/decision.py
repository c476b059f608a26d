"""The decision for one P/D request: where its prompt is prefilled.

Options, for each (P, D) pair and each D:
- `remote`: P prefills (less its own prefix hit), D pulls the KV and decodes;
- `remote_prefix`: the same where D already holds part of the prompt: D pulls only
  the missing part (the connector loads the tokens beyond D's local hit);
- `local`: D prefills the prompt itself (less its own hit), nothing moves.

Predicted TTFT (`CostFigures`):
    remote = wait(P) + prefill_P(n - hit_P) + pull_PD(bytes(n - hit_D)) + wait(D) + prefill_D(1) + residual
    local  = wait(D) + prefill_D(n - hit_D) + residual
and a local prefill also stalls the decodes running on D: its score adds
`tpot_weight * num_running(D) * prefill_D(n - hit_D)`. Whatever D computes for a request also
delays the requests that reach D meanwhile (every request needs D: a remote one for its pull
and first step), each by half that time on average: the score adds `queue_cost_s =
overlap_rate(D) * d^2 / 2` for the D seconds `d` of the option (the prefill for local, the
1-token step for remote), with `overlap_rate` the measured rate of requests arriving while others
are in flight (`CostFigures.overlap_rate`; zero for one request at a time). P's time costs no such
term: a request arriving while P is busy can still prefill on D.

Guarantees: the chosen option of `plan` is, outside exploration, the one with the lowest
score among those whose every figure is measured; while some option lacks a figure
(cold start), that option is taken, so each figure gets samples before it is trusted;
with probability `exploration_rate` a uniformly random option is taken instead.
"""
from __future__ import annotations

import dataclasses
import enum
import random

from pd.router.planner.figures import CostFigures


class Kind(str, enum.Enum):
    REMOTE = "remote"
    REMOTE_PREFIX = "remote_prefix"
    LOCAL = "local"


class Reason(str, enum.Enum):
    FIXED = "fixed"  # the mode allows one kind only
    BEST = "best"
    EXPLORE = "explore"
    COLD_START = "cold_start"
    NO_PREFILL = "no_prefill"  # no prefill worker can run it (none healthy, or it was lost): D prefills
    SHORT = "short"  # at most `local_prefill_max_tokens` to compute on D: D prefills, nothing moves


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A healthy worker as the planner sees it: its id, the prompt's predicted prefix hit on
    it (tokens) and the requests it runs (router-side, in flight)."""

    worker_id: str
    hit_tokens: int = 0
    num_running: int = 0


@dataclasses.dataclass(frozen=True)
class Option:
    kind: Kind
    prefill: Candidate | None  # None for local
    decode: Candidate
    num_tokens: int
    predicted_ttft_s: float | None  # None: a figure is missing
    parts_s: float | None  # the prediction less the residual (what the residual is measured against)
    tpot_cost_s: float
    interpolated: bool = True  # every curve was read within its sampled sizes (else: its error is the fit's)
    queue_cost_s: float = 0.0  # what the D seconds it takes cost the requests arriving meanwhile

    @property
    def score(self) -> float:
        return (self.predicted_ttft_s or 0.0) + self.tpot_cost_s + self.queue_cost_s

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens the prefilling worker computes."""
        hit = self.decode.hit_tokens if self.prefill is None else self.prefill.hit_tokens
        return max(1, self.num_tokens - hit)


@dataclasses.dataclass(frozen=True)
class Plan:
    chosen: Option
    options: list[Option]
    reason: Reason


@dataclasses.dataclass(frozen=True)
class DecisionSettings:
    exploration_rate: float = 0.05
    tpot_weight: float = 1.0
    seed: int | None = None


class Decider:
    def __init__(self, figures: CostFigures, settings: DecisionSettings | None = None) -> None:
        self.figures = figures
        self.settings = settings or DecisionSettings()
        self._rng = random.Random(self.settings.seed)
        self._cold_turn = 0

    def option(self, kind: Kind, num_tokens: int, decode: Candidate, prefill: Candidate | None = None) -> Option:
        """One option's prediction; `kind` LOCAL ignores `prefill`."""
        if kind is Kind.LOCAL:
            return self._local(num_tokens, decode)
        if prefill is None:
            raise ValueError("a remote option needs a prefill candidate")
        return self._remote(num_tokens, prefill, decode)

    def options(self, num_tokens: int, prefills: list[Candidate], decodes: list[Candidate],
                kinds: tuple[Kind, ...] = (Kind.REMOTE, Kind.LOCAL)) -> list[Option]:
        out: list[Option] = []
        for decode in decodes:
            if Kind.REMOTE in kinds:
                out.extend(self._remote(num_tokens, p, decode) for p in prefills)
            if Kind.LOCAL in kinds:
                out.append(self._local(num_tokens, decode))
        return out

    def plan(self, num_tokens: int, prefills: list[Candidate], decodes: list[Candidate]) -> Plan:
        """The option to take for a prompt of `num_tokens` (see the module doc)."""
        options = self.options(num_tokens, prefills, decodes)
        if not options:
            raise ValueError("no option: the plan needs at least one decode candidate")
        unknown = [o for o in options if o.predicted_ttft_s is None]
        if unknown:  # rotate over the options lacking figures, so each gets its samples
            self._cold_turn += 1
            return Plan(unknown[self._cold_turn % len(unknown)], options, Reason.COLD_START)
        if len(options) > 1 and self._rng.random() < self.settings.exploration_rate:
            return Plan(self._rng.choice(options), options, Reason.EXPLORE)
        return Plan(min(options, key=rank), options, Reason.BEST)

    # -- predictions ------------------------------------------------------
    def _remote(self, num_tokens: int, prefill: Candidate, decode: Candidate) -> Option:
        f = self.figures
        kind = Kind.REMOTE_PREFIX if decode.hit_tokens > 0 else Kind.REMOTE
        p_costs, d_costs = f.worker(prefill.worker_id), f.worker(decode.worker_id)
        num_pulled = max(1, num_tokens - decode.hit_tokens)
        num_bytes = f.pull_bytes(num_pulled)
        pull = None if num_bytes is None else f.link(prefill.worker_id, decode.worker_id).pull.predict(num_bytes)
        num_p_tokens = max(1, num_tokens - prefill.hit_tokens)
        d_step = d_costs.prefill_s(1, decode.num_running)
        parts = _sum(p_costs.wait_s(), p_costs.prefill_s(num_p_tokens, prefill.num_running), pull,
                     d_costs.wait_s(), d_step)
        link = f.link(prefill.worker_id, decode.worker_id).pull
        inside = p_costs.covers(num_p_tokens, prefill.num_running) and num_bytes is not None and link.covers(num_bytes)
        return Option(kind, prefill, decode, num_tokens, _plus(parts, f.residual_s(kind.value)), parts, 0.0, inside,
                      self._queue_cost(d_step))

    def _local(self, num_tokens: int, decode: Candidate) -> Option:
        costs = self.figures.worker(decode.worker_id)
        num_d_tokens = max(1, num_tokens - decode.hit_tokens)
        compute = costs.prefill_s(num_d_tokens, decode.num_running)
        parts = _sum(costs.wait_s(), compute)
        stall = self.settings.tpot_weight * decode.num_running * (compute or 0.0)
        return Option(Kind.LOCAL, None, decode, num_tokens, _plus(parts, self.figures.residual_s(Kind.LOCAL.value)),
                      parts, stall, costs.covers(num_d_tokens, decode.num_running), self._queue_cost(compute))

    def _queue_cost(self, d_seconds: float | None) -> float:
        """The expected wait of the requests that reach a D while it spends `d_seconds` on this one:
        `rate * d` of them, each waiting `d / 2` on average (uniform arrivals)."""
        return self.figures.overlap_rate() * (d_seconds or 0.0) ** 2 / 2.0


def rank(option: Option) -> tuple:
    """Lowest score first; options within a millisecond of each other go to the less busy workers
    (equal figures must not send every request to the first D of the list)."""
    p_running = option.prefill.num_running if option.prefill is not None else 0
    return round(option.score, 3), option.decode.num_running, p_running


def _sum(*parts: float | None) -> float | None:
    return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]


def _plus(value: float | None, extra: float) -> float | None:
    return None if value is None else value + extra

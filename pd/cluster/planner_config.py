"""The router's planner section of the deploy config (`router.planner`): where each P/D request prefills."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pd.cluster.schema import StrictModel


class PlannerSection(StrictModel):
    """Where each P/D request prefills (pd.router.planner): `always_disaggregate` (today's flow:
    prefill on P, D pulls), `always_local` (D prefills itself, no transfer) or `planner` (the
    option with the lowest predicted TTFT, from figures measured online, plus `tpot_weight` x the
    seconds a local prefill stalls D's running decodes; `exploration_rate` of requests take a
    random option so every figure keeps fresh samples). In every mode, `local_prefill_max_tokens`
    > 0 keeps short prompts on D (reason `short`)."""

    mode: Literal["always_disaggregate", "always_local", "planner"] = "always_disaggregate"
    exploration_rate: float = Field(0.05, ge=0.0, le=1.0)
    tpot_weight: float = Field(1.0, ge=0.0, description="cost of one second of stall on one running decode")
    window: int = Field(256, ge=8, description="recent samples each fitted figure keeps")
    min_samples: int = Field(4, ge=1, description="samples a figure needs before it is trusted (else: explore)")
    seed: int | None = Field(None, description="exploration's random seed (tests, benchmarks)")
    local_prefill_max_tokens: int = Field(0, ge=0, le=1 << 20, description=(
        "in every mode: a prompt with at most this many tokens left to compute on a D (after its prefix "
        "hit) prefills on that D, never behind a long prompt on P (0: off)"))

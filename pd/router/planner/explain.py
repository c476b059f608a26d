"""Why one request went where it went: the record the router fills and reports.

`RouteNote` is created by the caller of `Dispatcher.stream_tokens`, filled by the
dispatcher (the decision, its predicted TTFT, the options weighed) and completed with
the measured TTFT at the first token (and, where P's first token went to the client, the
start of D's stream: what a remote option's prediction is measured against); `as_dict` is
the response extension field `pdkv_route`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OptionNote:
    kind: str
    prefill_worker: str | None
    decode_worker: str
    predicted_ttft_s: float | None
    tpot_cost_s: float | None
    queue_cost_s: float | None = None


@dataclasses.dataclass
class RouteNote:
    decision: str | None = None  # remote / remote_prefix / local / colocated
    reason: str | None = None  # fixed (the mode), best, explore, cold_start, no_prefill, short
    predicted_ttft_s: float | None = None
    ttft_s: float | None = None
    # P/D with P's first token sent on (pd.router.first_token): when D's stream started, the moment the
    # planner predicts for a remote option (None where D gave the first token: then it is `ttft_s`)
    decode_start_s: float | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    options: list[OptionNote] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("predicted_ttft_s", "ttft_s", "decode_start_s"):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        for option in out["options"]:
            for key in ("predicted_ttft_s", "tpot_cost_s", "queue_cost_s"):
                if option[key] is not None:
                    option[key] = round(option[key], 6)
        return out

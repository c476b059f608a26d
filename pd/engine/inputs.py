"""What enters the engine: a request checked once at the engine's edge (`Engine.check_request`)."""
from __future__ import annotations

import dataclasses

from connectors.params import TransferParams
from pd.engine.sample.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request that one engine checked (`Engine.check_request`): its prompt ids lie in that engine's
    vocabulary, and its prompt with `sampling.max_tokens` can run on that engine's pool (`check_fits`).

    Guarantees: only `Engine.check_request` makes one that an engine admits (`checked_by` names the
    engine); that engine admits it (`Engine.submit`, `Engine.stream`) without checking it again, and
    any other engine refuses it. `kv_transfer_params` reach the connector as they are here. The prompt
    list is the engine's once checked: callers must not change it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_transfer_params: TransferParams | None = None
    cache_salt: str | None = None  # enters the first block's hash (kvcache.hashing)
    checked_by: object = dataclasses.field(default=None, repr=False, compare=False)

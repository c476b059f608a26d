"""The names of the connector's fault-injection points, apart from the link that fires them.

`LINK_POINTS`: `side.<type>` for side-channel messages and `data.<type>` for
data-stream frames (`wire.MsgType` values), plus `data.page_bytes` for the raw
page bytes that follow a PAGES header. `GANG_POINTS`: the ranks of a TP gang,
each moving its own KV heads (fired by the rank, not by a link). This module imports no socket library,
so a config can check a fault plan's point names without loading zmq.
"""
from __future__ import annotations

from connectors.zmq.control.wire import MsgType

LINK_POINTS = frozenset({f"side.{t.value}" for t in MsgType} | {f"data.{t.value}" for t in MsgType}
                        | {"data.page_bytes"})

# A TP gang's ranks (`connectors/zmq/gang/`): `gang.slice` fires on a P rank about to answer a D rank's
# slice pull, `gang.load` on a D rank about to pull its part of a load; `gang.rank<r>.slice` /
# `gang.rank<r>.load` on rank r only. Every rank holding the plan counts its own hits.
MAX_GANG_RANKS = 8
GANG_POINTS = frozenset({"gang.slice", "gang.load"} | {f"gang.rank{r}.{k}" for r in range(MAX_GANG_RANKS)
                                                       for k in ("slice", "load")})

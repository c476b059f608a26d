"""The names of the connector's fault-injection points, apart from the link that fires them.

`LINK_POINTS`: `side.<type>` for side-channel messages and `data.<type>` for
data-stream frames (`wire.MsgType` values), plus `data.page_bytes` for the raw
page bytes that follow a PAGES header. This module imports no socket library,
so a config can check a fault plan's point names without loading zmq.
"""
from __future__ import annotations

from connectors.zmq.control.wire import MsgType

LINK_POINTS = frozenset({f"side.{t.value}" for t in MsgType} | {f"data.{t.value}" for t in MsgType}
                        | {"data.page_bytes"})

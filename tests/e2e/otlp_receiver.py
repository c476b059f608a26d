"""An OTLP/HTTP traces receiver for tests: a real aiohttp server on loopback, on a thread of its own,
decoding each export (protobuf `ExportTraceServiceRequest`) into `ReceivedSpan`s."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: int
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver:
    """`endpoint` takes OTLP/HTTP protobuf exports; `spans` holds everything received."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-receiver", daemon=True)
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.endpoint = f"http://127.0.0.1:{port}/v1/traces"
        return self

    def __exit__(self, *exc) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> int:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/v1/traces", self._traces)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return self._runner.addresses[0][1]

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        got = []
        for resource_spans in export.resource_spans:
            service = str(_attrs(resource_spans.resource.attributes).get("service.name"))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    got.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex() or None, s.kind,
                        s.start_time_unix_nano, s.end_time_unix_nano, _STATUS_NAMES[s.status.code],
                        _attrs(s.attributes), [(e.name, _attrs(e.attributes)) for e in s.events]))
        with self._lock:
            self.spans.extend(got)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The trace's spans once every name in `names` is among them (fails after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: missing {names - {s.name for s in spans}}; "
                                     f"got {sorted(s.name for s in spans)}")
            time.sleep(0.1)

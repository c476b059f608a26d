"""The router's client for a worker's internal HTTP API.

Guarantees:
- every call has a timeout: connect, stall (no byte for `stall_timeout_s`)
  and total; none can hang the router;
- failures surface as `WorkerCallError` carrying a `CallCause` (and the HTTP
  status where there was one), so the router can tell a dead worker from a
  bad request;
- requests are built and events parsed with `pd.cluster.messages`: an event
  that does not validate is a broken stream, never half-read;
- leaving a `generate` stream early closes the connection, which makes the
  worker abort the request and free its blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import AsyncGenerator

import aiohttp
from pydantic import ValidationError

from pd.cluster.messages import DEVICE_FAULT_CAUSE, GenerateRequest, TokenEvent

logger = logging.getLogger(__name__)


class CallCause(str, enum.Enum):
    """Why a call to a worker failed (also the `cause` label of the failure metric)."""

    CONNECT = "connect"  # no connection (the worker is down or unreachable)
    TIMEOUT = "timeout"  # no answer, or no byte for the stall timeout
    STREAM = "stream"  # the stream broke, ended early or carried a malformed event
    REFUSED = "refused"  # HTTP 4xx: the worker refused this request (bad input for it)
    HTTP_ERROR = "http_error"  # any other non-200 answer
    WORKER_ERROR = "worker_error"  # the worker reported an error in-band
    DEVICE_FAULT = "device_fault"  # in-band too: its device failed in this request's step; it restarts


_UNREACHABLE = frozenset({CallCause.CONNECT, CallCause.STREAM, CallCause.TIMEOUT})


class WorkerCallError(RuntimeError):
    def __init__(self, cause: CallCause, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status  # the HTTP status of REFUSED / HTTP_ERROR

    @classmethod
    def for_status(cls, status: int, message: str) -> WorkerCallError:
        if status == 503:  # the worker cannot serve (e.g. its engine died): nothing started there, try another
            return cls(CallCause.CONNECT, message, status)
        return cls(CallCause.REFUSED if 400 <= status < 500 else CallCause.HTTP_ERROR, message, status)

    @property
    def worker_unreachable(self) -> bool:
        """True when the worker itself looks gone, not just this request."""
        return self.cause in _UNREACHABLE


@dataclasses.dataclass(frozen=True)
class ClientTimeouts:
    connect_s: float = 5.0
    stall_s: float = 60.0
    total_s: float = 300.0
    probe_s: float = 2.0


@dataclasses.dataclass
class TraceHop:
    """The W3C trace headers of one worker call (pd.router.timeline; None with tracing off), and the
    worker's own span as it answered it in its `traceresponse` header (a traceparent value)."""

    headers: dict[str, str]
    answered: str | None = None


class WorkerClient:
    def __init__(self, secret: str, timeouts: ClientTimeouts) -> None:
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, url: str, request: GenerateRequest, first_byte_s: float | None = None,
                       hop: TraceHop | None = None) -> AsyncGenerator[TokenEvent, None]:
        """Streams the worker's events for one request; the last has `finished`. A live worker
        answers its headers at once, so `first_byte_s` (when given) bounds the wait for them: a
        stalled worker fails as `connect` (nothing was started there) long before `stall_s`."""
        t = self._timeouts
        timeout = aiohttp.ClientTimeout(total=t.total_s, connect=t.connect_s, sock_read=t.stall_s)
        body = request.model_dump_json(exclude_none=True).encode()
        finished = False
        assert self._session is not None, "WorkerClient used before start()"
        try:
            headers = {"Content-Type": "application/json", **(hop.headers if hop is not None else {})}
            call = self._session.post(f"{url}/internal/generate", data=body, timeout=timeout, headers=headers)
            try:
                response = await asyncio.wait_for(call, first_byte_s)
            except asyncio.TimeoutError:
                if first_byte_s is None:
                    raise
                raise WorkerCallError(CallCause.CONNECT, f"no response from {url} within {first_byte_s}s") from None
            async with response as resp:
                if resp.status != 200:
                    raise WorkerCallError.for_status(resp.status, await _error_text(resp))
                if hop is not None:
                    hop.answered = resp.headers.get("traceresponse")
                while True:
                    line = await resp.content.readline()
                    if not line:
                        break
                    event = TokenEvent.model_validate_json(line)
                    if event.error:
                        faulted = event.error_cause == DEVICE_FAULT_CAUSE
                        cause = CallCause.DEVICE_FAULT if faulted else CallCause.WORKER_ERROR
                        raise WorkerCallError(cause, event.error)
                    finished = event.finished
                    yield event
                    if finished:
                        return
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            cause = CallCause.CONNECT if not finished else CallCause.STREAM
            raise WorkerCallError(cause, f"{type(exc).__name__}: {exc}") from None
        except asyncio.TimeoutError:
            raise WorkerCallError(CallCause.TIMEOUT, f"no answer from {url} within the timeout") from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientOSError, ConnectionError) as exc:
            raise WorkerCallError(CallCause.STREAM, f"stream from {url} broke: {type(exc).__name__}: {exc}") from None
        except ValidationError as exc:
            raise WorkerCallError(CallCause.STREAM, f"malformed event from {url}: {exc.errors()[0]['msg']}") from None
        if not finished:
            raise WorkerCallError(CallCause.STREAM, f"stream from {url} ended before the request finished")

    async def get_json(self, url: str, path: str, timeout_s: float | None = None) -> dict:
        return await self._call_json("GET", url, path, None, timeout_s)

    async def post_json(self, url: str, path: str, body: dict, timeout_s: float | None = None) -> dict:
        return await self._call_json("POST", url, path, body, timeout_s)

    async def _call_json(self, method: str, url: str, path: str, body: dict | None, timeout_s: float | None) -> dict:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeouts.probe_s)
        assert self._session is not None, "WorkerClient used before start()"
        try:
            async with self._session.request(method, f"{url}{path}", json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise WorkerCallError.for_status(resp.status, await _error_text(resp))
                return await resp.json()
        except asyncio.TimeoutError:
            raise WorkerCallError(CallCause.TIMEOUT, f"{url}{path}: no answer within {timeout.total}s") from None
        except aiohttp.ClientError as exc:
            raise WorkerCallError(CallCause.CONNECT, f"{url}{path}: {type(exc).__name__}: {exc}") from None


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    try:
        body = await resp.json(content_type=None)
        return str(body.get("error", {}).get("message", body))
    except (ValueError, aiohttp.ClientError):
        return f"HTTP {resp.status}"

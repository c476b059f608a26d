"""The client side of `pd.tools.load_faults`, in a process of its own.

It reads one JSON spec on stdin and, for `duration_s`, runs at once:
- `num_clients` closed-loop clients, each streaming greedy completions (with token ids) one
  after another and, after a 429 or 503, waiting the `Retry-After` it was given;
- `num_junk` unauthenticated connections held on a producer's data port (a quarter idle, the
  rest trickling a frame byte by byte; one the producer closes is opened again);
- unauthenticated REFUSE frames to the producer's side channel at `refuse_rate` a second,
  each with a new reason (and a line break in it), from a new ZMQ identity every 200 frames;
- `num_router_idle` idle connections held on the router's port (one the router closes, at its
  keep-alive timeout or past its connection cap, is opened again);
- `num_event_subscribers` never-reading subscribers on a worker's KV event stream, half with the
  deployment secret and half without (`pd.tools.load_faults.injectors.EventSubscribers`);
- `num_poisoned` completions with poisoned sampling values, spread over the run
  (`pd.tools.load_faults.injectors.poisoned_client`).

It writes JSON lines on stdout: `{"event": "started"}` when the load begins, then one
`{"event": "result", ...}` with a row per request. Apart from the load it is the harness, so it
lives apart from the router it measures (one GIL each).

    echo '{"url": ..., "prompts": [...], ...}' | python -m pd.tools.load_faults.driver
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import threading
import time

import aiohttp
import zmq

from connectors.zmq.control import wire
from connectors.zmq.control.wire import MsgType
from pd.tools.junk_connections import HTTP_TRICKLE, JunkHolder
from pd.tools.load_faults.injectors import EventSubscribers, poisoned_client
from pd.tools.sse_stream import SSEStream

RETRY_AFTER_CAP_S = 5.0
FRAMES_PER_IDENTITY = 200


@dataclasses.dataclass(frozen=True)
class DriverSpec:
    """What the driver runs: the load, and the unauthenticated traffic beside it."""

    url: str
    prompts: list[str]
    max_tokens: int
    num_clients: int
    duration_s: float
    request_timeout_s: float
    api_key: str | None = None
    kv_host: str = "127.0.0.1"
    data_port: int = 0
    num_junk: int = 0
    side_port: int = 0
    refuse_rate: float = 0.0
    router_host: str = "127.0.0.1"
    router_port: int = 0
    num_router_idle: int = 0
    events_endpoint: str = ""
    secret: str = ""  # the deployment secret: half the event subscribers hold it
    num_event_subscribers: int = 0
    num_poisoned: int = 0

    @classmethod
    def from_json(cls, text: str) -> DriverSpec:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"driver spec: unknown field(s) {unknown}")
        return cls(**data)


class RefuseSender(threading.Thread):
    """REFUSE frames with ever new reasons to a side channel, at `rate` a second."""

    def __init__(self, host: str, port: int, rate: float, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="refuse-sender")
        self.endpoint, self.rate, self.stop = f"tcp://{host}:{port}", rate, stop
        self.num_sent = 0

    def run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        rng, t0 = random.Random(7), time.monotonic()
        while not self.stop.is_set():
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 2000)
            dealer.setsockopt(zmq.SNDTIMEO, 2000)
            dealer.connect(self.endpoint)
            try:
                for _ in range(FRAMES_PER_IDENTITY):
                    ahead = self.num_sent / self.rate - (time.monotonic() - t0)
                    if ahead > 0 and self.stop.wait(ahead):
                        break
                    reason = f"{rng.choice(['busy', 'Busy!', 'auth', 'x' * 300])}-{self.num_sent}\nWARNING forged"
                    dealer.send(wire.encode(MsgType.REFUSE, reason=reason, detail=f"detail {rng.random()}\r\n"))
                    self.num_sent += 1
            except zmq.Again:
                pass
            finally:
                dealer.close()


async def _one_request(session: aiohttp.ClientSession, spec: DriverSpec, prompt_index: int) -> dict:
    body = {"prompt": spec.prompts[prompt_index], "max_tokens": spec.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    row: dict = {"prompt": prompt_index, "status": None, "retry_after": None, "token_ids": [], "errors": [],
                 "done": False, "hung": False, "exception": None}
    t0 = time.monotonic()
    try:
        async with session.post(f"{spec.url}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=spec.request_timeout_s)) as resp:
            row["status"] = resp.status
            row["retry_after"] = resp.headers.get("Retry-After")
            if resp.status != 200:
                row["errors"].append((await resp.text())[:200])
            else:
                stream = SSEStream(resp.content)
                async for event in stream:
                    if "error" in event:
                        row["errors"].append(str(event["error"])[:200])
                    for choice in event.get("choices") or []:
                        row["token_ids"].extend(choice.get("token_ids") or [])
                row["done"] = stream.done
    except asyncio.TimeoutError:
        row["hung"] = True
    except (aiohttp.ClientError, ValueError) as exc:
        row["exception"] = f"{type(exc).__name__}: {exc}"[:200]
    row["seconds"] = round(time.monotonic() - t0, 3)
    return row


async def _client(session: aiohttp.ClientSession, spec: DriverSpec, index: int, deadline: float,
                  rows: list[dict]) -> None:
    k = 0
    while time.monotonic() < deadline:
        row = await _one_request(session, spec, (index + k * spec.num_clients) % len(spec.prompts))
        rows.append(row)
        k += 1
        if row["status"] in (429, 503):
            try:
                wait_s = min(float(row["retry_after"]), RETRY_AFTER_CAP_S)
            except (TypeError, ValueError):
                wait_s = 1.0
            await asyncio.sleep(wait_s * (0.5 + random.random()))  # jittered, so retries do not come in waves


async def run_driver(spec: DriverSpec, on_started=None) -> dict:
    """Runs the load and the junk beside it; the rows of every request and the injectors' counts."""
    stop = threading.Event()
    junk = JunkHolder(spec.kv_host, spec.data_port, spec.num_junk, stop) if spec.num_junk else None
    refuse = RefuseSender(spec.kv_host, spec.side_port, spec.refuse_rate, stop) if spec.refuse_rate else None
    router_idle = (JunkHolder(spec.router_host, spec.router_port, spec.num_router_idle, stop, payload=HTTP_TRICKLE,
                              kinds="idle") if spec.num_router_idle else None)
    subscribers = (EventSubscribers(spec.events_endpoint, spec.secret, spec.num_event_subscribers, stop)
                   if spec.num_event_subscribers else None)
    injectors = [t for t in (junk, refuse, router_idle, subscribers)
                 if t is not None]  # threads beside the load, one per fault
    for thread in injectors:
        thread.start()
    rows: list[dict] = []
    poisoned: list[dict] = []
    t0 = time.monotonic()
    try:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            if on_started is not None:
                on_started()
            deadline = t0 + spec.duration_s
            await asyncio.gather(*(_client(session, spec, i, deadline, rows) for i in range(spec.num_clients)),
                                 poisoned_client(session, spec, deadline, poisoned))
    finally:
        stop.set()
        for thread in injectors:
            thread.join(10)
    return {"rows": rows, "seconds": round(time.monotonic() - t0, 3),
            "junk_opened": junk.num_opened if junk else 0,
            "junk_closed_by_peer": junk.num_closed_by_peer if junk else 0,
            "junk_min_open": junk.min_open if junk else 0,
            "refuse_sent": refuse.num_sent if refuse else 0,
            "router_idle": ({"held": spec.num_router_idle, "opened": router_idle.num_opened,
                             "closed_by_peer": router_idle.num_closed_by_peer, "min_open": router_idle.min_open,
                             "max_open": router_idle.max_open} if router_idle else {}),
            "event_subscribers": subscribers.figures() if subscribers else {}, "poisoned": poisoned}


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    try:
        spec = DriverSpec.from_json(sys.stdin.read())
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(run_driver(spec, on_started=lambda: _emit({"event": "started"})))
    _emit({"event": "result", **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

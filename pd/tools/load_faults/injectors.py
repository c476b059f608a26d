"""Two more faults of `pd.tools.load_faults.driver`, beside the load: subscribers of a worker's
KV event stream that never read, and a client that sends poisoned sampling values.

- `EventSubscribers(endpoint, secret, n, stop)` holds `n` ZMQ SUB sockets on a worker's KV
  event stream (CURVE XPUB, `pd.worker.kv_events`) and never reads one of them: the first half
  hold the deployment secret (its CURVE client keys, `pd.cluster.kv_wire.curve_keys`), so the
  worker's gate admits up to its cap and refuses the rest; the other half are plain SUB sockets
  without it, whose handshake cannot complete. libzmq reconnects each refused one by itself (the
  default interval), as a careless or hostile subscriber would. A monitor on each socket counts
  what it saw of the handshakes: `figures()` gives the sockets opened, those that connected at
  TCP level, those admitted at least once, and the failed handshakes by kind.
- `poisoned_client(session, spec, deadline, rows)` sends `num_poisoned` completions evenly over
  the run, each with sampling values at the edges of what the request schema accepts
  (`POISONED`: temperatures and top_p near 0 or subnormal, top_k past the vocabulary, extreme
  seeds), streamed and not in turn. After a 429/503 it waits its `Retry-After` and sends the same
  values again: every poisoned request must end answered 200 with all its tokens.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import aiohttp
import zmq
from zmq.utils.monitor import recv_monitor_message

from pd.cluster.kv_wire import TOPIC, curve_keys
from pd.tools.sse_stream import SSEStream

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MONITOR_EVERY_S = 0.5
POISONED_MAX_TOKENS = 6
MAX_POISONED_ATTEMPTS = 20
RETRY_AFTER_CAP_S = 5.0

# Accepted by `pd.router.openai_api` (temperature in [0, 2], top_p in (0, 1], top_k in [-1, 2^20], int64 seeds)
POISONED: tuple[dict[str, Any], ...] = (
    {"temperature": 1e-300},  # 0 in float32: logits / T is inf or nan
    {"top_p": 1e-320},  # a subnormal double: below any probability mass
    {"temperature": 1e-300, "top_p": 1e-320, "top_k": 1 << 20},
    {"temperature": 5e-324, "top_p": 5e-324, "top_k": 1},  # the smallest positive doubles
    {"temperature": 1e-45, "seed": INT64_MAX},  # float32's smallest subnormal
    {"temperature": 1e-38, "top_p": 1e-38, "seed": INT64_MIN},
    {"temperature": 0.0, "seed": INT64_MIN},  # greedy with a seed
    {"temperature": 0.0, "seed": -1, "top_p": 1e-320, "top_k": 1 << 20},
    {"temperature": 2.0, "top_k": 1 << 20, "seed": INT64_MAX},  # the hottest, with top_k past the vocabulary
    {"temperature": 2.0, "top_p": 1.0, "top_k": -1, "seed": 0},
    {"temperature": 1.0, "top_p": 0.9999999999999999, "top_k": 0},
    {"temperature": 1e-300, "max_tokens": 1},  # the fewest tokens
)

_FAILED_EVENTS: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
                                  zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
                                  zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail"}


class EventSubscribers(threading.Thread):
    """Holds `n` never-reading subscribers on a KV event stream until `stop` is set."""

    def __init__(self, endpoint: str, secret: str, n: int, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="event-subscribers")
        self.endpoint, self.secret, self.n, self.stop = endpoint, secret, n, stop
        self.num_with_secret = (n + 1) // 2
        self.num_opened = 0
        self.connected: set[int] = set()  # sockets that connected at TCP level at least once
        self.admitted: set[int] = set()  # sockets whose handshake succeeded at least once
        self.failed: dict[str, dict[str, int]] = {"with_secret": {}, "plain": {}}  # handshakes failed, by kind

    def run(self) -> None:
        ctx = zmq.Context()
        keys = curve_keys(self.secret)
        socks, monitors = [], []
        try:
            for i in range(self.n):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.RCVHWM, 1)  # what libzmq would queue for a reader that never comes
                s.setsockopt(zmq.RCVBUF, 4096)
                s.setsockopt(zmq.LINGER, 0)
                if i < self.num_with_secret:
                    s.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
                    s.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
                    s.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
                s.setsockopt(zmq.SUBSCRIBE, TOPIC)
                monitors.append(s.get_monitor_socket())
                s.connect(self.endpoint)
                socks.append(s)
                self.num_opened += 1
            while not self.stop.wait(MONITOR_EVERY_S):
                self._read_monitors(monitors)
            self._read_monitors(monitors)
        finally:
            for s in socks:
                s.disable_monitor()
            for sock in monitors + socks:
                sock.close(linger=0)
            ctx.term()

    def _read_monitors(self, monitors: list[zmq.Socket]) -> None:
        for i, mon in enumerate(monitors):
            kind = "with_secret" if i < self.num_with_secret else "plain"
            for _ in range(1000):
                try:
                    event = int(recv_monitor_message(mon, zmq.NOBLOCK)["event"])
                except zmq.Again:
                    break
                if event == zmq.EVENT_CONNECTED:
                    self.connected.add(i)
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.admitted.add(i)
                elif event in _FAILED_EVENTS:
                    counts, name = self.failed[kind], _FAILED_EVENTS[event]
                    counts[name] = counts.get(name, 0) + 1

    def figures(self) -> dict:
        return {"opened": self.num_opened, "with_secret": self.num_with_secret,
                "plain": self.num_opened - self.num_with_secret if self.num_opened else 0,
                "connected": len(self.connected), "admitted": len(self.admitted),
                "admitted_plain": len([i for i in self.admitted if i >= self.num_with_secret]),
                "handshakes_failed": self.failed}


async def _poisoned_request(session: aiohttp.ClientSession, url: str, headers: dict, body: dict,
                            timeout_s: float) -> dict:
    out: dict = {"status": None, "retry_after": None, "num_tokens": 0, "error": None}
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            out["status"], out["retry_after"] = resp.status, resp.headers.get("Retry-After")
            if resp.status != 200:
                out["error"] = (await resp.text())[:200]
            elif body["stream"]:
                stream = SSEStream(resp.content)
                async for event in stream:
                    if "error" in event:
                        out["error"] = str(event["error"])[:200]
                    for choice in event.get("choices") or []:
                        out["num_tokens"] += len(choice.get("token_ids") or [])
                if not stream.done:
                    out["error"] = out["error"] or "stream cut before [DONE]"
            else:
                choices = (await resp.json())["choices"]
                out["num_tokens"] = sum(len(c.get("token_ids") or []) for c in choices)
    except asyncio.TimeoutError:
        out["error"] = "hung"
    except (aiohttp.ClientError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def poisoned_client(session: aiohttp.ClientSession, spec: Any, deadline: float, rows: list[dict]) -> None:
    """`spec.num_poisoned` poisoned requests spread over the run (`spec` is the driver's spec)."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    interval_s = spec.duration_s / max(1, spec.num_poisoned)
    t0 = time.monotonic()
    for k in range(spec.num_poisoned):
        ahead = t0 + k * interval_s - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
        values = POISONED[k % len(POISONED)]
        body = {"prompt": spec.prompts[k % len(spec.prompts)], "max_tokens": POISONED_MAX_TOKENS,
                "ignore_eos": True, "return_token_ids": True, "stream": k % 2 == 1, **values}
        row: dict = {"values": values, "stream": body["stream"], "want_tokens": body["max_tokens"],
                     "attempts": [], "status": None, "num_tokens": 0, "error": None}
        t_row = time.monotonic()
        for _ in range(MAX_POISONED_ATTEMPTS):
            answer = await _poisoned_request(session, spec.url, headers, body, spec.request_timeout_s)
            row["attempts"].append(answer["status"])
            row.update(status=answer["status"], num_tokens=answer["num_tokens"], error=answer["error"])
            if answer["status"] not in (429, 503) or time.monotonic() > deadline + spec.request_timeout_s:
                break
            try:  # busy, not poisoned: the same values again after the wait it was given
                wait_s = min(float(answer["retry_after"]), RETRY_AFTER_CAP_S)
            except (TypeError, ValueError):
                wait_s = 1.0
            await asyncio.sleep(wait_s)
        row["seconds"] = round(time.monotonic() - t_row, 3)
        rows.append(row)

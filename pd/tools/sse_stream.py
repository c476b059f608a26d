"""The events of a server-sent-event (SSE) response body, as the OpenAI streaming API sends them.

`SSEStream(resp.content)` iterates the `data:` payloads, each parsed as JSON, and stops at
`data: [DONE]` (then `done` is True; the rest of the body is read and dropped, so the
connection can be reused) or at the end of the body (then `done` stays False: the stream
was cut). Other lines (comments, blank separators) are skipped. A payload that is not
JSON raises `json.JSONDecodeError`; bytes that are not UTF-8 raise `UnicodeDecodeError`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp


class SSEStream:
    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self.done = False

    async def __aiter__(self) -> AsyncIterator[dict]:
        async for raw in self._content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            yield json.loads(data)
        if self.done:
            await self._content.read()  # the body's end (a server closes it right after [DONE])

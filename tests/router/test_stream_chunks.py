"""A chat stream's content chunks come from a frame made once per stream (`ChatFormat._content_chunk`):
the same bytes as the chunk built through its pydantic models, for any text."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pd.router.openai_responses import ChatDelta, ChatFormat, Piece


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), include_usage=st.booleans(), model=st.text(min_size=1, max_size=40))
def test_content_chunk_bytes_equal_the_built_chunk(text, include_usage, model):
    """Any text (quotes, backslashes, control characters, characters past the
    basic plane), any model name, with and without the usage field: the same bytes, and valid SSE JSON."""
    fmt = ChatFormat(model, include_usage)
    built = fmt._chunk(ChatDelta(content=text))
    assert fmt.chunks(Piece(text, [1])) == [built]
    assert fmt.chunks(Piece(text + "!", [2])) == [fmt._chunk(ChatDelta(content=text + "!"))]  # the frame, reused
    body = json.loads(built.removeprefix(b"data: ").decode())
    assert body["choices"][0]["delta"] == {"content": text}
    assert ("usage" in body) == include_usage


def test_chunks_around_the_content():
    """An empty piece sends nothing; the last piece adds the finish chunk; with token ids asked for,
    the ids ride on every content chunk (the built path)."""
    fmt = ChatFormat("m", include_usage=False)
    assert fmt.chunks(Piece("", [5])) == []
    last = fmt.chunks(Piece("end", [6], "stop"))
    assert [json.loads(c.removeprefix(b"data: "))["choices"][0]["finish_reason"] for c in last] == [None, "stop"]
    with_ids = ChatFormat("m", include_usage=False, prompt_token_ids=[1, 2])
    held = with_ids.chunks(Piece("", [7]))
    assert [json.loads(c.removeprefix(b"data: "))["choices"][0]["token_ids"] for c in held] == [[7]]
